"""`fitgpt prepare` on gigabytes of JSON Lines: throughput against the tokenizer's own, and peak memory.

    python benchmarks/prepare_speed.py [--sizes 1 2] [--baseline-mb 256] [--work /tmp/fitgpt-prepare-bench]

Generates JSON Lines corpora of each size (GB) from the standard library's source (records of varied length,
with other fields beside ``text``), then runs `fitgpt prepare` on each in its own process with a tokenizer
trained once on the built-in corpus (``--tokenizer FILE``, so only tokenizing is timed), and reads that
process's peak RSS from the kernel (``wait4``). The tokenizer's own speed is ``encode_batch_fast`` on the same
records, already in memory, in batches as prepare makes them; it is measured before and after the prepare
runs, so the two spreads show the machine's noise. Prints a Markdown table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fitgpt.data.corpus import stdlib_files
from fitgpt.data.prepare import _batches
from fitgpt.data.tokenizer import Tokenizer


def generate(path: Path, size: int, seed: int = 0) -> int:
    """About ``size`` bytes of JSON Lines: stdlib text cut into records of 200 B to 20 kB; returns the text bytes."""
    if path.is_file() and path.stat().st_size >= size:
        return int(path.with_suffix(".textbytes").read_text())
    rng = random.Random(seed)
    sources = [p.read_text(errors="replace") for p in stdlib_files()]
    written = text = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            src = rng.choice(sources)
            start = rng.randrange(max(1, len(src) - 200))
            piece = src[start : start + int(rng.lognormvariate(7.5, 1.0)) + 200]
            line = json.dumps({"id": written, "url": f"https://example.org/{rng.getrandbits(40):x}", "text": piece,
                               "meta": {"lang": "py", "score": rng.random()}}) + "\n"
            f.write(line)
            written += len(line.encode())
            text += len(piece.encode())
    path.with_suffix(".textbytes").write_text(str(text))
    return text


def baseline(path: Path, tok: Tokenizer, limit: int) -> dict:
    """The tokenizer alone: ``encode_batch_fast`` over the first ``limit`` bytes of text, in prepare's batches."""
    texts, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= limit:
                break
    docs = [type("D", (), {"text": t}) for t in texts]
    batches = [[p for _, pieces in b for p in pieces] for b in _batches(tok, docs)]
    encode = getattr(tok._tok, "encode_batch_fast", tok._tok.encode_batch)
    t0, tokens = time.perf_counter(), 0
    for b in batches:
        tokens += sum(len(e.ids) for e in encode(b, add_special_tokens=False))
    dt = time.perf_counter() - t0
    return {"mb_per_s": size / dt / 1e6, "tokens_per_s": tokens / dt, "bytes": size}


def run_prepare(path: Path, out: Path, tokenizer: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "fitgpt", "prepare", "--inputs", str(path), "--dir", str(out), "--tokenizer", str(tokenizer)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"fitgpt prepare failed ({p.returncode}): {' '.join(cmd)}")
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["train_tokens"] + meta["val_tokens"]
    return {"seconds": dt, "mb_per_s": meta["bytes"] / dt / 1e6, "tokens_per_s": tokens / dt, "tokens": tokens,
            "text_bytes": meta["bytes"], "documents": meta["documents"], "peak_rss_mb": usage.ru_maxrss / 1024,
            "shards": sum(len(s) for s in meta["shards"].values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0], help="corpus sizes in GB")
    ap.add_argument("--baseline-mb", type=float, default=256)
    ap.add_argument("--work", default="/tmp/fitgpt-prepare-bench")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "fitgpt", "prepare", "--dir", str(work / "stdlib")], check=True, capture_output=True)
    tok_file = work / "stdlib" / "tokenizer.json"
    tok = Tokenizer.load(work / "stdlib")
    corpora = {gb: work / f"corpus-{gb:g}GB.jsonl" for gb in args.sizes}
    for gb, path in corpora.items():
        generate(path, int(gb * 1e9))
    first = min(corpora, key=lambda g: g)
    base = [baseline(corpora[first], tok, int(args.baseline_mb * 1e6))]
    runs = {gb: run_prepare(path, work / f"out-{gb:g}GB", tok_file) for gb, path in corpora.items()}
    base.append(baseline(corpora[first], tok, int(args.baseline_mb * 1e6)))
    tok_mb = sum(b["mb_per_s"] for b in base) / len(base)
    print("| input | documents | tokens | shards | wall s | MB/s | tokens/s | of the tokenizer's speed | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gb, r in runs.items():
        print(f"| {gb:g} GB JSONL ({r['text_bytes'] / 1e9:.2f} GB of text) | {r['documents']:,} | {r['tokens']:,} | {r['shards']} | "
              f"{r['seconds']:.0f} | {r['mb_per_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['mb_per_s'] / tok_mb:.0%} | {r['peak_rss_mb']:.0f} |")
    print(f"| tokenizer alone (encode_batch_fast, {args.baseline_mb:g} MB in memory; before / after) | | | | | "
          f"{base[0]['mb_per_s']:.2f} / {base[1]['mb_per_s']:.2f} | {base[0]['tokens_per_s']:,.0f} / {base[1]['tokens_per_s']:,.0f} | | |")
    rss = [r["peak_rss_mb"] for r in runs.values()]
    print(f"\npeak RSS largest / smallest input: {max(rss) / min(rss):.3f}; tokenizer noise (before vs after): "
          f"{abs(base[0]['mb_per_s'] - base[1]['mb_per_s']) / tok_mb:.1%}")
    print(json.dumps({"runs": {f"{gb:g}GB": r for gb, r in runs.items()}, "tokenizer": base, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
