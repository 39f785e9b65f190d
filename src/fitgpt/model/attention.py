"""Causal self-attention as both blocks (GPT-2's and Llama's) call it: grouped-query heads repeated, and an
optional key/value cache (generation) whose positions the queries follow."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fitgpt.model.kv_cache import LayerCache


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
