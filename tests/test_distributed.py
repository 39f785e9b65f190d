"""DDP and FSDP on CPU (2 processes, gloo): equal to one process on the whole batch, and through torchrun."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gathered
import pytest
import torch
import torch.distributed as dist
from hang import guard
from rank_pool import free_port

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.parallel.data import sync_context
from fitgpt.train import checkpoint as ckpt
from fitgpt.train import distributed as du
from fitgpt.train.load import load_run

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=0)
CPU = torch.device("cpu")
CASES = [("ddp", "none"), ("ddp", "block"), ("ddp", "selective"), ("ddp-accum", "block"), ("fsdp", "none"), ("fsdp", "block"),
         ("fsdp", "selective"), ("fsdp-accum", "group:2")]


def _batch(cfg):
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.context_length + 1), generator=g)
    return cfg, idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _one_step(model, step_model, batches):
    opt = build_optimizer(model, OPTIM, CPU)
    for i, (x, y) in enumerate(batches):
        with sync_context(step_model, i == len(batches) - 1):
            (step_model(x, y)[1] / len(batches)).backward()
    opt.step()
    return opt


def _equal_steps(rank: int, world: int, cfg) -> dict | None:
    """One optimizer step of every case on this rank's half of the batch: the weights and first moments, gathered
    whole (rank 0's; None elsewhere)."""
    info = du.init_distributed("cpu", timeout_s=120)  # the pool's group, already joined
    cfg, x, y = _batch(cfg)
    mine = slice(2 * rank, 2 * rank + 2)  # each rank its half of the batch
    results = {}
    for mode, spec in CASES:
        parallel, accum = mode.split("-")[0], mode.endswith("accum")
        torch.manual_seed(0)
        model = Transformer(cfg)
        apply_activation_checkpointing(model, spec)  # checkpointing first, then DDP / FSDP
        step_model = du.wrap(model, info, parallel, CPU, None)
        xs, ys = x[mine], y[mine]
        batches = [(xs[:1], ys[:1]), (xs[1:], ys[1:])] if accum else [(xs, ys)]
        opt = _one_step(model, step_model, batches)
        weights = gathered.full_model_state(model)
        opt_state = gathered.full_optimizer_state(opt)
        if parallel == "fsdp" and spec == "none":
            # A full optimizer state loads back into the sharded optimizer, shard for shard.
            again = build_optimizer(model, OPTIM, CPU)
            du.load_full_optimizer_state(again, opt_state)
            for p in model.parameters():
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(again.state[p][k].to_local(), opt.state[p][k].to_local())
        results[f"{mode}/{spec}"] = {"weights": weights, "exp_avg": {i: s["exp_avg"] for i, s in opt_state["state"].items()}}
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def distributed_results(ranks, tiny_model_config):
    return ranks(2).run(_equal_steps, tiny_model_config())[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,spec", CASES)
def test_two_ranks_equal_one_process_on_the_whole_batch(distributed_results, mode, spec, tiny_model_config):
    cfg, x, y = _batch(tiny_model_config())
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = _one_step(model, model, [(x, y)])
    ref = {k: v for k, v in model.state_dict().items()}
    got = distributed_results[f"{mode}/{spec}"]
    for k, v in ref.items():
        # Adam's first update is about lr * g / |g|: where |g| is near eps (q/k weights at init), fp32
        # rounding of g moves it by a few 1e-6, and accumulation (two micro-batches summed in another order) by up to
        # 1.09e-5 at the init of this seed. Tolerance: 0.2% of the step size lr = 1e-2.
        diff = (got["weights"][k] - v).abs().max().item()
        assert diff <= 2e-5, (mode, spec, k, diff)
    ref_state = opt.state_dict()["state"]
    for i, s in ref_state.items():
        torch.testing.assert_close(got["exp_avg"][i], s["exp_avg"], rtol=1e-5, atol=1e-7)


# ---- through torchrun and the real command ---------------------------------------------------------------


TESTS = str(Path(__file__).parent)  # where helper scripts import the tests' own helpers from (``gathered``)
_on_path = lambda folder: os.pathsep.join([folder, *filter(None, [os.environ.get("PYTHONPATH")])])  # noqa: E731


def torchrun(args, cwd, nproc=2, script=None, **kw):
    target = [script] if script else ["-m", "fitgpt"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           *target, *args]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _on_path(TESTS)}, **kw)


def train_flags(data_dir, corpus_dir, out, steps, *extra):
    """The tiny preset itself (4 blocks x 128, context 128), with dropout, on the test corpus."""
    return ["train", "--data.dir", str(data_dir), "--data.inputs", str(corpus_dir), "--data.vocab-size", "512",
            "--model.dropout", "0.1", "--batch-size", "4", "--max-steps", str(steps), "--checkpoint-interval", "3",
            "--log-interval", "1", "--eval-interval", "3", "--eval-batches", "2", "--out-dir", str(out),
            "--no-progress", "--no-tensorboard", *extra]


def finish(p, timeout=300):
    out, err = p.communicate(timeout=guard(timeout))
    assert p.returncode == 0, err[-3000:]
    return out, err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_trains_and_resumes_exactly(data_dir, corpus_dir, tmp_path, ranks):
    """DDP on 2 ranks as torchrun starts them (the shared ranks: torchrun itself is launched by the tests of Ctrl-C,
    a crash, elastic restarts and exits beside busy processes), a resume bitwise the straight run."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # Written in the background (the default for CUDA ranks): each save staged, the resumed run still bitwise the same.
    flags = ("--activation-checkpointing", "block", "--async-checkpoint", "on")
    out, err = ranks(2).cli(train_flags(data_dir, corpus_dir, straight, 6, *flags))
    assert "global batch 8 = 4 per micro-batch x 1 accumulation x 2 processes, ddp" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["world_size"] == 2
    assert out.count('"run_dir"') == 1  # rank 0 alone reports
    ranks(2).cli(train_flags(data_dir, corpus_dir, resumed, 3, *flags))
    _, err = ranks(2).cli(train_flags(data_dir, corpus_dir, resumed, 6, *flags, "--resume", "latest"))
    assert "staged to host memory" in err
    a, b = weights(straight, 6), weights(resumed, 6)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    meta = json.loads((straight / "checkpoints/step_00000006/meta.json").read_text())
    assert meta["world_size"] == 2 and meta["sampler"]["kind"] == "global-batch" and meta["sampler"]["global_batch"] == 8
    # A distributed checkpoint: both ranks wrote shards (DDP's replicas are split between them), all checksummed.
    assert meta["format"] == "dcp" and {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= set(meta["files"])


def weights(run, step):
    """A checkpoint's weights, whole, as `fitgpt generate` loads them (either layout, any world size)."""
    model, _, _ = load_run(run, str(run / "checkpoints" / ckpt.checkpoint_name(step)))
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_checkpoints_move_to_one_process_and_back(data_dir, corpus_dir, tmp_path, ranks, capsys):
    """`fitgpt train --parallel fsdp` on two ranks (the session's, started as torchrun starts them), planned for its
    ranks; its checkpoint resumes in one process, and that one's on two FSDP ranks again."""
    from fitgpt.cli import main

    run = tmp_path / "run"
    # FSDP with its mixed-precision policy (bf16 compute, fp32 weights and reductions), planned for its ranks
    out, _ = ranks(2).cli(train_flags(data_dir, corpus_dir, run, 3, "--parallel", "fsdp", "--activation-checkpointing", "auto",
                                      "--memory-budget", "16MiB", "--precision", "bf16"))
    plan = json.loads(out.strip().splitlines()[-1])["memory_plan"]
    # Each rank measured its own second step (the tracker); the plan for one rank of two predicted it.
    assert len(plan["measured_peaks"]) == 2 and all(abs(m - plan["predicted_peak"]) <= 0.001 * m for m in plan["measured_peaks"]), plan
    assert weights(run, 3)["lm_head.weight"].dtype == torch.float32
    ckpt.verify_checkpoint(run / "checkpoints/step_00000003")
    # One process picks up the sharded run's checkpoint ...
    capsys.readouterr()
    assert main(train_flags(data_dir, corpus_dir, run, 6, "--resume", "latest")) == 0
    # the same stream, cut into the global batch of one process's 4 windows
    assert "the global batch changed (8 windows a step then, 4 now: --grad-accum 2 keeps it)" in capsys.readouterr().err
    # ... and two FSDP ranks pick up the single-process one.
    out, _ = ranks(2).cli(train_flags(data_dir, corpus_dir, run, 9, "--parallel", "fsdp", "--resume", "latest"))
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 9


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_under_torchrun_saves_once_and_every_rank_exits_zero(data_dir, corpus_dir, tmp_path):
    run = tmp_path / "run"
    p = torchrun(train_flags(data_dir, corpus_dir, run, 100000, "--checkpoint-interval", "100000"), tmp_path, start_new_session=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"loss"') >= 3):
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the launcher and every rank get it
    out, err = p.communicate(timeout=guard(240))
    saved = ckpt.list_checkpoints(run)
    assert len(saved) == 1, err[-3000:]
    ckpt.verify_checkpoint(saved[0])
    assert "stopped by SIGINT" in err
    assert "exitcode  : 1" not in err and "Traceback" not in err.split("stopped by SIGINT")[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_crashes_never_leaves_the_other_hanging(data_dir, corpus_dir, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from fitgpt.data import loader
        real, calls = loader.BatchSampler.next_batch, []
        def crash_on_rank_1(self, *a, **kw):
            calls.append(1)
            if os.environ["RANK"] == "1" and len(calls) == 4:
                raise RuntimeError("planted crash on rank 1")
            return real(self, *a, **kw)
        loader.BatchSampler.next_batch = crash_on_rank_1
        from fitgpt.cli import main
        sys.exit(main(sys.argv[1:]))
    """))
    t0 = time.time()
    p = torchrun(train_flags(data_dir, corpus_dir, tmp_path / "run", 1000, "--dist-timeout", "30"), tmp_path, script=str(script))
    out, err = p.communicate(timeout=guard(240))
    assert p.returncode != 0 and "planted crash on rank 1" in err
    assert time.time() - t0 < 200  # bounded by torchrun's teardown and --dist-timeout, not forever


def _compiled_and_eager_grads(rank: int, world: int, policy: str) -> dict | None:
    """One FSDP step's gradients, eager and with --compile (each block compiled before sharding), gathered whole
    (rank 0's; None elsewhere)."""
    from fitgpt.config import load_config
    from fitgpt.parallel.fsdp import materialise
    from fitgpt.train.setup import build_model, prepare_model

    torch._dynamo.reset()  # the pool's ranks outlive a test: no compiled code, or cache limit, from an earlier one
    info, grads = du.init_distributed("cpu", 300), {}  # the pool's group, already joined
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(info.rank))
    for compile in (False, True):
        cfg = load_config("tiny", overrides={"parallel": "fsdp", "compile": compile, "seed": 3, "activation_checkpointing": policy,
                                             "model": {"n_blocks": 2, "context_length": 32, "vocab_size": 512}})
        model = build_model(cfg, 512, CPU, info.world)
        step_model = prepare_model(model, cfg.policy, cfg, info, CPU, None)
        if compile:  # each block's arithmetic compiled, the model itself (and FSDP's hooks) not
            assert step_model is model and all(hasattr(b.inner.forward, "_torchdynamo_orig_callable") for b in model.attn_blocks)
        materialise(model, CPU, cfg.seed)
        _, loss = step_model(x, x)
        loss.backward()
        grads[compile] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        grads[compile]["loss"] = loss.detach()
    return grads if info.is_main else None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", ["block", "selective"])
def test_fsdp_with_compile_gets_the_gradients_of_the_eager_run(ranks, policy):
    """--compile under FSDP compiles each block before sharding (refused on main): the loss and every gradient
    equal the eager FSDP step's, to fp32 rounding (the compiled kernels sum in another order)."""
    grads = ranks(2).run(_compiled_and_eager_grads, policy, timeout=540)[0]
    assert grads[True].keys() == grads[False].keys()
    for name, eager in grads[False].items():
        torch.testing.assert_close(grads[True][name], eager, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_cpu_offload_and_kept_weights_train_exactly_as_fsdp(data_dir, corpus_dir, tmp_path, ranks):
    """--fsdp-offload (FSDP2's CPUOffloadPolicy: parameters, gradients and AdamW state in host memory, the
    optimizer stepping there) changes where the state lives, and --fsdp-reshard-after-forward never how long each
    block's gathered weights are held, not the arithmetic: the same losses as FSDP."""
    runs = {}
    for name, extra in (("plain", ()), ("offload", ("--fsdp-offload",)),
                        ("kept", ("--fsdp-reshard-after-forward", "never"))):
        out, _ = ranks(2).cli(train_flags(data_dir, corpus_dir, tmp_path / name, 3, "--parallel", "fsdp", *extra))
        runs[name] = json.loads(out.strip().splitlines()[-1])
    for name in ("offload", "kept"):
        assert runs[name]["train_loss"] == runs["plain"]["train_loss"], name
        assert runs[name]["val_loss"] == runs["plain"]["val_loss"], name


@pytest.mark.slow
def test_a_time_budget_under_torchrun_ends_every_rank_at_one_step(ranks, data_dir, corpus_dir, tmp_path):
    """The ranks decide on the largest of their clocks: they stop after the same step (one that stopped alone would
    leave the others waiting in a collective) and step with the same learning rate, and the last checkpoint is it."""
    flags = train_flags(data_dir, corpus_dir, tmp_path / "run", 1, "--parallel", "fsdp", "--optim.schedule", "wsd")
    at = flags.index("--max-steps")
    flags[at:at + 2] = ["--time-budget", "10s"]
    out, _ = ranks(2).cli(flags)
    summary = json.loads(out.strip().splitlines()[-1])
    # How many steps 10 s buys is the machine's (a busy one: a few); that every rank ends at the same one is the test's.
    assert summary["steps"] >= 1 and summary["checkpoint"].endswith(f"step_{summary['steps']:08d}")
    meta = json.loads((Path(summary["checkpoint"]) / "meta.json").read_text())
    assert meta["deadline_reached"] and meta["time_spent"] > 0
