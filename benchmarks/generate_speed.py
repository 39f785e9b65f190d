"""Generation speed with and without the key/value cache: tokens/s for a 64-token prompt and 256 new tokens.

    python benchmarks/generate_speed.py [--presets tiny small] [--rounds 3]

Random weights (speed does not depend on them), greedy decoding, both ways interleaved round by round on
one model; the two outputs are checked to be the same tokens. Prints a Markdown table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fitgpt.config import load_config
from fitgpt.model import Transformer


def measure(preset: str, prompt: int, new: int, rounds: int) -> dict:
    cfg = load_config(preset).model
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, prompt))
    times: dict[bool, list[float]] = {True: [], False: []}
    outs = {}
    for _ in range(rounds):
        for cached in (True, False):
            t0 = time.perf_counter()
            outs[cached] = model.generate(idx, new, temperature=0, use_cache=cached)
            times[cached].append(time.perf_counter() - t0)
    assert torch.equal(outs[True], outs[False]), "cached and uncached greedy outputs differ"
    cached_s, plain_s = statistics.median(times[True]), statistics.median(times[False])
    return {"preset": preset, "prompt": prompt, "new_tokens": new, "cached_tokens_per_s": new / cached_s,
            "uncached_tokens_per_s": new / plain_s, "speedup": plain_s / cached_s, "rounds": rounds,
            "spread": {k: [round(t, 3) for t in v] for k, v in (("cached", times[True]), ("uncached", times[False]))}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = [measure(p, args.prompt, args.new, args.rounds) for p in args.presets]
    print(f"| preset | prompt | new tokens | cached (tokens/s) | uncached (tokens/s) | speed-up |  (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, medians of {args.rounds} interleaved rounds)")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['prompt']} | {r['new_tokens']} | {r['cached_tokens_per_s']:.1f} | "
              f"{r['uncached_tokens_per_s']:.1f} | {r['speedup']:.1f}x |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
