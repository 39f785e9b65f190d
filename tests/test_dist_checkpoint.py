"""Distributed checkpoints (issue 36, items 3-5), on a one-rank gloo group in this process: each promise of a
checkpoint (a temporary directory renamed once complete, checksums, latest's fallback, --keep-last, a failed write
never taken for a checkpoint) and the background save's staging. The torchrun tests (2 and 4 ranks, resharding, a
rank lost mid-write) are in test_distributed.py and test_elastic.py."""

import errno
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hang import guard
from test_distributed import torchrun, train_flags
from torch.distributed.checkpoint import FileSystemWriter

from fitgpt.config import OptimConfig, load_config
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.train import checkpoint as ckpt
from fitgpt.train import distributed as du
from fitgpt.train.dist_checkpoint import DistributedSaver, init_optimizer_state, load_optimizer

CPU = torch.device("cpu")


@pytest.fixture
def group():
    """A one-rank gloo process group: DCP's collectives, as under torchrun, without launching it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield du.DistInfo(rank=0, world=1)
    dist.destroy_process_group()


def _trained(tiny_model_config, optim="adamw"):
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(n_blocks=2))
    opt = build_optimizer(model, OptimConfig(name=optim), CPU)
    x = torch.randint(0, 128, (2, 32))
    for _ in range(2):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(saver, step, model, opt):
    state = {"scaler": {}, "rng": {"torch": torch.get_rng_state()}, "rng_ranks": [{"torch": torch.get_rng_state()}]}
    meta = {"config": {"model": {}}, "sampler": {}, "world_size": 1}
    return saver.save(step, model, opt, state, meta)


@pytest.mark.parametrize("background", [False, True])
def test_a_saved_checkpoint_reads_back_exactly_and_verifies(group, tiny_model_config, tmp_path, background):
    model, opt = _trained(tiny_model_config)
    saver = DistributedSaver(group, tmp_path, keep_last=3, background=background, timeout_s=60)
    path = _save(saver, 2, model, opt)  # written: this one; in the background: the one before (none)
    path = saver.close() or path  # the save in flight, finished
    assert path == tmp_path / "checkpoints/step_00000002"
    meta = ckpt.verify_checkpoint(path)
    assert meta["format"] == "dcp" and set(meta["files"]) == {"dcp/__0_0.distcp", "dcp/.metadata", "train_state.pt"}
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))
    torch.manual_seed(1)
    again = Transformer(tiny_model_config(n_blocks=2))
    ckpt.load_weights(path, again)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    assert again.lm_head.weight is again.token_embed.weight  # the tied name is read through the one kept
    opt2 = build_optimizer(again, OptimConfig(), CPU)
    load_optimizer(opt2, ckpt.load_state(path, ckpt.verify_checkpoint(path))["optimizer"], du.DistInfo())  # one process: read whole
    _same_optimizer_state(opt, opt2)


def _same_optimizer_state(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]) if torch.is_tensor(v) else v == sb[i][k], (i, k)


# APOLLO's: a fresh optimizer already holds each projected matrix's seed, and once read as state made (issue 69: a
# resumed distributed run read nothing into its moments, and went on from zeros).
@pytest.mark.parametrize("optim", ["adamw", "apollo-mini"])
def test_each_rank_reads_the_optimizer_into_its_own_state_in_place(group, tiny_model_config, tmp_path, optim):
    """Under torchrun the state is read into the optimizer's own tensors, made by a step at lr 0 that leaves the
    weights bitwise as they were."""
    model, opt = _trained(tiny_model_config, optim)
    saver = DistributedSaver(group, tmp_path, keep_last=3, background=False, timeout_s=60)
    path = _save(saver, 2, model, opt)
    fresh = build_optimizer(model, OptimConfig(name=optim), CPU)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    init_optimizer_state(fresh)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    saved = ckpt.load_state(path, ckpt.verify_checkpoint(path))["optimizer"]
    load_optimizer(fresh, saved, du.DistInfo(rank=0, world=2))  # as a rank reads it
    _same_optimizer_state(opt, fresh)


def test_a_background_save_holds_the_state_of_its_step(group, tiny_model_config, tmp_path):
    """Staged before the step goes on: weights changed while it is written are not in it."""
    model, opt = _trained(tiny_model_config)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    saver = DistributedSaver(group, tmp_path, keep_last=3, background=True, timeout_s=60)
    _save(saver, 2, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    path = saver.close()
    again = Transformer(tiny_model_config(n_blocks=2))
    ckpt.load_weights(path, again)
    for k, v in again.state_dict().items():
        assert torch.equal(v, expected[k]), k


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_write_is_reported_and_never_taken_for_a_checkpoint(group, tiny_model_config, tmp_path, monkeypatch,
                                                                     background):
    model, opt = _trained(tiny_model_config)
    saver = DistributedSaver(group, tmp_path, keep_last=3, background=background, timeout_s=60)
    _save(saver, 2, model, opt)
    saver.wait()

    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    full = r"could not write checkpoint step 4 .*: No space left on device\. .*newest intact: .*step_00000002"
    with pytest.raises(ckpt.CheckpointSaveError, match=full):
        _save(saver, 4, model, opt)
        saver.wait()  # in the background the failure is known here
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002"]
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))
    ckpt.verify_checkpoint(tmp_path / "checkpoints/step_00000002")


def test_latest_falls_back_past_a_damaged_shard_and_keep_last_prunes(group, tiny_model_config, tmp_path):
    model, opt = _trained(tiny_model_config)
    saver = DistributedSaver(group, tmp_path, keep_last=2, background=True, timeout_s=60)
    for step in (1, 2, 3):
        _save(saver, step, model, opt)
    saver.close()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    shard = tmp_path / "checkpoints/step_00000003/dcp/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="does not match the sha256"):
        ckpt.verify_checkpoint(shard.parent.parent)
    path, _ = ckpt.resolve_resume(tmp_path, "latest")
    assert path.name == "step_00000002"


def test_a_checkpoint_missing_a_shard_or_naming_a_file_outside_it_is_corrupt(group, tiny_model_config, tmp_path):
    model, opt = _trained(tiny_model_config)
    path = _save(DistributedSaver(group, tmp_path, keep_last=3, background=False, timeout_s=60), 2, model, opt)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    meta = json.loads((bad / ckpt.META_FILE).read_text())
    meta["files"]["../../elsewhere"] = meta["files"]["train_state.pt"]
    (bad / ckpt.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="outside the checkpoint"):
        ckpt.verify_checkpoint(bad)
    (path / "dcp/__0_0.distcp").unlink()
    with pytest.raises(ckpt.CheckpointError, match="__0_0.distcp is missing"):
        ckpt.verify_checkpoint(path)


def test_low_bit_moments_round_trip_through_a_distributed_checkpoint(group, tiny_model_config, tmp_path):
    pytest.importorskip("torchao")
    model, opt = _trained(tiny_model_config, "adamw8bit")
    path = _save(DistributedSaver(group, tmp_path, keep_last=3, background=False, timeout_s=60), 2, model, opt)
    for world in (1, 2):  # read whole by one process, and in place as a rank reads it
        fresh = build_optimizer(model, OptimConfig(name="adamw8bit"), CPU)
        load_optimizer(fresh, ckpt.load_state(path, ckpt.verify_checkpoint(path))["optimizer"], du.DistInfo(rank=0, world=world))
        _same_optimizer_state(opt, fresh)
        for i, moments in opt.state_dict()["lowbit_exact"].items():
            for k, codes in moments.items():
                assert torch.equal(codes["codes"], fresh.state_dict()["lowbit_exact"][i][k]["codes"]), (world, i, k)



@pytest.mark.slow
def test_an_optimizer_state_of_plain_numbers_reads_back_in_place_and_saves_again(group, tiny_model_config, tmp_path):
    """GaLore's AdamW keeps its step as a Python int: read in place (as a rank reads), DCP handed it back under the
    key "0" beside the parameter's own entry 0, and the next save failed with "duplicated flatten key
    optimizer.state.0.step" (issue 68): every step after a resume was lost."""
    pytest.importorskip("galore_torch")
    model, opt = _trained(tiny_model_config, "galore-adamw")
    saver = DistributedSaver(group, tmp_path, keep_last=3, background=False, timeout_s=60)
    path = _save(saver, 2, model, opt)
    fresh = build_optimizer(model, OptimConfig(name="galore-adamw"), CPU)
    load_optimizer(fresh, ckpt.load_state(path, ckpt.verify_checkpoint(path))["optimizer"], du.DistInfo(rank=0, world=2))
    assert all(isinstance(p, torch.Tensor) for p in fresh.state)
    assert [s["step"] for s in fresh.state_dict()["state"].values()] == [s["step"] for s in opt.state_dict()["state"].values()]
    assert _save(saver, 3, model, fresh).name == "step_00000003"

# ---- under torchrun ---------------------------------------------------------------------------------

def _read_by_ranks(rank: int, world: int, path: str) -> dict | None:
    """A distributed checkpoint read by the pool's FSDP ranks (however many wrote it), gathered whole (rank 0's; None
    elsewhere)."""
    from gathered import full_model_state, full_optimizer_state

    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.parallel.fsdp import materialise
    from fitgpt.train.setup import build_model, prepare_model

    info, path = du.init_distributed("cpu", 120), Path(path)  # the pool's group, already joined
    cfg = load_config("tiny", str(path.parent.parent / "config.json"))
    model = build_model(cfg, cfg.model.vocab_size, CPU, info.world)  # on the meta device: never whole
    prepare_model(model, parse_policy("none"), cfg, info, CPU, None)
    materialise(model, CPU, cfg.seed)
    ckpt.load_weights(path, model)
    optimizer = build_optimizer(model, cfg.optim, CPU)
    load_optimizer(optimizer, ckpt.load_state(path, ckpt.verify_checkpoint(path))["optimizer"], info)
    # Collectives: every rank gathers, rank 0 keeps.
    weights, state = full_model_state(model, keep=info.is_main), full_optimizer_state(optimizer, keep=info.is_main)
    return {"model": weights, "optimizer": state} if info.is_main else None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_of_two_fsdp_ranks_reads_into_four_and_into_one(data_dir, corpus_dir, tmp_path, ranks):
    """N -> M and N -> 1: four ranks, each reading its own shards' pieces, hold exactly what one process reads."""
    run = tmp_path / "run"
    ranks(2).cli(train_flags(data_dir, corpus_dir, run, 3, "--parallel", "fsdp"))
    path = run / "checkpoints/step_00000003"
    assert json.loads((path / ckpt.META_FILE).read_text())["format"] == "dcp"
    four = ranks(4).run(_read_by_ranks, str(path))[0]
    cfg = load_config("tiny", str(run / "config.json"))
    model = Transformer(cfg.model)
    ckpt.load_weights(path, model)  # one process: every piece
    optimizer = build_optimizer(model, cfg.optim, CPU)
    load_optimizer(optimizer, ckpt.load_state(path, ckpt.verify_checkpoint(path))["optimizer"], du.DistInfo())
    for k, v in model.state_dict().items():
        assert torch.equal(four["model"][k], v), k
    one = optimizer.state_dict()["state"]
    assert four["optimizer"]["state"].keys() == one.keys()
    for i, s in one.items():
        for k, v in s.items():
            assert torch.equal(four["optimizer"]["state"][i][k], v), (i, k)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_rank_killed_while_writing_leaves_no_checkpoint_that_looks_complete(data_dir, corpus_dir, tmp_path, mode):
    """Rank 1 dies half-way through its shard of step 6: step 3 stays the newest checkpoint, intact, and nothing of
    step 6 looks like a checkpoint (its temporary directory has no meta.json and is never listed)."""
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent('''
        import os, sys
        from torch.distributed.checkpoint import FileSystemWriter
        real, calls = FileSystemWriter.write_data, []
        def die_half_way(self, plan, planner):
            calls.append(1)
            if os.environ["RANK"] == "1" and len(calls) == 2:
                with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                    f.write(b"half a shard")
                os._exit(9)
            return real(self, plan, planner)
        FileSystemWriter.write_data = die_half_way
        from fitgpt.cli import main
        sys.exit(main(sys.argv[1:]))
    '''))
    run = tmp_path / "run"
    p = torchrun(train_flags(data_dir, corpus_dir, run, 9, "--async-checkpoint", mode, "--dist-timeout", "30"), tmp_path,
                 script=str(script))
    out, err = p.communicate(timeout=guard(300))
    assert p.returncode != 0
    assert [c.name for c in ckpt.list_checkpoints(run)] == ["step_00000003"], err[-3000:]
    ckpt.verify_checkpoint(run / "checkpoints/step_00000003")
    assert not any((t / ckpt.META_FILE).exists() for t in (run / "checkpoints").glob(".tmp_*"))


def test_background_saves_are_the_default_for_cuda_ranks_only():
    from fitgpt.config import TrainConfig

    assert TrainConfig().background_saves("cuda") and not TrainConfig().background_saves("cpu")
    assert TrainConfig(async_checkpoint="on").background_saves("cpu")
    assert not TrainConfig(async_checkpoint="off").background_saves("cuda")


# ---- planned --------------------------------------------------------------------------------------

def _plan(capsys, *flags):
    from fitgpt.cli import main

    assert main(["plan", "--preset", "tiny", "--gpu", "h100-80gb", "--parallel", "fsdp", *flags]) == 0
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_plan_counts_each_ranks_staging_copy_against_host_memory(capsys):
    out, plan = _plan(capsys, "--world-size", "4", "--host-memory", "64GiB")
    # A rank stages its fp32 weights and AdamW moments: what the plan holds of them, for each of one machine's 4 ranks.
    assert plan["checkpoint_staging_bytes"] == plan["breakdown"]["params"] + plan["breakdown"]["optimizer"] > 0
    assert "for the 4 ranks of one machine, of 64.00 GiB (--host-memory): fits" in out and plan["async_checkpoint"]
    assert "--async-checkpoint" not in out.split("train with:")[1].splitlines()[0]  # auto: on, for CUDA ranks
    out, plan = _plan(capsys, "--world-size", "4", "--host-memory", "1MiB")
    assert "DOES NOT FIT, so the command below saves synchronously" in out and not plan["async_checkpoint"]
    assert "fitgpt train" in out and "--async-checkpoint off" in out.split("train with:")[1].splitlines()[0]


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_a_plan_over_more_ranks_than_a_node_prints_the_multi_node_command(capsys):
    out, _ = _plan(capsys, "--world-size", "16")
    command = out.split("train with: ")[1].splitlines()[0]
    assert command.startswith("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $FIRST_NODE:29400")
    assert "--resume auto" in command  # a restarted node continues the run
