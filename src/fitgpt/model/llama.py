"""A Llama-family block: RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP, no biases.

Conventions are Hugging Face's ``LlamaForCausalLM`` (rotary embedding on the two halves of each head,
``rotate_half``; module names ``q_proj`` ... ``down_proj``), so that weights map one to one both ways.
Rotary angles are computed in the forward pass from the positions (no buffers: nothing to move, shard or
fake), in fp32 as Hugging Face computes them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitgpt.model.attention import attend
from fitgpt.model.config import ModelConfig
from fitgpt.model.kv_cache import LayerCache
from fitgpt.model.mup import branch


def rotary(T: int, head_dim: int, theta: float, device: torch.device, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles of positions start .. start + T - 1, each (T, head_dim), fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))  # (hd/2,)
    pos = torch.arange(start, start + T, device=device, dtype=torch.float32)  # (T,)
    freqs = torch.outer(pos, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's two halves of x (B, nh, T, hd) by the angles (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)  # each (B, nh, T, hd/2)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        C, self.n_head, self.n_kv_head = config.n_embed, config.n_head, config.kv_heads
        self.head_dim, self.theta, self.dropout = C // config.n_head, config.rope_theta, config.dropout
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(C, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        # The heads are counted from the projections (-1): under tensor parallelism each rank holds some of them.
        q = self.q_proj(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = rotary(T, hd, self.theta, x.device, cache.pos if cache else 0)
        q, k = apply_rotary(q, cos, sin).type_as(v), apply_rotary(k, cos, sin).type_as(v)
        y = attend(q, k, v, cache, self.dropout if self.training else 0.0)  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, -1))  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embed, config.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embed, config.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(config.mlp_hidden, config.n_embed, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block with rotary grouped-query attention and a SwiGLU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(config.n_embed, eps=config.norm_eps)
        self.attn = LlamaAttention(config)
        self.ln2 = nn.RMSNorm(config.n_embed, eps=config.norm_eps)
        self.mlp = SwiGLU(config)
        self.dropout = nn.Dropout(config.dropout)
        self.branch_mult = config.branch_mult

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + branch(self.dropout(self.attn(self.ln1(x), cache)), self.branch_mult)
        x = x + branch(self.dropout(self.mlp(self.ln2(x))), self.branch_mult)
        return x  # (B, T, C)
