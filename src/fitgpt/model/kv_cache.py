"""A key/value cache for generation: each layer's keys and values preallocated to the context length.

Generating token t with the cache runs the model on that token alone: its keys and values are written
into the preallocated buffers (no per-token concatenation) and its query attends to all the tokens so far.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's keys and values, (B, n_kv_head, context, head_dim) each, and how many positions are filled."""

    def __init__(self, batch: int, n_kv_head: int, context: int, head_dim: int, device, dtype) -> None:
        self.k = torch.zeros(batch, n_kv_head, context, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.pos = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hd) at the next positions; returns every key and value so far."""
        T = k.size(2)
        if self.pos + T > self.k.size(2):
            raise ValueError(f"the cache holds {self.k.size(2)} positions; {self.pos + T} asked for")
        self.k[:, :, self.pos : self.pos + T] = k
        self.v[:, :, self.pos : self.pos + T] = v
        self.pos += T
        return self.k[:, :, : self.pos], self.v[:, :, : self.pos]


class KVCache:
    """Every layer's cache for one generation."""

    def __init__(self, n_layers: int, batch: int, n_kv_head: int, context: int, head_dim: int, device, dtype) -> None:
        self.context = context
        self.layers = [LayerCache(batch, n_kv_head, context, head_dim, device, dtype) for _ in range(n_layers)]

    @property
    def pos(self) -> int:
        return self.layers[0].pos

    def reset(self) -> None:
        for layer in self.layers:
            layer.pos = 0
