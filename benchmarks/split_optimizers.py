"""Every optimizer on every layout (issue 57): 8 clipped steps of each optimizer (and pure bf16 weights) under FSDP,
tensor parallelism and FSDP x TP on gloo CPU ranks (FSDP 2 and 4, TP 2, 2 x 2), against one process at the same
global batch (4 rows of 16 tokens, each data-parallel rank its share): the largest relative difference of a logged
loss, and the optimizer state each rank holds (AdamW's shards, or the whole matrices each rank owns).

    python benchmarks/split_optimizers.py        # about 6 minutes on 2 cores

The steps are the tests' (tests/test_split_optimizers.py, which proves the step bitwise on equal gradients); this
runs them longer, on more layouts, and prints a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rank_pool import RankPool  # noqa: E402
from test_split_optimizers import SETTINGS, one_process, split_steps  # noqa: E402

STEPS = 8
LAYOUTS = [(2, "fsdp"), (2, "tp"), (4, "fsdp"), (4, "fsdp-tp")]  # (the model's 2 key/value heads split 2 ways at most)


def main() -> None:
    names = list(SETTINGS)
    reference = {name: one_process(name, steps=STEPS)[0] for name in names}
    rows = {name: [] for name in names}
    states = {}
    for world, layout in LAYOUTS:
        pool = RankPool(world)
        try:
            results = pool.run(split_steps, layout, names, False, False, True, STEPS, timeout=1800)[0]
        finally:
            pool.close()
        for name in names:
            got, ref = results[name]["losses"], reference[name]
            rows[name].append(max(abs(a - b) / b for a, b in zip(got, ref)))
            states[(name, world, layout)] = [int(b) for b in results[name]["state_bytes"]]
        print(f"{world} {layout} done", file=sys.stderr, flush=True)
    heads = [f"{layout} x{world}" for world, layout in LAYOUTS]
    print(f"| optimizer | one process's loss at step {STEPS} | " + " | ".join(heads) + " |")
    print("|---" * (2 + len(heads)) + "|")
    for name in names:
        cells = " | ".join(f"{d:.1e}" for d in rows[name])
        print(f"| {name} | {reference[name][-1]:.4f} | {cells} |")
    print("\nOptimizer state held by each rank of 4 under FSDP x TP (bytes):\n")
    print("| optimizer | ranks 0-3 |\n|---|---|")
    for name in names:
        print(f"| {name} | {', '.join(f'{b:,}' for b in states[(name, 4, 'fsdp-tp')])} |")


if __name__ == "__main__":
    main()
