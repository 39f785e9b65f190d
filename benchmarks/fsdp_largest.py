"""The largest model whose FSDP run starts, steps and checkpoints on 4 gloo CPU ranks within this machine's memory.

All 4 ranks share one machine here, so what must fit is the sum of their resident memory: sampled from /proc every
50 ms over the whole run (the launcher and every rank), its peak kept. Models 2048 wide (16 heads, vocabulary 2048,
tied), one step of 1 x 64, one checkpoint. Two sizes per checkout give bytes per parameter and a fixed part; the
largest model that fits ``--memory`` (default: this machine's) follows from them, and ``--confirm`` runs this
checkout's at that size. ``--src DIR`` measures another checkout beside this one (interleaved).

    python benchmarks/fsdp_largest.py --src /tmp/base/src --blocks 2 6 --confirm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_rss import _prepare  # noqa: E402

WIDTH, VOCAB = 2048, 2048


def params(blocks: int) -> int:
    """Parameters of a GPT-2 block stack 2048 wide with a tied 2048-token head and 64 positions."""
    block = 12 * WIDTH * WIDTH + 13 * WIDTH  # attention and MLP weights and biases, two layer norms
    return blocks * block + VOCAB * WIDTH + 64 * WIDTH + 2 * WIDTH


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(src: str, blocks: int, run_dir: Path, data: Path, extra: list[str]) -> dict:
    """Peak of the summed resident memory of the launcher and its 4 ranks, and of the largest rank, in bytes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "fitgpt", "train",
           "--data.dir", str(data), "--out-dir", str(run_dir), "--model.n-blocks", str(blocks), "--model.n-embed",
           str(WIDTH), "--model.n-head", "16", "--model.context-length", "64", "--batch-size", "1", "--max-steps", "1",
           "--eval-batches", "1", "--no-progress", "--no-tensorboard", "--parallel", "fsdp", *extra]
    p = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    total = largest = 0
    t0 = time.perf_counter()
    while p.poll() is None:
        sizes = [_rss(pid) for pid in _descendants(p.pid)]
        total, largest = max(total, sum(sizes)), max(largest, max(sizes, default=0))
        time.sleep(0.05)
    err = p.stderr.read()
    shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint: many GB
    if p.returncode:
        raise SystemExit(err[-3000:])
    return {"src": src, "blocks": blocks, "params": params(blocks), "peak_total": total, "peak_rank": largest,
            "seconds": time.perf_counter() - t0, "extra": extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="*", default=[])
    ap.add_argument("--blocks", nargs=2, type=int, default=[2, 6])
    ap.add_argument("--memory", type=float, default=None, help="GiB the ranks may use (default: this machine's)")
    ap.add_argument("--extra", nargs="*", default=[], help="flags for this checkout's runs, e.g. --async-checkpoint on")
    ap.add_argument("--confirm", action="store_true", help="run this checkout at the largest size it predicts")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parent.parent / "src")
    memory = args.memory * 2**30 if args.memory else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    work = Path(tempfile.mkdtemp(prefix="fsdp_largest_"))
    data = _prepare(work, here)
    rows = [run(src, b, work / f"r{i}-{b}", data, args.extra if src == here else [])
            for b in args.blocks for i, src in enumerate([here, *args.src])]
    print("| fitgpt | blocks | parameters | peak, all ranks | peak, largest rank | wall |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['src']} | {r['blocks']} | {r['params'] / 1e6:,.0f}M | {r['peak_total'] / 2**30:.2f} GiB | "
              f"{r['peak_rank'] / 2**30:.2f} GiB | {r['seconds']:.0f} s |")
    largest = {}
    for src in [here, *args.src]:
        a, b = [r for r in rows if r["src"] == src]
        per_param = (b["peak_total"] - a["peak_total"]) / (b["params"] - a["params"])
        fixed = a["peak_total"] - per_param * a["params"]
        blocks = int((memory - fixed - per_param * params(0)) / (per_param * (params(1) - params(0))))
        largest[src] = blocks
        print(f"{src}: {per_param:.1f} bytes a parameter + {fixed / 2**30:.2f} GiB: the largest that fits "
              f"{memory / 2**30:.1f} GiB is {blocks} blocks, {params(blocks) / 1e9:.2f}B parameters")
    if args.confirm:
        r = run(here, largest[here], work / "confirm", data, args.extra)
        print(f"confirmed: {r['blocks']} blocks ({r['params'] / 1e9:.2f}B) ran, all ranks' peak "
              f"{r['peak_total'] / 2**30:.2f} GiB, in {r['seconds']:.0f} s")
        rows.append(r)
    print(json.dumps({"rows": rows, "largest_blocks": largest, "memory": memory}))


if __name__ == "__main__":
    main()
