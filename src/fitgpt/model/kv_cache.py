"""A key/value cache for generation: each layer's keys and values preallocated to the context length.

Generating token t with the cache runs the model on that token alone: its keys and values are written
into the preallocated buffers (no per-token concatenation) and its query attends to all the tokens so far.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, nkv, T, hd) -> (B, nkv * n_rep, T, hd): each key/value head shared by n_rep query heads (GQA)."""
    if n_rep == 1:
        return x
    B, nkv, T, hd = x.shape
    return x[:, :, None].expand(B, nkv, n_rep, T, hd).reshape(B, nkv * n_rep, T, hd)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None, dropout_p: float) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd), after the cached positions if a cache is given."""
    start = 0
    if cache is not None:
        start = cache.pos
        k, v = cache.append(k, v)  # (B, nkv, start + T, hd)
    rep = q.size(1) // k.size(1)
    k, v = repeat_kv(k, rep), repeat_kv(v, rep)
    T = q.size(2)
    if start == 0:  # the square causal case: training, or a prompt into an empty cache
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    # Query i sits at position start + i and sees keys 0 .. start + i.
    mask = torch.ones(T, start + T, dtype=torch.bool, device=q.device).tril(diagonal=start)  # (T, start + T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
