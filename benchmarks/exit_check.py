"""Finished torchrun launches exit 0 on a busy machine (issue 68): N launches of 2 gloo ranks under FSDP, cycling
through GaLore, APOLLO, APOLLO-Mini, GaLore-Adafactor, Muon and AdamW, each training a few steps to its last checkpoint,
with BUSY CPU-bound processes beside them the whole time. Each launch's exit status is counted; a launch that did not
exit 0 has its log's tail printed.

    python benchmarks/exit_check.py --launches 200 --busy 2      # about an hour on 2 cores (3,529 s measured)

Prints a Markdown line for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPTIMIZERS = ["galore-adamw", "apollo", "apollo-mini", "galore-adafactor", "muon", "adamw"]
BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 86400: pass\n"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(work: Path, i: int, optim: str) -> tuple[int, str]:
    out = work / f"run{i}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           "-m", "fitgpt", "train", "--parallel", "fsdp", "--optim.name", optim,
           *(["--optim.rank", "16"] if optim.startswith(("galore", "apollo")) else []),
           "--data.dir", str(work / "data"), "--max-steps", "3", "--batch-size", "4", "--eval-interval", "3",
           "--eval-batches", "1", "--checkpoint-interval", "3", "--out-dir", str(out), "--no-progress", "--no-tensorboard"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode == 0 and not (out / "checkpoints" / "step_00000003").is_dir():
        return -1, "exited 0 without its last checkpoint"
    # A rank's own words (its error, an abort's message), not the launcher's traceback that follows them.
    said = [line for line in done.stderr.splitlines() if "error" in line.lower() or "terminate" in line or "abort" in line]
    return done.returncode, "\n".join(said[:12])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the launches")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "fitgpt", "prepare", "--dir", str(work / "data")], check=True,
                       capture_output=True)
        # A SIGTERM (kill, a scheduler) ends the benchmark through its finally: the busy processes with it.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
        codes: dict[str, collections.Counter] = {o: collections.Counter() for o in OPTIMIZERS}
        t0 = time.monotonic()
        try:
            for i in range(args.launches):
                optim = OPTIMIZERS[i % len(OPTIMIZERS)]
                code, tail = launch(work, i, optim)
                codes[optim][code] += 1
                if code != 0:
                    print(f"launch {i} ({optim}) exited {code}:\n{tail}", flush=True)
        finally:
            for p in busy:
                p.kill()
        ok = sum(c[0] for c in codes.values())
        per = ", ".join(f"{o} {c[0]}/{sum(c.values())}" for o, c in codes.items())
        print(f"| {args.launches} launches, {args.busy} busy processes beside them | {ok} of {args.launches} exit 0 "
              f"({per}) | {time.monotonic() - t0:.0f} s |")


if __name__ == "__main__":
    main()
