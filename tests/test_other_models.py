"""The careless day, part 3, on other models: op-level policies on Hugging Face models with their default cache, and
pointwise with dropout and GQA (moved from test_doors.py, issue 47: files under 400 lines)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.model import ModelConfig, Transformer

# ---- activation checkpointing on other models ------------------------------------------------------------

def _hf_models():
    tf = pytest.importorskip("transformers")
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                                             bos_token_id=0, eos_token_id=0))
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                               bos_token_id=0, eos_token_id=0))
    return {"gpt2": gpt2, "llama": llama}


@pytest.mark.parametrize("spec", ["selective", "pointwise", "block"])
def test_op_level_policies_run_on_hugging_face_models_with_their_default_cache(spec):
    for name, model in _hf_models().items():
        assert model.config.use_cache  # the default, as a user has it
        apply_activation_checkpointing(model, spec)
        model.train()
        idx = torch.randint(0, 128, (2, 16))
        model(input_ids=idx, labels=idx).loss.backward()  # raised mid-backward before
        remove_activation_checkpointing(model)
        assert model.config.use_cache, name  # back as it was


class NanoBlock(nn.Module):
    """A nanoGPT-style block: hand-written causal attention (softmax, dropout on the weights), GELU MLP, dropout."""

    def __init__(self, C=32, H=4, p=0.1):
        super().__init__()
        self.ln_1, self.ln_2, self.H = nn.LayerNorm(C), nn.LayerNorm(C), H
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.attn_dropout, self.resid_dropout, self.mlp_dropout = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.H)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).tril().logical_not(), float("-inf"))
        y = self.attn_dropout(F.softmax(att, dim=-1)) @ v  # (B, nh, T, hs)
        x = x + self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.mlp_dropout(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.h, self.head = nn.Embedding(128, 32), nn.ModuleList(NanoBlock() for _ in range(4)), nn.Linear(32, 128)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return None, F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _step_flops(model, loss) -> int:
    model.train()
    with FlopCounterMode(display=False) as fc:
        loss(model).backward()
    return fc.get_total_flops()


def test_pointwise_runs_no_matmul_twice_with_dropout_and_gqa():
    """Before: 1.087x none's FLOPs on GPT-2 with dropout, 1.10x nanoGPT, 1.087x HF GPT-2, 1.025x Llama with GQA."""
    idx = torch.randint(0, 128, (2, 32))
    ours = lambda m: m(idx, idx)[1]  # noqa: E731
    hf = lambda m: m(input_ids=idx, labels=idx).loss  # noqa: E731
    models = {
        "gpt2+dropout": (Transformer(ModelConfig(vocab_size=128, context_length=32, n_embed=32, n_head=4, n_blocks=4,
                                                 dropout=0.1)), ours),
        "llama+gqa": (Transformer(ModelConfig(arch="llama", vocab_size=128, context_length=32, n_embed=32, n_head=4,
                                              n_kv_head=2, n_blocks=4)), ours),
        "nanogpt": (NanoGPT(), ours),
    }
    tf_models = _hf_models()
    tf_models["gpt2"].config.resid_pdrop = 0.1
    models |= {f"hf-{k}": (m, hf) for k, m in tf_models.items()}
    for name, (model, loss) in models.items():
        torch.manual_seed(0)
        none = _step_flops(model, loss)
        apply_activation_checkpointing(model, "pointwise")
        torch.manual_seed(0)
        assert _step_flops(model, loss) == none, name
        remove_activation_checkpointing(model)
