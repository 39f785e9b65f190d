"""The careless day at the doors, at scale: prepare's checkpoints, rank 0's gathered state, the torch floor, a config
error under torchrun, resume mapping the optimizer state (moved from test_doors.py, issue 47: files under 400
lines). Each test failed on the code before its fix (issue 21)."""

import os
import subprocess
import sys
from pathlib import Path

import gathered
import numpy as np
import pytest
import torch
import torch.nn as nn
from hang import guard

from fitgpt.data.shards import PROGRESS_FILE, ShardWriter, save_progress

# ---- scale -----------------------------------------------------------------------------------------------

def test_a_checkpoint_of_prepare_costs_what_happened_since_the_last(tmp_path):
    """progress.json stays the same size however many shards closed before (it listed them all: quadratic)."""
    dtype = np.dtype(np.uint16)
    w = ShardWriter(tmp_path, "train", dtype, shard_tokens=2)
    state: dict = {}
    sizes = []
    for _i in range(400):
        w.write(np.arange(3, dtype=dtype), doc_end=True)
        save_progress(tmp_path, {"train": w}, state)
        sizes.append((tmp_path / PROGRESS_FILE).stat().st_size)
    assert len(w.shards) == 400 and sizes[-1] - sizes[9] <= 8  # a few digits more, not 390 entries


def test_only_rank_0_keeps_the_gathered_state():

    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert gathered.full_model_state(model, keep=False) == {} and gathered.full_optimizer_state(opt, keep=False) is None
    assert set(gathered.full_model_state(model, keep=True)) == {"weight", "bias"}


def test_the_torch_floor_is_the_one_fsdp2_needs():
    root = Path(__file__).resolve().parent.parent
    assert '"torch>=2.6"' in (root / "pyproject.toml").read_text()
    assert "torch >= 2.6" in (root / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_torchrun_a_config_error_on_rank_0_stops_every_rank_in_one_line(data_dir, corpus_dir, tmp_path):
    from test_distributed import torchrun, train_flags

    run = tmp_path / "run"
    p = torchrun(train_flags(data_dir, corpus_dir, run, 2, "--activation-checkpointing", "auto", "--memory-budget", "1KiB"),
                 tmp_path)
    out, err = p.communicate(timeout=guard(240))
    assert p.returncode != 0
    assert err.count("fitgpt train: error: ") == 2, err[-3000:]  # each rank, one line
    assert "Connection closed by peer" not in err and "src/fitgpt" not in err, err[-3000:]  # no traceback of ours
    code = subprocess.run([sys.executable, "-m", "fitgpt", *train_flags(data_dir, corpus_dir, run, 2)], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert code.returncode == 0, code.stderr[-2000:]  # the failed run left nothing that blocks the retry


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident size from /proc")
def test_resuming_maps_the_optimizer_state_instead_of_reading_it(tmp_path):
    """Every rank resuming under FSDP loads state.pt: mapped, its 64 MiB of moments are not resident until used
    (before, each rank read the whole optimizer state into memory)."""
    from fitgpt.train import checkpoint as ckpt

    moments = {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(8 << 20), "exp_avg_sq": torch.rand(8 << 20)}}
    state = {"optimizer": {"state": moments, "param_groups": [{"params": [0]}]}, "scaler": {},
             "rng": {"torch": torch.get_rng_state()}}
    torch.save(state, tmp_path / ckpt.STATE_FILE)
    del state, moments
    before = _rss()
    loaded = ckpt.load_state(tmp_path, {}, [torch.Size([8 << 20])])
    assert _rss() - before < 16 << 20
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"][:4], loaded["optimizer"]["state"][0]["exp_avg"][:4])
