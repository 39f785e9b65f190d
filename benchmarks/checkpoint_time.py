"""What a checkpoint costs a torchrun run: the training stall of a save, synchronous and in the background, and the
time a resume takes, at 2 and 4 gloo CPU ranks (FSDP), the same 102M-parameter model as fsdp_rss.py.

The stall of a save is read from the training time of whole runs, not from a log line: 8 steps with a checkpoint every
2 steps (4 saves) against 8 steps with one save at the end, the difference over 3 saves (the final save is in both,
and a background save is waited for there). The resume time is the wall time of a run resumed at step 8 for one more
step: the trainer's own log of reading the checkpoint, or for a checkout without it the wall time less that of a
fresh one-step run. ``--src DIR`` runs another checkout's fitgpt (main before distributed
checkpoints), interleaved with this one's, ``--repeat`` times; a checkout without --async-checkpoint runs its own
(rank 0 gathers and writes). Prints a table, then one JSON line.

    python benchmarks/checkpoint_time.py --src /tmp/base/src --worlds 2 4 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_rss import MODEL, _prepare  # noqa: E402

STEPS = 8


def _train(src: str, world: int, run: Path, data: Path, *extra: str) -> tuple[float, float, float | None]:
    """(training seconds as the run reports them, wall seconds of the whole command, seconds it logged reading its
    checkpoint: None for a fresh run, or a checkout that does not log it)."""
    model = [a for a in MODEL]
    for flag, value in (("--max-steps", str(STEPS)), ("--checkpoint-interval", str(STEPS)), ("--eval-interval", "1000")):
        model[model.index(flag) + 1] = value
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "-m", "fitgpt", "train",
           "--data.dir", str(data), "--out-dir", str(run), *model, "--parallel", "fsdp", "--log-interval", "1000", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(out.stdout[-1000:] + out.stderr[-3000:])
    summary = json.loads(next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")))
    read = re.search(r"checkpoint read in ([0-9.]+)s", out.stderr)  # the trainer's own log, where it has one
    return summary["seconds"], wall, float(read.group(1)) if read else None


def _modes(src: str) -> list[tuple[str, list[str]]]:
    has_async = "async_checkpoint" in (Path(src) / "fitgpt/config.py").read_text()
    if not has_async:
        return [("rank 0 gathers (before)", [])]
    return [("background", ["--async-checkpoint", "on"]), ("synchronous", ["--async-checkpoint", "off"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="*", default=[], help="other checkouts' src/ folders to run beside this one's")
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parent.parent / "src")
    work = Path(tempfile.mkdtemp(prefix="ckpt_time_"))
    data = _prepare(work, here)
    rows: dict[tuple, dict[str, list[float]]] = {}
    for rep in range(args.repeat):
        for world in args.worlds:
            for src in [here, *args.src]:  # interleaved: the machine's noise falls on each alike
                for mode, flags in _modes(src):
                    key, tag = (src, world, mode), f"{rep}-{world}-{abs(hash((src, mode)))}"
                    r = rows.setdefault(key, {"stall": [], "resume": []})
                    one, _, _ = _train(src, world, work / f"one{tag}", data, *flags)
                    many, _, _ = _train(src, world, work / f"many{tag}", data, *flags, "--checkpoint-interval", "2")
                    r["stall"].append((many - one) / 3)
                    _, fresh, _ = _train(src, world, work / f"fresh{tag}", data, *flags, "--max-steps", "1")
                    _, resumed, read = _train(src, world, work / f"one{tag}", data, *flags, "--max-steps",
                                              str(STEPS + 1), "--resume", "latest")
                    # The trainer's own time to read the checkpoint; where it does not log it, the wall time over a
                    # fresh one-step run's (noisy: process start and rendezvous vary by seconds).
                    r["resume"].append(read if read is not None else resumed - fresh)
                    for run in ("one", "many", "fresh"):  # 1.2 GB a checkpoint: a full disk fails the next run
                        shutil.rmtree(work / f"{run}{tag}", ignore_errors=True)
    print("| fitgpt | ranks | checkpoint | stall a save (s) | resume, over a fresh start (s) |\n|---|---:|---|---:|---:|")
    for (src, world, mode), r in rows.items():
        print(f"| {src} | {world} | {mode} | {statistics.median(r['stall']):.2f} ({', '.join(f'{x:.2f}' for x in r['stall'])}) "
              f"| {statistics.median(r['resume']):.2f} ({', '.join(f'{x:.2f}' for x in r['resume'])}) |")
    print(json.dumps([{"src": k[0], "world": k[1], "mode": k[2], **v} for k, v in rows.items()]))


if __name__ == "__main__":
    main()
