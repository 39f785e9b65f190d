"""A GPT-style decoder: token + position embeddings, pre-LayerNorm blocks, a tied LM head.

The names follow the train-llm-from-scratch layout (``_pre_attn_pass``, ``attn_blocks``,
``layer_norm``, ``lm_head``) so that code written for it runs here. The model holds no training
or memory tricks: checkpointing is applied from outside, by the checkpointing package.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fitgpt.model.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embed, 3 * config.n_embed, bias=config.bias)
        self.proj = nn.Linear(config.n_embed, config.n_embed, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embed, 4 * config.n_embed, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embed, config.n_embed, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))  # (B, T, C)


class LMHead(nn.Linear):
    """The output projection to vocabulary logits; given targets it also returns the mean cross-entropy.

    Head and loss are one call so that a memory policy (fitgpt's chunked loss) can wrap them together:
    the B x T x vocab logits and their log-softmax are the largest activations of a small model.
    """

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        logits = F.linear(x, self.weight, self.bias)  # (B, T, vocab)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1).long())
        return logits, loss


class Block(nn.Module):
    """Pre-LayerNorm transformer block: a pure function of its input, apart from dropout."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embed, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embed, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x  # (B, T, C)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embed = nn.Embedding(config.vocab_size, config.n_embed)
        self.position_embed = nn.Embedding(config.context_length, config.n_embed)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.attn_blocks = nn.ModuleList([Block(config) for _ in range(config.n_blocks)])
        self.layer_norm = nn.LayerNorm(config.n_embed, bias=config.bias)
        self.lm_head = LMHead(config.n_embed, config.vocab_size, bias=False)
        # Weight tying (GPT-2): the head reuses the token embedding matrix.
        self.lm_head.weight = self.token_embed.weight
        self.apply(self._init_weights)
        # GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2N),
        # so that the residual's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_blocks))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.position_embed.weight.numel()
        return n

    def _pre_attn_pass(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.context_length:
            raise ValueError(
                f"sequence length {T} exceeds the model's context_length {self.config.context_length}"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.embed_dropout(self.token_embed(idx) + self.position_embed(pos))  # (B, T, C)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self._pre_attn_pass(idx)  # (B, T, C)
        for block in self.attn_blocks:
            x = block(x)
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
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T); temperature 0 picks greedily."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.context_length :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :]  # (B, vocab)
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
