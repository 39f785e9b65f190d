"""muP (width) and CompleteP (depth): the standard parametrisation exactly at the base shape, and away from it the
multipliers, initialisation and per-width learning rates that make one step's change in the model's output the same
size at every width (Yang et al. 2022's coordinate check)."""

import math

import pytest
import torch

from fitgpt.config import OptimConfig
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, Transformer
from fitgpt.model.transformer import init_std
from fitgpt.optim import build_optimizer, set_lr


def _steps(cfg: ModelConfig, optim: OptimConfig, steps: int = 3) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, optim, torch.device("cpu"))
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for i in range(steps):
        set_lr(opt, 1e-3 * (i + 1))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("arch, optim", [("gpt2", "adamw"), ("llama", "adamw"), ("gpt2", "muon")])
def test_at_the_base_shape_mup_is_the_standard_parametrisation_exactly(arch, optim):
    sp = ModelConfig(arch=arch, n_embed=64, n_head=2, n_blocks=2)
    mup = ModelConfig(arch=arch, n_embed=64, n_head=2, n_blocks=2, mup_base_width=64, mup_base_depth=2)
    a, b = _steps(sp, OptimConfig(name=optim)), _steps(mup, OptimConfig(name=optim))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_a_wider_deeper_shape_takes_the_base_shapes_rates_scaled():
    cfg = ModelConfig(n_embed=256, n_head=4, n_blocks=4, mup_base_width=64, mup_base_depth=1)
    model = Transformer(cfg)
    assert model.lm_head.output_mult == 0.25 and all(b.branch_mult == 0.25 for b in model.attn_blocks)
    w = model.attn_blocks[0].attn.qkv.weight
    assert init_std("attn_blocks.0.attn.qkv.weight", w, cfg) == 0.02 / 2
    assert init_std("attn_blocks.0.mlp.proj.weight", w, cfg) == 0.02 / 2 / math.sqrt(2)  # the base depth's 1/sqrt(2)
    assert init_std("token_embed.weight", model.token_embed.weight, cfg) == 0.02
    opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1), torch.device("cpu"))
    set_lr(opt, 4e-3)
    hidden = {id(model.attn_blocks[0].attn.qkv.weight), id(model.attn_blocks[3].mlp.fc.weight)}
    for g in opt.param_groups:
        inside = {id(p) for p in g["params"]} & hidden
        assert (g["lr"], g["weight_decay"]) == ((1e-3, 0.4) if inside else (4e-3, g["weight_decay"]))
    # the optimizer's parameters in the model's order: its saved state is numbered by it
    from fitgpt.optim import optimizer_params
    assert [p for g in opt.param_groups for p in g["params"]] == optimizer_params(model)


def _output_change(width: int, mup: bool) -> float:
    """The RMS change of the logits after one AdamW step at ``width`` (one block, heads of 32)."""
    cfg = ModelConfig(n_embed=width, n_head=width // 32, n_blocks=1, mup_base_width=64 if mup else 0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0), torch.device("cpu"))
    set_lr(opt, 1e-2)
    x = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)[0]
    model(x, x)[1].backward()
    opt.step()
    with torch.no_grad():
        return float((model(x)[0] - before).pow(2).mean().sqrt())


def test_mup_keeps_one_steps_change_in_the_output_the_same_size_across_widths():
    """The coordinate check: under the standard parametrisation the logits' change in one step grows with width
    (Adam's update is the same size per coordinate, summed over a wider fan-in); under muP it stays put."""
    sp = _output_change(512, False) / _output_change(128, False)
    mup = _output_change(512, True) / _output_change(128, True)
    assert sp > 2.5, sp  # 3.0 measured
    assert 0.6 < mup < 1.4, mup  # 0.72 measured


def test_a_negative_base_is_one_line_naming_the_flag():
    with pytest.raises(UserError, match="--model.mup-base-width"):
        ModelConfig(mup_base_width=-1)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_mup_model_exports_to_hugging_face_with_its_multipliers_folded_in(arch):
    transformers = pytest.importorskip("transformers")
    from fitgpt.hf import hf_config, to_hf_state

    cfg = ModelConfig(arch=arch, vocab_size=97, context_length=24, n_embed=64, n_head=2, n_blocks=3, tie_embeddings=False,
                      mup_base_width=32, mup_base_depth=1)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.GPT2LMHeadModel
    hf = cls(hf_config(cfg)).eval()
    hf.load_state_dict(to_hf_state(model), strict=True)
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        assert (model(x)[0] - hf(x).logits).abs().max().item() <= 1e-5
    tied = Transformer(ModelConfig(vocab_size=97, context_length=24, n_embed=64, n_head=2, n_blocks=1, mup_base_width=32))
    with pytest.raises(UserError, match="--model.tie-embeddings False"):
        to_hf_state(tied)
