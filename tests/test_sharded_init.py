"""Under FSDP a fresh run's model is never whole on a rank: built on the meta device, checkpointed and sharded there,
then each rank fills its shards with the very weights one process draws from the same seed (issue 36, item 1)."""

import textwrap

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import finish, torchrun

from fitgpt.config import load_config
from fitgpt.model import ModelConfig, Transformer
from fitgpt.parallel import materialise
from fitgpt.train.setup import build_model

SCRIPT = textwrap.dedent('''
    """The FSDP trainer's initial weights under torchrun, gathered whole on rank 0 and saved."""
    import os
    import sys
    import torch
    from safetensors.torch import save_file
    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.config import load_config
    from fitgpt.parallel import materialise
    from fitgpt.train import distributed as dist_utils
    from fitgpt.train.setup import build_model, prepare_model

    info = dist_utils.init_distributed("cpu", 60)
    cfg = load_config(sys.argv[2], overrides={"parallel": "fsdp", "seed": 7})
    model = build_model(cfg, cfg.model.vocab_size, torch.device("cpu"), info.world)
    assert all(p.is_meta for p in model.parameters())  # never whole: nothing allocated before sharding
    prepare_model(model, parse_policy("block"), cfg, info, torch.device("cpu"), None)
    materialise(model, torch.device("cpu"), cfg.seed)
    assert not cfg.model.tied or model.lm_head.weight is model.token_embed.weight
    full = dist_utils.full_model_state(model, keep=info.is_main)
    if info.is_main:
        save_file({k: v.contiguous() for k, v in full.items() if k != "lm_head.weight" or not cfg.model.tied}, sys.argv[1])
    dist_utils.leave_together(info)  # no rank tears its connections down while rank 0 still writes
    # Out at once: tearing 4 gloo ranks down on 2 cores aborted one now and then ("terminate called without an
    # active exception"), after its work was done.
    sys.stdout.flush()
    os._exit(0)
''')


def test_the_initial_weights_do_not_depend_on_how_the_model_was_built():
    """Built on the meta device, then allocated and filled: the weights of a model built on the CPU, bitwise."""
    cfg = ModelConfig(vocab_size=64, context_length=16, n_embed=32, n_head=4, n_blocks=2)
    torch.manual_seed(3)
    whole = Transformer(cfg)
    with torch.device("meta"):
        meta = Transformer(cfg)
    materialise(meta, torch.device("cpu"), seed=3)  # plain tensors: each filled whole
    assert meta.lm_head.weight is meta.token_embed.weight  # still tied
    for (name, a), b in zip(whole.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset, worlds", [("tiny", (2, 4)), ("llama-tiny", (2,))])
def test_fsdp_ranks_start_from_the_weights_one_process_draws(preset, worlds, tmp_path):
    script = tmp_path / "init.py"
    script.write_text(SCRIPT)
    cfg = load_config(preset, overrides={"seed": 7})
    one = build_model(cfg, cfg.model.vocab_size, torch.device("cpu")).state_dict()
    for world in worlds:
        out = tmp_path / f"w{world}.safetensors"
        finish(torchrun([str(out), preset], tmp_path, nproc=world, script=str(script)))
        sharded = load_file(str(out))
        assert len(sharded) == len(one) - (1 if cfg.model.tied else 0)
        for k, v in sharded.items():
            assert torch.equal(v, one[k]), (world, k)


def test_tied_names_read_from_a_meta_model_are_the_real_ones(tiny_model_config):
    """On the meta device every tensor's storage is at 0: read from storages, every name of one shape was 'tied' and
    left out of the weight file (a sharded run's checkpoint lost lm_head.weight and more)."""
    from fitgpt.train.checkpoint import tied_names, tied_parameter_names

    cfg = tiny_model_config()
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert tied_parameter_names(meta) == tied_names(Transformer(cfg).state_dict()) == ["token_embed.weight"]
