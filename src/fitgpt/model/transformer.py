"""A GPT-style decoder: token (+ position) embeddings, pre-norm blocks, an LM head.

Two block families (``ModelConfig.arch``): GPT-2's (LayerNorm, learned positions, GELU MLP, tied head)
and Llama's (``fitgpt.model.llama``). The names follow the train-llm-from-scratch layout
(``_pre_attn_pass``, ``attn_blocks``, ``layer_norm``, ``lm_head``) for both, so that code written for
it, and every checkpointing policy, runs on either. The model holds no training or memory tricks:
checkpointing is applied from outside, by the checkpointing package. Generation may pass a
``KVCache`` (``fitgpt.model.kv_cache``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitgpt.device import loss_logits
from fitgpt.model.attention import attend
from fitgpt.model.config import ModelConfig
from fitgpt.model.kv_cache import KVCache, LayerCache
from fitgpt.model.llama import LlamaBlock
from fitgpt.model.mup import branch


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embed, 3 * config.n_embed, bias=config.has_bias)
        self.proj = nn.Linear(config.n_embed, config.n_embed, bias=config.has_bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        # Thirds, and heads counted from them (-1): under tensor parallelism a rank's projection gives the query, key
        # and value of its own heads only.
        q, k, v = self.qkv(x).chunk(3, dim=2)  # each (B, T, C)
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = attend(q, k, v, cache, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embed, 4 * config.n_embed, bias=config.has_bias)
        self.gelu = nn.GELU(approximate="tanh" if config.gelu == "tanh" else "none")
        self.proj = nn.Linear(4 * config.n_embed, config.n_embed, bias=config.has_bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))  # (B, T, C)


class LMHead(nn.Linear):
    """The output projection to vocabulary logits; given targets it also returns the mean cross-entropy.

    Head and loss are one call so that a memory policy (fitgpt's chunked loss) can wrap them together:
    the B x T x vocab logits and their log-softmax are the largest activations of a small model.
    """

    output_mult = 1.0
    """muP's output multiplier, 1 / width_mult (applied to the input: the same logits, a C-wide tensor not a vocab-wide one)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        if self.output_mult != 1.0:
            x = x * self.output_mult  # (B, T, C)
        logits = F.linear(x, self.weight, self.bias)  # (B, T, vocab)
        if targets is None:
            return logits
        loss = F.cross_entropy(loss_logits(logits).view(-1, logits.size(-1)), targets.reshape(-1).long())
        return logits, loss


class Block(nn.Module):
    """Pre-LayerNorm transformer block: a pure function of its input, apart from dropout."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embed, bias=config.has_bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embed, bias=config.has_bias)
        self.mlp = MLP(config)
        self.branch_mult = config.branch_mult

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + branch(self.attn(self.ln1(x), cache), self.branch_mult)
        x = x + branch(self.mlp(self.ln2(x)), self.branch_mult)
        return x  # (B, T, C)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        llama = config.arch == "llama"
        # PyTorch's own init as the modules are made draws from the RNG; init_weights replaces every value, and its
        # draws must not depend on whether those were made (on the meta device they are not).
        with torch.random.fork_rng(devices=[]):
            self.token_embed = nn.Embedding(config.vocab_size, config.n_embed)
            # Llama's positions are rotary, inside attention.
            self.position_embed = None if llama else nn.Embedding(config.context_length, config.n_embed)
            self.embed_dropout = nn.Dropout(config.dropout)
            block = LlamaBlock if llama else Block
            self.attn_blocks = nn.ModuleList([block(config) for _ in range(config.n_blocks)])
            self.layer_norm = (nn.RMSNorm(config.n_embed, eps=config.norm_eps) if llama
                               else nn.LayerNorm(config.n_embed, bias=config.has_bias))
            self.lm_head = LMHead(config.n_embed, config.vocab_size, bias=False)
            self.lm_head.output_mult = 1.0 / config.width_mult
        if config.tied:  # the head reuses the token embedding matrix (GPT-2 does)
            self.lm_head.weight = self.token_embed.weight
        if not any(p.is_meta for p in self.parameters()):  # on the meta device: nothing to fill until materialised
            self.init_weights()
        if config.weights_dtype == "bf16":  # pure bf16: drawn in fp32 as any run's, then rounded (buffers stay fp32)
            for p in self.parameters():
                p.data = p.data.to(torch.bfloat16)

    def init_weights(self, fill: Fill | None = None) -> None:
        """Every parameter's initial value, drawn from the global RNG in one fixed order, each parameter whole, and
        written by ``fill(param, std)`` (std 0: zeros, None: ones; default: in place). The draws do not depend on how
        the parameters are stored, so a model sharded over N processes, each filling only its shard, starts from the
        very weights one process does (``fitgpt.parallel.fill_shard``)."""
        fill = fill or fill_whole
        for name, p in self.named_parameters():  # a tied weight once
            fill(p, init_std(name, p, self.config))

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.position_embed is not None:
            n -= self.position_embed.weight.numel()
        return n

    def _pre_attn_pass(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        B, T = idx.shape
        if start + T > self.config.context_length:
            raise ValueError(
                f"sequence length {start + T} exceeds the model's context_length {self.config.context_length}"
            )
        x = self.token_embed(idx)  # (B, T, C)
        if self.position_embed is not None:
            x = x + self.position_embed(torch.arange(start, start + T, device=idx.device))  # + (T, C)
        return self.embed_dropout(x)  # (B, T, C)

    def new_cache(self, batch: int) -> KVCache:
        """An empty key/value cache for generating ``batch`` sequences, as long as the context."""
        c, p = self.config, self.token_embed.weight
        return KVCache(c.n_blocks, batch, c.kv_heads, c.context_length, c.head_dim, p.device, p.dtype)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self._pre_attn_pass(idx, cache.pos if cache else 0)  # (B, T, C)
        for i, block in enumerate(self.attn_blocks):
            x = block(x, cache.layers[i]) if cache is not None else block(x)
        x = self.layer_norm(x)
        if targets is None:
            return self.lm_head(x), None  # logits (B, T, vocab)
        # Under the chunked-loss policy the head returns logits=None: they were never held whole.
        logits, loss = self.lm_head(x, targets)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        vocab_limit: int | None = None,
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T); temperature 0 picks greedily. Ids from
        ``vocab_limit`` on are never drawn (the rows a vocabulary padded for fast matmuls adds: no token's).

        With the cache, each new token runs alone through the model; once the context is full, the cache is
        refilled from the last context_length tokens for each token, exactly what recomputing does."""
        T_max = self.config.context_length
        cache = self.new_cache(idx.size(0)) if use_cache else None
        for _ in range(max_new_tokens):
            if cache is None:
                logits, _ = self(idx[:, -T_max:])
            else:
                if cache.pos == 0 or cache.pos + 1 > T_max:  # (re)fill from the prompt or the last window
                    cache.reset()
                    logits, _ = self(idx[:, -T_max:], cache=cache)
                else:
                    logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :]  # (B, vocab)
            if vocab_limit is not None:
                logits[:, vocab_limit:] = -float("inf")
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


Fill = Callable[[nn.Parameter, "float | None"], None]


def init_std(name: str, p: torch.Tensor, config: ModelConfig) -> float | None:
    """GPT-2's init: matrices and embeddings N(0, 0.02), biases zero, norm weights one; the projections that write
    into the residual stream scaled by 1/sqrt(2N), so that the residual's variance does not grow with depth. Under
    muP the hidden matrices' std is divided by sqrt(width_mult) (variance as 1 / fan-in), and under CompleteP N is
    the base depth (its branch multiplier does the rest)."""
    if p.dim() == 1:
        return 0.0 if name.endswith("bias") else None
    if name.startswith(("token_embed.", "position_embed.", "lm_head.")):
        return 0.02
    std = 0.02 / math.sqrt(config.width_mult)
    if name.endswith(("attn.proj.weight", "mlp.proj.weight", "o_proj.weight", "down_proj.weight")):
        return std / math.sqrt(2 * (config.mup_base_depth or config.n_blocks))
    return std


@torch.no_grad()
def fill_whole(p: torch.Tensor, std: float | None) -> None:
    if std is None:
        p.fill_(1.0)
    elif std == 0:
        p.zero_()
    else:
        p.normal_(mean=0.0, std=std)
