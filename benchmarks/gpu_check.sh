#!/usr/bin/env bash
# The checks that need GPUs, run as is on a machine with CUDA (2 GPUs for the distributed part).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. fitgpt bench on CUDA, bf16, small preset: allocator peaks, step times, bench.json + bench.png
# 2. --activation-checkpointing auto on CUDA: the measured (allocator) peak beside the predicted one
# 3. With 2 GPUs: DDP and FSDP (NCCL) through torchrun, FSDP resumed on one GPU, and the CPU/gloo
#    distributed tests re-run for good measure
# 4. CPU-only predictions for this card (fake tensors, `--target cuda --gpu <card>`) against
#    max_memory_allocated and max_memory_reserved of real steps: tiny, small, medium, 3b
#    (benchmarks/plan_check.py cuda; the table goes to OUT_DIR/plan_check_cuda.md for RESULTS.md)
# Everything lands in OUT_DIR (default gpu_check/), with a summary in OUT_DIR/summary.txt.
set -euo pipefail
OUT=${1:-gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
print("GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "torch", torch.__version__)
PY
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")

echo "== 1. bench (CUDA, bf16, small preset, batch 8 x 1024)"
fitgpt bench --preset small --batch-size 8 --context 1024 --grad-accum 1 --device cuda --precision bf16 \
  --policies none block group:2 every:2 selective chunked-loss block+chunked-loss auto:50% auto:25% \
  --repeats 10 --warmup 3 --out-dir "$OUT/bench" | tail -n 1 > "$OUT/bench_line.json"

echo "== 2. auto on CUDA: predicted vs allocator peak"
BUDGET=$(python - "$OUT/bench/bench.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
none = rows[0]
print(int(none["peak_bytes"] - 0.5 * none["activation_bytes"]))
PY
)
fitgpt train --preset small --batch-size 8 --model.context-length 1024 --grad-accum 1 --max-steps 20 \
  --device cuda --precision bf16 --activation-checkpointing auto --memory-budget "$BUDGET" --out-dir "$OUT/auto" \
  --no-progress 2>&1 | tee "$OUT/auto.log" | grep -E "auto:|run:"

if [ "$NGPU" -ge 2 ]; then
  echo "== 3. DDP and FSDP on 2 GPUs"
  torchrun --nproc-per-node 2 -m fitgpt train --preset small --batch-size 4 --model.context-length 512 --max-steps 30 \
    --activation-checkpointing block --out-dir "$OUT/ddp" --no-progress | tail -n 1 > "$OUT/ddp.json"
  torchrun --nproc-per-node 2 -m fitgpt train --preset small --batch-size 4 --model.context-length 512 --max-steps 30 \
    --parallel fsdp --activation-checkpointing selective --out-dir "$OUT/fsdp" --no-progress | tail -n 1 > "$OUT/fsdp.json"
  fitgpt train --preset small --batch-size 4 --model.context-length 512 --max-steps 40 --out-dir "$OUT/fsdp" \
    --resume latest --no-progress | tail -n 1 > "$OUT/fsdp_resumed_on_one_gpu.json"
  fitgpt plan --preset small --batch-size 4 --context 512 --world-size 2 --parallel fsdp --device cuda \
    --memory-budget 20GiB | tail -n 1 > "$OUT/plan_fsdp.json"
  python -m pytest -q tests/test_distributed.py
else
  echo "== 3. skipped: needs 2 GPUs, found $NGPU"
fi

echo "== 4. CPU-only predictions for this card vs the allocator"
python benchmarks/plan_check.py cuda --out "$OUT/plan_check_cuda.json" | tee "$OUT/plan_check_cuda.md"

python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
lines = []
bench = json.loads((out / "bench_line.json").read_text())
for r in bench["rows"]:
    lines.append(f"bench {r['policy']:>20} = {r['spec']:<40} peak {r['peak_bytes']/2**30:6.2f} GiB  step {r['step_seconds']*1e3:7.1f} ms")
for line in (out / "auto.log").read_text().splitlines():
    if "auto:" in line:
        lines.append(line)
for name in ("ddp", "fsdp", "fsdp_resumed_on_one_gpu"):
    f = out / f"{name}.json"
    if f.is_file():
        s = json.loads(f.read_text())
        lines.append(f"{name}: steps {s['steps']} train loss {s['train_loss']:.4f} val loss {s['val_loss']:.4f}")
check = out / "plan_check_cuda.md"
if check.is_file():
    lines += ["", "CPU-only predictions vs the allocator:", check.read_text()]
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
