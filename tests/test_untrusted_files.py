"""No file that fitgpt reads runs code, and a checkpoint holds what its manifest says (issue 46, classes 1 and 2).

Each planted file would write a marker if its code ran; the marker never appears, and the command refuses the file in
one line. A distributed checkpoint is made here on a one-rank gloo group from a one-process run, as torchrun's ranks
write it, its meta.json hashes recomputed after each change: a crafted checkpoint verifies, so only the reader stands
between it and the user."""

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
from test_doors import one_line, run_cli

from fitgpt.config import OptimConfig
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.train import checkpoint as ckpt
from fitgpt.train import distributed as du
from fitgpt.train.dist_checkpoint import DistributedSaver, load_optimizer
from fitgpt.train.load import load_run
from fitgpt.utils import sha256_file


class Planted:
    """Unpickled, it writes ``marker``: what a file that runs code would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def dcp_run(cli_train_args, tmp_path, capsys):
    """A trained run whose newest checkpoint is rewritten in the distributed layout (as torchrun's ranks write it)."""
    run = tmp_path / "run"
    assert run_cli(cli_train_args(run, steps=2), capsys)[0] == 0
    path = ckpt.list_checkpoints(run)[-1]
    model, _, meta = load_run(run)
    state = torch.load(path / ckpt.STATE_FILE, weights_only=True)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    optimizer.load_state_dict(state["optimizer"])
    shutil.rmtree(path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saver = DistributedSaver(du.DistInfo(rank=0, world=1), run, keep_last=3, background=False, timeout_s=60)
        train_state = {"scaler": state["scaler"], "rng": state["rng"], "rng_ranks": [state["rng"]]}
        kept = {k: v for k, v in meta.items() if k not in ("step", "files", "format")}
        path = saver.save(meta["step"], model, optimizer, train_state, kept)
    finally:
        dist.destroy_process_group()
    assert ckpt.verify_checkpoint(path)["format"] == "dcp"
    return run, path, model


def _rehash(path, *names):
    """meta.json's records of ``names`` made to match the files as they are now (a crafted checkpoint verifies)."""
    meta = json.loads((path / ckpt.META_FILE).read_text())
    for name in names:
        meta["files"][name] = {"sha256": sha256_file(path / name), "bytes": (path / name).stat().st_size}
    (path / ckpt.META_FILE).write_text(json.dumps(meta))


def test_a_planted_snapshot_never_runs_its_code(tmp_path, capsys):
    marker = tmp_path / "ran"
    plan = ["plan", "--preset", "tiny", "--memory-budget", "1GiB", "--compare"]
    (tmp_path / "code.pickle").write_bytes(pickle.dumps({"device_traces": [[Planted(marker)]]}))
    (tmp_path / "module.pickle").write_bytes(b"\x80\x04cno_such_module\nThing\n)R.")  # needs a module not installed
    (tmp_path / "trace.pickle").write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "frames": "x"}]]}))
    for name, says in (("code", "posix.system"), ("module", "no_such_module.Thing"), ("trace", "event 0 of its trace")):
        code, err = run_cli(plan + [str(tmp_path / f"{name}.pickle")], capsys)
        assert code == 2 and one_line(err) and says in err, err
    assert not marker.exists()


def test_a_crafted_dcp_metadata_is_refused_and_never_runs(dcp_run, tmp_path, capsys):
    run, path, _ = dcp_run
    marker = tmp_path / "ran"
    (path / "dcp/.metadata").write_bytes(pickle.dumps(Planted(marker)))
    _rehash(path, "dcp/.metadata")
    code, err = run_cli(["generate", "--run", str(run), "--max-new-tokens", "2"], capsys)
    assert code == 2 and one_line(err) and "refusing to load it" in err and "posix.system" in err, err
    assert not marker.exists()


def _plant_in_optimizer_entry(path, model, marker) -> None:
    """The checkpoint's optimizer entry (its hyperparameters) replaced by code, its hashes recomputed."""
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(path / "dcp")
    with pytest.warns(UserWarning):
        dcp.save({"model": ckpt.model_state(model), "optimizer": {"state": {}, "param_groups": Planted(marker)}},
                 checkpoint_id=str(path / "dcp"), no_dist=True)
    files = [f"dcp/{p.name}" for p in (path / "dcp").iterdir()]
    meta = json.loads((path / ckpt.META_FILE).read_text())
    meta["files"] = {k: v for k, v in meta["files"].items() if not k.startswith("dcp/")}
    (path / ckpt.META_FILE).write_text(json.dumps(meta))
    _rehash(path, *files)


def test_a_crafted_entry_of_a_dcp_checkpoint_is_refused_and_never_runs(dcp_run, tmp_path):
    """The optimizer's non-tensor entries (its hyperparameters) are read with weights_only=True."""
    run, path, model = dcp_run
    marker = tmp_path / "ran"
    _plant_in_optimizer_entry(path, model, marker)
    saved = ckpt.load_state(path, ckpt.verify_checkpoint(path))["optimizer"]
    with pytest.raises(ckpt.CheckpointError, match="refusing to load it"):
        load_optimizer(build_optimizer(model, OptimConfig(), torch.device("cpu")), saved, du.DistInfo())
    assert not marker.exists()



@pytest.mark.slow
def test_a_resume_that_refuses_a_crafted_checkpoint_changes_nothing_in_the_run(dcp_run, cli_train_args, tmp_path, capsys):
    """The refusal came after the run's config.json had been rewritten with the new flags (issue 68): now the run's
    files are written only once every part of the checkpoint was read."""
    run, path, model = dcp_run
    _plant_in_optimizer_entry(path, model, tmp_path / "ran")
    before = {f: (run / f).read_bytes() for f in ("config.json", "metrics.jsonl", "tokenizer.json")}
    code, err = run_cli([*cli_train_args(run, steps=6), "--eval-interval", "3", "--resume", "latest"], capsys)
    assert code == 2 and one_line(err) and "refusing to load it" in err, err
    assert {f: (run / f).read_bytes() for f in before} == before
    assert not (tmp_path / "ran").exists()

def test_a_stray_weight_file_in_a_dcp_checkpoint_is_never_read(dcp_run):
    """meta.json's layout and files are the only truth: an unlisted model.safetensors (other weights) is ignored."""
    from safetensors.torch import save_model

    run, path, model = dcp_run
    stray = Transformer(model.config)
    with torch.no_grad():
        for p in stray.parameters():
            p.zero_()
    save_model(stray, str(path / ckpt.MODEL_FILE))
    loaded = load_run(run)[0]
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
