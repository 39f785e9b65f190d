"""Per-rank peak resident memory of FSDP training on gloo CPU ranks: the largest rank's ``ru_maxrss``.

A 102M-parameter model (8 blocks x 1024), batch 2 x 64, two steps and one checkpoint, in one process (no FSDP) and
under torchrun on 2 and 4 ranks. Each run is launched from a fresh Python whose RUSAGE_CHILDREN then holds the
largest descendant's peak: the largest rank's. ``--src DIR`` runs another checkout's fitgpt (before/after), the
runs interleaved so that the machine's noise falls on both alike. Prints a table, then one JSON line.

    python benchmarks/fsdp_rss.py --src /tmp/base/src --worlds 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

FILES = ["textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py", "string.py", "keyword.py", "glob.py",
         "argparse.py", "typing.py", "dataclasses.py", "pathlib.py"]
MODEL = ["--model.n-blocks", "8", "--model.n-embed", "1024", "--model.n-head", "16", "--model.context-length", "64",
         "--batch-size", "2", "--max-steps", "2", "--checkpoint-interval", "2", "--eval-interval", "2",
         "--eval-batches", "1", "--no-progress", "--no-tensorboard"]
PEAK = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); " \
       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


def _peak_mib(cmd: list[str], env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", PEAK, *cmd], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def _cmd(world: int, run: Path, data: Path) -> list[str]:
    train = ["-m", "fitgpt", "train", "--data.dir", str(data), "--out-dir", str(run), *MODEL]
    if world == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), *train, "--parallel", "fsdp"]


def _prepare(work: Path, src: str) -> Path:
    """The benchmarks' data: a few of Python's own modules, tokenized (vocabulary 2048)."""
    corpus = work / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in FILES:
        (corpus / name).write_bytes((stdlib / name).read_bytes())
    data = work / "data"
    subprocess.run([sys.executable, "-m", "fitgpt", "prepare", "--inputs", str(corpus), "--dir", str(data),
                    "--vocab-size", "2048"], check=True, capture_output=True, env={**os.environ, "PYTHONPATH": src})
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="*", default=[], help="other checkouts' src/ folders to run beside this one's")
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--extra", nargs="*", default=[], help="flags for this checkout's torchrun runs, e.g. --async-checkpoint on")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parent.parent / "src")
    sources = [here, *args.src]
    work = Path(tempfile.mkdtemp(prefix="fsdp_rss_"))
    data = _prepare(work, here)
    rows = []
    for world in args.worlds:
        for i, src in enumerate(sources):  # interleaved: this checkout, then each other, per world size
            env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
            cmd = _cmd(world, work / f"run{world}-{i}", data) + (args.extra if src == here and world > 1 else [])
            rows.append({"src": src, "world": world, "peak_mib": _peak_mib(cmd, env)})
            shutil.rmtree(work / f"run{world}-{i}", ignore_errors=True)  # its checkpoint: 1.2-1.6 GB
    print("| fitgpt | processes | largest rank's peak RSS | vs one process |\n|---|---:|---:|---:|")
    for r in rows:
        one = next(x["peak_mib"] for x in rows if x["src"] == r["src"] and x["world"] == min(args.worlds))
        print(f"| {r['src']} | {r['world']} | {r['peak_mib']:,.0f} MiB | {r['peak_mib'] / one:.2f}x |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
