import math

import pytest
import torch

from fitgpt.config import PRESETS, load_config
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, Transformer


def test_shapes_and_initial_loss_is_ln_vocab(tiny_model_config):
    cfg = tiny_model_config(vocab_size=256)
    model = Transformer(cfg)
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.randint(0, 256, (4, 32))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 32, 256)
    # GPT-2 init (std 0.02) gives near-uniform predictions: loss ~ ln(vocab).
    assert abs(loss.item() - math.log(256)) < 0.05
    logits, loss = model(idx)
    assert logits.shape == (4, 32, 256) and loss is None


def test_overfits_one_batch(tiny_model_config):
    model = Transformer(tiny_model_config(vocab_size=64))
    idx = torch.randint(0, 64, (2, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2


def test_weights_tied_and_gpt2_init(tiny_model_config):
    model = Transformer(tiny_model_config())
    assert model.lm_head.weight is model.token_embed.weight
    proj = model.attn_blocks[0].attn.proj.weight
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.003


def test_context_too_long_is_a_clear_error(tiny_model_config):
    model = Transformer(tiny_model_config())
    with pytest.raises(ValueError, match="context_length 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize(
    "kw, field",
    [({"n_embed": 30, "n_head": 4}, "n_head"), ({"n_blocks": 0}, "n_blocks"), ({"dropout": 1.5}, "dropout"),
     ({"vocab_size": -1}, "vocab_size")],
)
def test_config_validation_names_the_field(kw, field, tiny_model_config):
    with pytest.raises(UserError, match=field):  # a UserError: the CLI prints it on one line
        tiny_model_config(**kw)


def test_generate_greedy_is_deterministic_and_respects_context(tiny_model_config):
    model = Transformer(tiny_model_config()).eval()
    idx = torch.randint(0, 128, (2, 5))
    a = model.generate(idx, 40, temperature=0)
    b = model.generate(idx, 40, temperature=0)
    assert a.shape == (2, 45) and torch.equal(a, b)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    s1 = model.generate(idx, 10, temperature=1.0, top_k=5, generator=g1)
    s2 = model.generate(idx, 10, temperature=1.0, top_k=5, generator=g2)
    assert torch.equal(s1, s2)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_builds(name):
    cfg = load_config(name)
    assert isinstance(cfg.model, ModelConfig)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    n = model.num_params()
    expected = {"tiny": (0.5e6, 2e6), "small": (120e6, 130e6), "medium": (340e6, 360e6), "3b": (3.0e9, 3.4e9), "llama-tiny": (0.5e6, 2e6),
                "llama-1b": (1.0e9, 1.2e9)}[name]
    assert expected[0] < n < expected[1], n


def test_3b_preset_is_the_original_repository_config():
    m = load_config("3b").model
    assert (m.vocab_size, m.context_length, m.n_embed, m.n_head, m.n_blocks) == (50304, 512, 2048, 16, 64)
