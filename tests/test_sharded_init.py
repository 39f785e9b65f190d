"""Under FSDP a fresh run's model is never whole on a rank: built on the meta device, checkpointed and sharded there,
then each rank fills its shards with the very weights one process draws from the same seed (issue 36, item 1)."""

import pytest
import torch

from fitgpt.config import load_config
from fitgpt.hf import import_config, import_weights
from fitgpt.model import ModelConfig, Transformer
from fitgpt.parallel.fsdp import materialise
from fitgpt.train.setup import build_model


def _initial_weights(rank: int, world: int, preset: str) -> dict | None:
    """The FSDP trainer's initial weights on the pool's ranks, gathered whole (rank 0's; None elsewhere)."""
    from gathered import full_model_state

    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.train import distributed as dist_utils
    from fitgpt.train.setup import prepare_model

    info, cpu = dist_utils.init_distributed("cpu", 60), torch.device("cpu")  # the pool's group, already joined
    cfg = load_config(preset, overrides={"parallel": "fsdp", "seed": 7})
    model = build_model(cfg, cfg.model.vocab_size, cpu, info.world)
    assert all(p.is_meta for p in model.parameters())  # never whole: nothing allocated before sharding
    prepare_model(model, parse_policy("block"), cfg, info, cpu, None)
    materialise(model, cpu, cfg.seed)
    assert not cfg.model.tied or model.lm_head.weight is model.token_embed.weight
    full = full_model_state(model, keep=info.is_main)
    return {k: v for k, v in full.items() if k != "lm_head.weight" or not cfg.model.tied} if info.is_main else None


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
def test_fsdp_ranks_start_from_the_weights_one_process_draws(preset, worlds, ranks):
    cfg = load_config(preset, overrides={"seed": 7})
    one = build_model(cfg, cfg.model.vocab_size, torch.device("cpu")).state_dict()
    for world in worlds:
        sharded = ranks(world).run(_initial_weights, preset)[0]
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


def _weights_from_folder(rank: int, world: int, hf: str, data: str) -> dict | None:
    """--init-from under FSDP: rank 0 reads the Hugging Face folder, every rank keeps its pieces; gathered whole
    (rank 0's; None elsewhere)."""
    import dataclasses

    from gathered import full_model_state

    from fitgpt.train import distributed as du
    from fitgpt.train.setup import init_from_hf, prepare_model

    info, cpu = du.init_distributed("cpu", 120), torch.device("cpu")  # the pool's group, already joined
    cfg = load_config("tiny", overrides={"parallel": "fsdp", "init_from": hf, "data": {"dir": data}})
    cfg = dataclasses.replace(cfg, model=import_config(cfg.init_from))
    model = build_model(cfg, cfg.model.vocab_size, cpu, info.world)
    assert all(p.is_meta for p in model.parameters())
    prepare_model(model, cfg.policy, cfg, info, cpu, None)
    materialise(model, cpu, cfg.seed)
    init_from_hf(cfg, model, info, cpu, sharded=True)
    full = full_model_state(model, keep=info.is_main)  # a collective: every rank gathers, rank 0 keeps
    return full if info.is_main else None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_init_from_under_fsdp_fills_each_ranks_shards_with_the_folders_weights(arch, tmp_path, ranks):
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
    sharded = ranks(2).run(_weights_from_folder, str(hf), str(tmp_path / "data"))[0]
    one = Transformer(import_config(hf))
    import_weights(hf, one)
    for k, v in one.state_dict().items():
        assert torch.equal(sharded[k], v), k
