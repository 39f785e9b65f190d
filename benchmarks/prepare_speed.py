"""`fitgpt prepare` on gigabytes of JSON Lines: throughput against the tokenizer's own, and peak memory.

    python benchmarks/prepare_speed.py [--sizes 1 2] [--baseline-mb 256] [--work /tmp/fitgpt-prepare-bench] [--bpe]

Generates JSON Lines corpora of each size (GB) from the standard library's source (records of varied length,
with other fields beside ``text``), then runs `fitgpt prepare` on each in its own process with a tokenizer
trained once on the built-in corpus (``--tokenizer FILE``, so only tokenizing is timed), and reads that
process's peak RSS from the kernel (``wait4``, in a small launcher process). The tokenizer's own speed is
``encode_batch_fast`` on the same records, already in memory, in batches as prepare makes them, measured
before, between and after the runs, so its spread shows the machine's noise. Prints a Markdown table and a
JSON line. ``--bpe`` instead times a BPE learning from each corpus's 200MB ``--tokenizer-sample`` (the pass
that draws it included).
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

from fitgpt.data.corpus import Document, stdlib_files
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


def baseline(path: Path, tok: Tokenizer, limit: int, method: str = "encode_batch_fast") -> dict:
    """The tokenizer alone: ``method`` over the first ``limit`` bytes of text, in prepare's batches."""
    texts, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= limit:
                break
    docs = [Document(f"{path}#{i}", t, (0, i + 1)) for i, t in enumerate(texts)]
    batches = [[p for _, pieces in b for p in pieces] for b in _batches(tok, docs)]
    encode = getattr(tok._tok, method)
    t0, tokens = time.perf_counter(), 0
    for b in batches:
        tokens += sum(len(e.ids) for e in encode(b, add_special_tokens=False))
    dt = time.perf_counter() - t0
    return {"mb_per_s": size / dt / 1e6, "tokens_per_s": tokens / dt, "bytes": size}


# Peak RSS as the kernel keeps it (wait4) for `fitgpt prepare`, started from a small launcher: a process forked
# from this one would inherit this one's resident size as its starting high-water mark, and keep it across exec.
LAUNCH = ("import os, subprocess, sys, time; t = time.perf_counter(); p = subprocess.Popen(sys.argv[1:], "
          "stdout=subprocess.DEVNULL); _, status, usage = os.wait4(p.pid, 0); "
          "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, time.perf_counter() - t)")


def run_prepare(path: Path, out: Path, tokenizer: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "fitgpt", "prepare", "--inputs", str(path), "--dir", str(out), "--tokenizer", str(tokenizer)]
    launched = subprocess.run([sys.executable, "-c", LAUNCH, *cmd], capture_output=True, text=True)
    rc, maxrss_kb, dt = launched.stdout.split()
    if int(rc):
        raise SystemExit(f"fitgpt prepare failed ({rc}): {' '.join(cmd)}")
    dt = float(dt)
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["train_tokens"] + meta["val_tokens"]
    return {"seconds": dt, "mb_per_s": meta["bytes"] / dt / 1e6, "tokens_per_s": tokens / dt, "tokens": tokens,
            "text_bytes": meta["bytes"], "documents": meta["documents"], "peak_rss_mb": int(maxrss_kb) / 1024,
            "shards": sum(len(s) for s in meta["shards"].values())}


def bpe_on_sample(path: Path, limit: str = "200MB", vocab: int = 2048) -> dict:
    """How long a BPE takes to learn from the --tokenizer-sample of a corpus: the pass that draws it, and training."""
    from fitgpt.data.config import DataConfig
    from fitgpt.data.corpus import list_inputs, text_bytes
    from fitgpt.data.prepare import _Sample
    from fitgpt.data.tokenizer import train_bpe
    from fitgpt.units import parse_bytes

    cfg = DataConfig(inputs=(str(path),), vocab_size=vocab, tokenizer_sample=limit)
    items = list_inputs(list(cfg.inputs))
    sample = _Sample(cfg, items, parse_bytes(limit), sum(text_bytes(i) for i in items))
    t0 = time.perf_counter()
    train_bpe(iter(sample), vocab)
    return {"seconds": time.perf_counter() - t0, "sample_mb": sample.bytes / 1e6, "sample_documents": sample.documents}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.0], help="corpus sizes in GB")
    ap.add_argument("--baseline-mb", type=float, default=256)
    ap.add_argument("--work", default="/tmp/fitgpt-prepare-bench")
    ap.add_argument("--bpe", action="store_true", help="only time a 2048-token BPE learning from each corpus's 200MB sample")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "fitgpt", "prepare", "--dir", str(work / "stdlib")], check=True, capture_output=True)
    tok_file = work / "stdlib" / "tokenizer.json"
    tok = Tokenizer.load(work / "stdlib")
    corpora = {gb: work / f"corpus-{gb:g}GB.jsonl" for gb in args.sizes}
    for gb, path in corpora.items():
        generate(path, int(gb * 1e9))
    if args.bpe:
        for gb, path in corpora.items():
            r = bpe_on_sample(path)
            print(f"{gb:g} GB: BPE on a {r['sample_mb']:.0f} MB sample ({r['sample_documents']:,} documents) in {r['seconds']:.0f} s")
        return
    first = min(corpora, key=lambda g: g)
    limit = int(args.baseline_mb * 1e6)
    plain = baseline(corpora[first], tok, limit, "encode_batch")
    base, runs = [baseline(corpora[first], tok, limit)], {}
    for gb, path in corpora.items():  # the tokenizer alone measured before and after each run
        runs[gb] = run_prepare(path, work / f"out-{gb:g}GB", tok_file)
        base.append(baseline(corpora[first], tok, limit))
        runs[gb]["of_tokenizer"] = runs[gb]["mb_per_s"] / ((base[-2]["mb_per_s"] + base[-1]["mb_per_s"]) / 2)
    print("| input | documents | tokens | shards | wall s | MB/s | tokens/s | of the tokenizer's speed | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gb, r in runs.items():
        print(f"| {gb:g} GB JSONL ({r['text_bytes'] / 1e9:.2f} GB of text) | {r['documents']:,} | {r['tokens']:,} | "
              f"{r['shards']} | {r['seconds']:.0f} | {r['mb_per_s']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r['of_tokenizer']:.0%} | {r['peak_rss_mb']:.0f} |")
    speeds = " / ".join(f"{b['mb_per_s']:.2f}" for b in base)
    print(f"| tokenizer alone, encode_batch_fast ({args.baseline_mb:g} MB in memory; before, between, after) | | | | | "
          f"{speeds} | | | |")
    print(f"| tokenizer alone, encode_batch (with offsets) | | | | | {plain['mb_per_s']:.2f} | {plain['tokens_per_s']:,.0f} | | |")
    rss = [r["peak_rss_mb"] for r in runs.values()]
    speeds = [b["mb_per_s"] for b in base]
    print(f"\npeak RSS largest / smallest input: {max(rss) / min(rss):.3f}; the tokenizer's own speed varied by "
          f"{(max(speeds) - min(speeds)) / min(speeds):.1%} across its {len(speeds)} measurements")
    print(json.dumps({"runs": {f"{gb:g}GB": r for gb, r in runs.items()}, "tokenizer": base, "encode_batch": plain,
                      "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
