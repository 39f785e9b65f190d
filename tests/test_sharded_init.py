"""Under FSDP a fresh run's model is never whole on a rank: built on the meta device, checkpointed and sharded there,
then each rank fills its shards with the very weights one process draws from the same seed (issue 36, item 1)."""

import textwrap

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import SAVE_AND_LEAVE, finish, torchrun

from fitgpt.config import load_config
from fitgpt.hf import import_config, import_weights
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
    from gathered import full_model_state

    full = full_model_state(model, keep=info.is_main)
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


INIT_FROM = textwrap.dedent('''
    """--init-from under FSDP: rank 0 reads the Hugging Face folder, every rank keeps its pieces; gathered and saved."""
    import dataclasses
    import sys
    import torch
    from fitgpt.config import load_config
    from fitgpt.hf import import_config
    from fitgpt.parallel import materialise
    from fitgpt.train import distributed as du
    from fitgpt.train.setup import build_model, init_from_hf, prepare_model

    info = du.init_distributed("cpu", 120)
    cpu = torch.device("cpu")
    cfg = load_config("tiny", overrides={"parallel": "fsdp", "init_from": sys.argv[2], "data": {"dir": sys.argv[3]}})
    cfg = dataclasses.replace(cfg, model=import_config(cfg.init_from))
    model = build_model(cfg, cfg.model.vocab_size, cpu, info.world)
    assert all(p.is_meta for p in model.parameters())
    prepare_model(model, cfg.policy, cfg, info, cpu, None)
    materialise(model, cpu, cfg.seed)
    init_from_hf(cfg, model, info, cpu, sharded=True)
    from gathered import full_model_state

    save_and_leave(info, full_model_state(model, keep=info.is_main))
''')


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_init_from_under_fsdp_fills_each_ranks_shards_with_the_folders_weights(arch, tmp_path):
    """The model is never whole on a rank but rank 0 (which reads the folder): gathered, the weights are the ones one
    process imports (main built the whole model on every rank, then sharded it)."""
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=512, n_positions=32)
        transformers.GPT2LMHeadModel(config).save_pretrained(hf)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=64, vocab_size=512, max_position_embeddings=32, tie_word_embeddings=False)
        transformers.LlamaForCausalLM(config).save_pretrained(hf)
    script, out = tmp_path / "init_from.py", tmp_path / "w.pt"
    script.write_text(SAVE_AND_LEAVE + INIT_FROM)
    finish(torchrun([str(out), str(hf), str(tmp_path / "data")], tmp_path, script=str(script)))
    sharded = torch.load(out, weights_only=True)
    one = Transformer(import_config(hf))
    import_weights(hf, one)
    for k, v in one.state_dict().items():
        assert torch.equal(sharded[k], v), k
