"""The seed article's three snippets, with only their imports changed, run against our Transformer.

Methods 1 and 2 elide the loss ("# ... loss calculation remains unchanged"); we fill in the model's
own loss there. Each must give the gradients of the plain model. Method 2 as written leaves the last
block of every chunk un-checkpointed, which the memory test below measures.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch.utils.checkpoint import checkpoint_sequential

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.memory import measure_step_memory
from fitgpt.model import Transformer


class Method1(Transformer):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor = None):
        x = self._pre_attn_pass(idx)

        # Replace plain block calls with checkpointed calls

        for block in self.attn_blocks:
            x = checkpoint.checkpoint(block, x, use_reentrant=False)

        x = self.layer_norm(x)
        logits = self.lm_head(x)
        # ... loss calculation remains unchanged
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

        return logits, loss


class Method2(Transformer):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor = None):
        x = self._pre_attn_pass(idx)

        # Configure chunk size based on your GPU memory/compute budget

        chunksize = 2
        block_chunks = [
            self.attn_blocks[i:i + chunksize]
            for i in range(0, len(self.attn_blocks), chunksize)
        ]

        for chunk in block_chunks:
            x = checkpoint_sequential(
                nn.ModuleList(chunk),
                len(chunk),
                x,
                use_reentrant=False,
            )

        x = self.layer_norm(x)
        logits = self.lm_head(x)
        # ... loss calculation
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

        return logits, loss


def method3(model):
    # scripts/train_transformer.py, verbatim apart from imports and use_reentrant.
    def checkpointed_forward(idx, targets=None):
        x = model._pre_attn_pass(idx)

        # Apply checkpointing to each attention block

        for block in model.attn_blocks:
            x = checkpoint.checkpoint(block, x, use_reentrant=False)

        x = model.layer_norm(x)
        logits = model.lm_head(x)

        loss = None
        if targets is not None:
            B, T, C = logits.shape
            loss = F.cross_entropy(
                logits.view(B * T, C),
                targets.view(B * T).long()
            )
        return logits, loss

    # Replace model forward without altering src/models/

    model.forward = checkpointed_forward
    return model


def _grads(model, idx, targets):
    model.zero_grad()
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_three_snippets_match_the_plain_model(tiny_model_config):
    cfg = tiny_model_config()
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    targets = torch.randint(0, cfg.vocab_size, (2, 32))
    torch.manual_seed(0)
    plain = Transformer(cfg)
    ref_loss, ref = _grads(plain, idx, targets)
    for make in (lambda: Method1(cfg), lambda: Method2(cfg), lambda: method3(Transformer(cfg))):
        torch.manual_seed(0)
        model = make()
        model.load_state_dict(plain.state_dict())
        loss, grads = _grads(model, idx, targets)
        assert torch.equal(loss, ref_loss)
        for name, g in grads.items():
            assert torch.equal(g, ref[name]), name


def test_method_2_keeps_half_the_blocks(tiny_model_config):
    B, T, C, N, V = 4, 64, 128, 8, 4096
    boundary = B * T * C * 4  # one fp32 (B, T, C) tensor
    cfg = tiny_model_config(vocab_size=V, context_length=T, n_embed=C, n_head=4, n_blocks=N)
    torch.manual_seed(0)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    seed_model = Method2(cfg)
    seed_model.load_state_dict(model.state_dict())
    seed = sum(measure_step_memory(seed_model, idx, targets, blocks=seed_model.attn_blocks).block_bytes)
    none = sum(measure_step_memory(model, idx, targets, blocks=model.attn_blocks).block_bytes)
    apply_activation_checkpointing(model, "block")
    block = sum(measure_step_memory(model, idx, targets, blocks=model.attn_blocks).block_bytes)
    # checkpoint_sequential never checkpoints its last segment: every second block keeps everything.
    assert seed == (N // 2) * (16 * boundary + 8192) + (N // 2) * boundary
    assert seed / none > 0.5 and block / none < 0.07
