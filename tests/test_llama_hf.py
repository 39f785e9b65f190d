"""The Llama block counted, the KV cache exact, and the Hugging Face door both ways."""

import json

import pytest
import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.cli import main
from fitgpt.errors import UserError
from fitgpt.memory import measure_step_flops, measure_step_memory
from fitgpt.model import ModelConfig, Transformer
from fitgpt.train.load import load_run

B, T, C, N, V, KV = 4, 64, 128, 4, 512, 2
H = 384  # 8/3 C rounded up to a multiple of 64
BOUNDARY = B * T * C * 4
KV_C = C * KV // 4  # the width of k and v with 2 of 4 heads


@pytest.fixture(scope="module")
def llama_counted():
    cfg = ModelConfig(arch="llama", vocab_size=V, context_length=T, n_embed=C, n_head=4, n_kv_head=KV, n_blocks=N)
    assert cfg.mlp_hidden == H and not cfg.has_bias and not cfg.tied
    torch.manual_seed(0)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    out = {}
    for spec in ("none", "block", "selective", "pointwise"):
        apply_activation_checkpointing(model, spec)
        out[spec] = (measure_step_memory(model, idx, targets, blocks=model.attn_blocks), measure_step_flops(model, idx, targets))
        remove_activation_checkpointing(model)
    return out


def test_llama_block_memory_and_flops_are_counted(llama_counted):
    none, block = llama_counted["none"], llama_counted["block"]
    assert block[0].block_bytes == [BOUNDARY] * N  # only its output, the next block's input
    assert sum(none[0].block_bytes) > 10 * sum(block[0].block_bytes)
    bt = B * T
    fwd = 2 * bt * (2 * C * C + 2 * C * KV_C + 3 * C * H) + 4 * B * T * T * C  # q, o; k, v; gate, up, down; attention
    # Full recompute runs the forward again but stops before the last matmul (the down-projection).
    assert block[1] - none[1] == N * (fwd - 2 * bt * H * C)
    # Pointwise keeps every matmul output a recompute would need, grouped-query attention's narrow k and v
    # projections too (they were recomputed before, 2 C x C/2 per block): the step's FLOPs are none's.
    assert llama_counted["pointwise"][1] == none[1]
    assert sum(llama_counted["pointwise"][0].block_bytes) < 0.75 * sum(none[0].block_bytes)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_generation_equals_recomputing(arch):
    """Greedy tokens with the KV cache equal those without, past the context length too (the cache refills)."""
    kw = {"arch": "llama", "n_kv_head": 2} if arch == "llama" else {}
    cfg = ModelConfig(vocab_size=97, context_length=24, n_embed=32, n_head=4, n_blocks=3, **kw)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    idx = torch.randint(0, 97, (2, 7))
    cached = model.generate(idx, 40, temperature=0, use_cache=True)
    assert torch.equal(cached, model.generate(idx, 40, temperature=0, use_cache=False))
    # and the logits of one cached step equal the full forward's last position
    cache = model.new_cache(2)
    with torch.no_grad():
        model(idx[:, :-1], cache=cache)
        step = model(idx[:, -1:], cache=cache)[0][:, -1]
        full = model(idx)[0][:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-6)
    assert cache.pos == 7 and cache.layers[0].k.shape == (2, cfg.kv_heads, 24, 8)


def test_model_config_errors_name_the_flag():
    with pytest.raises(UserError, match="--model.n-kv-head"):
        ModelConfig(arch="llama", n_head=4, n_kv_head=3)
    with pytest.raises(UserError, match="drop --model.bias"):
        ModelConfig(arch="llama", bias=True)
    with pytest.raises(UserError, match="for --model.arch llama"):
        ModelConfig(n_kv_head=2)
    # switching the architecture switches the defaults that depend on it
    assert ModelConfig(arch="llama").has_bias is False and ModelConfig().has_bias is True


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, data_dir, corpus_dir):
    """A few steps of a tiny GPT-2 and a tiny Llama on the session's data."""
    from fitgpt.config import load_config
    from fitgpt.train.trainer import train

    runs = {}
    for arch in ("gpt2", "llama"):
        out = tmp_path_factory.mktemp(arch)
        model = {"arch": arch, "context_length": 32, "n_embed": 32, "n_head": 4, "n_blocks": 2, "dropout": 0.0}
        if arch == "llama":
            model["n_kv_head"] = 2
        cfg = load_config("tiny", overrides={
            "model": model, "data": {"dir": str(data_dir), "inputs": [str(corpus_dir)], "vocab_size": 512},
            "batch_size": 4, "max_steps": 4, "eval_interval": 100, "checkpoint_interval": 4, "out_dir": str(out),
            "progress": False, "tensorboard": False})
        train(cfg)
        runs[arch] = out
    return runs


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_export_loads_in_transformers_with_the_same_logits_and_tokens(arch, trained_runs, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", "--run", str(trained_runs[arch]), "--out", str(out)]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    model, tokenizer, _ = load_run(trained_runs[arch])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert type(hf).__name__ == ("LlamaForCausalLM" if arch == "llama" else "GPT2LMHeadModel")
    text = "def main(argv):\n    return sorted(argv)"
    ids = tokenizer.encode(text)
    assert hf_tok(text)["input_ids"] == ids and hf_tok.eos_token_id == tokenizer.eot_id
    x = torch.tensor([ids[:32]])
    with torch.no_grad():
        ours, theirs = model(x)[0], hf(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    greedy = hf.generate(x[:, :8], max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eot_id)
    assert torch.equal(model.generate(x[:, :8], 16, temperature=0), greedy)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_init_from_a_hf_folder_round_trips(arch, trained_runs, tmp_path, cli_train_args, capsys):
    """Export, train from the export: the first logits equal the run's; the config is the imported one."""
    pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    assert main(["export", "--run", str(trained_runs[arch]), "--out", str(hf_dir)]) == 0
    run = tmp_path / "again"
    args = cli_train_args(run, steps=1) + ["--init-from", str(hf_dir), "--optim.lr", "1e-9", "--optim.min-lr", "1e-10"]
    assert main(args) == 0, capsys.readouterr().err
    a, _, _ = load_run(trained_runs[arch])
    b, _, _ = load_run(run)
    assert b.config.arch == arch and b.config.n_blocks == a.config.n_blocks
    x = torch.randint(0, 500, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(b(x)[0], a(x)[0], rtol=0, atol=1e-5)  # lr 1e-9: one step moves next to nothing
    saved = json.loads((run / "config.json").read_text())
    assert saved["init_from"] == str(hf_dir) and saved["model"]["arch"] == arch


def test_import_refuses_what_it_cannot_map(tmp_path, capsys, cli_train_args):
    transformers = pytest.importorskip("transformers")
    from fitgpt.hf import import_config

    d = tmp_path / "scaled"
    transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}).save_pretrained(d)
    with pytest.raises(UserError, match="rope scaling 'linear' is not implemented"):
        import_config(d)
    other = tmp_path / "bert"
    transformers.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64).save_pretrained(other)
    with pytest.raises(UserError, match="model_type 'bert' cannot be imported"):
        import_config(other)
    assert main(cli_train_args(tmp_path / "r") + ["--init-from", str(tmp_path / "nothing")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["export", "--run", str(tmp_path / "norun"), "--out", str(tmp_path / "x")]) == 2
