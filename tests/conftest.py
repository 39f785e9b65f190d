import os
import random
import shutil
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from hang import guard

from fitgpt.config import load_config
from fitgpt.data.config import DataConfig
from fitgpt.data.prepare import prepare
from fitgpt.memory.allocator import CachingAllocatorModel
from fitgpt.model import ModelConfig

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_FILES = ["textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py", "string.py", "keyword.py", "glob.py"]


WORKERS_THREADS = 1
"""Under pytest-xdist (`-n 2`, the README's test command) each worker and what it launches computes with one intra-op
thread: two workers of two OpenMP threads each on 2 cores spin against each other. Measured on the quick loop (806
tests, this 2-core CPU): serial 218 s, `-n 2` 283 s with two threads a worker, 133 s with one."""
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = str(WORKERS_THREADS)  # the processes a test starts (CLI runs, torchrun) inherit it
    torch.set_num_threads(WORKERS_THREADS)


TINY_MODEL = dict(vocab_size=128, context_length=32, n_embed=32, n_head=4, n_blocks=4, dropout=0.0)


@pytest.fixture(scope="session")
def tiny_model_config():
    """A factory of tiny ModelConfigs: ``tiny_model_config(**overrides)``."""
    return lambda **kw: ModelConfig(**{**TINY_MODEL, **kw})


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A few real Python files: enough text for a tokenizer and a few training steps."""
    d = tmp_path_factory.mktemp("corpus")
    for name in CORPUS_FILES:
        shutil.copy(STDLIB / name, d / name)
    return d


@pytest.fixture(scope="session")
def data_dir(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small-bpe512"
    prepare(DataConfig(dir=str(out), inputs=(str(corpus_dir),), vocab_size=512), progress=False)
    return out


@pytest.fixture(scope="session", autouse=True)
def _time_model_measured_once_per_shape():
    """A plan's time model is measured on this CPU, seconds each time (`estimate.timing.calibrate`). The suite's plans,
    fits, benches and `auto` runs of one shape share one measurement; tests of the measurement itself call
    `timing.calibrate` directly. Processes the suite starts measure their own."""
    from fitgpt.estimate import workload

    measure, measured = workload.calibrate, {}

    def once(model, batch, context, device, dtype, optim_cfg=None, **kw):
        key = (repr(model), batch, context, str(device), dtype, repr(optim_cfg), repr(sorted(kw.items())))
        if key not in measured:
            measured[key] = measure(model, batch, context, device, dtype, optim_cfg, **kw)
        return measured[key]

    patch = pytest.MonkeyPatch()
    patch.setattr(workload, "calibrate", once)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world)``: the session's gloo ranks of that size (tests/rank_pool.py), started once and shared by the
    tests that compare ranks with one process: ``ranks(2).run(fn, *args)`` -> each rank's ``fn(rank, world, *args)``."""
    from rank_pool import RankPools

    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def test_rng() -> random.Random:
    """The suite's randomness (kill moments, sampled cases): the same on every run, another with FITGPT_TEST_SEED=N."""
    return random.Random(int(os.environ.get("FITGPT_TEST_SEED", "0")))


@pytest.fixture
def make_cfg(data_dir, corpus_dir):
    """A factory of tiny TrainConfigs on the session's data: ``make_cfg(out_dir, **overrides)``."""

    def make(out: Path, **kw):
        overrides = {
            "model": {"context_length": 32, "n_embed": 32, "n_head": 4, "n_blocks": 2, "dropout": 0.1},
            "data": {"dir": str(data_dir), "inputs": [str(corpus_dir)], "vocab_size": 512},
            "batch_size": 4, "max_steps": 6, "eval_interval": 3, "eval_batches": 2, "checkpoint_interval": 3, "log_interval": 1,
            "out_dir": str(out), "progress": False, "tensorboard": False,
        }
        overrides.update(kw)
        return load_config("tiny", overrides=overrides)

    return make


@pytest.fixture
def cli_train_args(data_dir, corpus_dir):
    """A factory of `fitgpt train` argument lists for a tiny model: ``cli_train_args(out_dir, steps=12)``."""

    def make(out: Path, steps: int = 12) -> list[str]:
        return ["train", "--data.dir", str(data_dir), "--data.inputs", str(corpus_dir), "--data.vocab-size", "512",
                "--model.context-length", "32", "--model.n-embed", "32", "--model.n-head", "4", "--model.n-blocks", "2",
                "--model.dropout", "0.1", "--batch-size", "4", "--max-steps", str(steps), "--checkpoint-interval", "2",
                "--log-interval", "1", "--eval-interval", "100", "--eval-batches", "2", "--out-dir", str(out),
                "--no-progress", "--no-tensorboard"]

    return make


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small real filesystem (tmpfs); ``tmpfs(size, ro=False) -> Path``. Skips where mounting is not allowed."""
    import subprocess

    mounts = []

    def mount(size: str, ro: bool = False) -> Path:
        d = tmp_path / f"fs{len(mounts)}"
        d.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounts.append(d)
        return d

    yield mount
    for d in reversed(mounts):
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture
def nan_model(monkeypatch):
    """Every model the trainer builds has a NaN final-norm weight: every step's loss is NaN."""
    import fitgpt.train.trainer as trainer

    real_build = trainer.build_model

    def poisoned(cfg, vocab_size, device, *shards):
        model = real_build(cfg, vocab_size, device, *shards)
        with torch.no_grad():
            model.layer_norm.weight.fill_(float("nan"))
        return model

    monkeypatch.setattr(trainer, "build_model", poisoned)


class Counting:
    """Exact live bytes: what LiveMemory counts, to check the replay against a real step."""

    def __init__(self):
        self.sizes, self.allocated, self.peak_allocated, self.peak_reserved = {}, 0, 0, 0

    def malloc(self, key, n):
        self.sizes[key] = n
        self.allocated += n
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key):
        self.allocated -= self.sizes.pop(key, 0)

    def reset_peaks(self):
        self.peak_allocated = self.allocated


class Logging(CachingAllocatorModel):
    """CUDA's allocator model, logging every allocation (its size) and free (-1 - the index of the allocation freed: a
    storage's id may be taken again once it is freed), and the kinds of key given (a replay names its repeated step's
    allocations ``("again", ...)`` and a deepened step's blocks' ``("b", ...)``)."""

    def __init__(self):
        super().__init__()
        self.log, self.names, self.kinds, self.measured_from = [], {}, set(), 0

    def malloc(self, key, nbytes):
        self.kinds.add(key[0] if isinstance(key, tuple) else type(key).__name__)
        self.names[key] = len(self.log)
        self.log.append(nbytes)
        super().malloc(key, nbytes)

    def free(self, key):
        if key in self.names:
            self.log.append(-1 - self.names.pop(key))
        super().free(key)

    def reset_peaks(self):
        super().reset_peaks()
        self.measured_from = len(self.log)

    @property
    def measured(self) -> list[int]:
        """The log of the measured step (from the last reset of the peaks), as if it began there: its frees of what it
        allocated (indices from its start), not of what came before."""
        start = self.measured_from
        return [e if e >= 0 else e + start for e in self.log[start:] if e >= 0 or -1 - e >= start]


@pytest.fixture
def logging_allocator():
    return Logging


@pytest.fixture
def exact_allocator():
    """Allocators that count exact live bytes, no blocks or caching (what LiveMemory counts): a replay through one
    is checked against a real step measured on this CPU."""
    return Counting


# ---- the suite's time budget (issue 47): a report, not a failing test ----------------------------------------

SLOW_S = 2.5
"""A test that takes this long here is marked slow (the quick loop, -m "not slow", leaves it to CI); a parametrized
test keeps a quick case in the loop where one is quick."""
BUDGET_S = {"full": 25 * 60, "quick": 3 * 60}
"""What the whole suite and the quick loop should take on this machine (2 cores)."""
_durations: dict[str, tuple[float, bool]] = {}
_quick_cases: set[str] = set()
"""The cases a parametrized test keeps in the quick loop while its other cases are marked slow: kept on purpose."""
_calls: dict[str, float] = {}
"""Each test's own call, its fixtures' setup aside: a shared fixture's setup falls on whichever test asks first, so a
test slow by its setup alone is not one to mark slow (the next test would pay it)."""
_started = time.monotonic()


@pytest.hookimpl(tryfirst=True)  # before -m deselects the slow cases
def pytest_collection_modifyitems(config, items):
    cases: dict[tuple, list] = {}
    for item in items:
        cases.setdefault((item.path, getattr(item, "originalname", item.name)), []).append(item)
    for group in cases.values():
        if any(item.get_closest_marker("slow") for item in group):
            _quick_cases.update(item.nodeid for item in group if not item.get_closest_marker("slow"))
    for item in items:  # each test's pytest-timeout bound (its mark, else the ini's) is a hang guard (`hang.guard`)
        mark = item.get_closest_marker("timeout")
        quiet = mark.args[0] if mark and mark.args else mark.kwargs.get("timeout") if mark else config.getini("timeout")
        item.add_marker(pytest.mark.timeout(guard(float(quiet))), append=False)


def pytest_runtest_logreport(report):
    """Each test's setup and call, added up (a session fixture's setup counts for the test that made it)."""
    if report.when in ("setup", "call"):
        took, _ = _durations.get(report.nodeid, (0.0, False))
        _durations[report.nodeid] = (took + report.duration, "slow" in report.keywords)
        if report.when == "call":
            _calls[report.nodeid] = report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The ten slowest tests, those over SLOW_S not marked slow, and the session against its budget; with
    FITGPT_TEST_DURATIONS=FILE, every test's seconds written to FILE as JSON (to compare two runs test by test)."""
    if not _durations:
        return
    if os.environ.get("FITGPT_TEST_DURATIONS"):
        import json

        Path(os.environ["FITGPT_TEST_DURATIONS"]).write_text(json.dumps({n: d for n, (d, _) in _durations.items()}))
    tr = terminalreporter
    quick = "not slow" in (config.getoption("markexpr") or "")
    budget = BUDGET_S["quick" if quick else "full"]
    wall = time.monotonic() - _started
    tr.section("time budget (tests/conftest.py)")
    tr.write_line(f"{len(_durations)} tests in {wall:.0f} s; the {'quick loop' if quick else 'full suite'}'s budget "
                  f"on this machine: {budget} s ({wall / budget:.2f}x)")
    for nodeid, (d, slow) in sorted(_durations.items(), key=lambda kv: -kv[1][0])[:10]:
        note = ("" if slow or d < SLOW_S else "  (its quick case)" if nodeid in _quick_cases
                else "  (a shared fixture's setup)" if _calls.get(nodeid, 0.0) < SLOW_S else "  (not marked slow)")
        tr.write_line(f"  {d:7.1f} s  {nodeid}{note}")
    unmarked = [n for n, (d, slow) in _durations.items()
                if d >= SLOW_S and _calls.get(n, 0.0) >= SLOW_S and not slow and n not in _quick_cases]
    if unmarked:
        tr.write_line(f"{len(unmarked)} tests took {SLOW_S} s or more without the slow mark: mark them slow")
        for nodeid in unmarked:
            tr.write_line(f"  {_calls[nodeid]:7.1f} s  {nodeid}")


@pytest.fixture
def resumes_bitwise(make_cfg):
    """``resumes_bitwise(run, **overrides)``: a run of 4 steps, checkpointed every 2, trained straight in ``run`` and
    then resumed from step 2, ends on the same weights bit for bit (asserted); returns those weights."""
    from safetensors.torch import load_file

    from fitgpt.train.trainer import train

    def check(run: Path, **kw) -> dict:
        kw = {"max_steps": 4, "checkpoint_interval": 2, **kw}
        train(make_cfg(run, **kw))
        first = load_file(str(run / "checkpoints/step_00000004/model.safetensors"))
        train(make_cfg(run, resume=str(run / "checkpoints/step_00000002"), **kw))
        again = load_file(str(run / "checkpoints/step_00000004/model.safetensors"))
        assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
        return first

    return check
