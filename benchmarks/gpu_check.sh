#!/usr/bin/env bash
# The checks that need GPUs, run as is on a machine with CUDA (2 GPUs for the distributed part).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. fitgpt bench on CUDA, bf16, small preset: allocator peaks, step times, bench.json + bench.png
# 2. --activation-checkpointing auto on CUDA: the measured (allocator) peak beside the predicted one
# 3. With 2 GPUs: DDP and FSDP (NCCL) through torchrun, FSDP resumed on one GPU, FSDP with
#    --activation-checkpointing auto (each rank's max_memory_allocated beside the per-rank prediction), each rank's
#    allocated and reserved peaks under DDP and FSDP against the allocator replay per rank (plan_check.py ranks),
#    and the CPU/gloo distributed tests re-run for good measure; distributed checkpoints (DCP) written by NCCL ranks,
#    in the background and synchronously, a resume from them, FSDP with --compile, --init-from into shards
# 4. CPU-only predictions for this card (fake tensors, `--target cuda --gpu <card>`) against
#    max_memory_allocated and max_memory_reserved of real steps: tiny, small, medium, 3b, and two Hugging Face
#    models planned from their config.json alone (Qwen2.5 0.5B, Pythia 1B; random weights)
#    (benchmarks/plan_check.py cuda; the table goes to OUT_DIR/plan_check_cuda.md for RESULTS.md)
# 5. The time model on the card: bench's predicted step-time ratios (calibrated on the GPU) beside the
#    measured ones are in step 1's table; here the roofline estimate made from the CPU for this card
#    (`fitgpt plan --gpu`) beside them, and the 3b preset trained with the configuration `fitgpt fit`
#    picks (bf16, compile), its MFU from tokens/s (6 N FLOPs a token) against the card's bf16 peak.
# 6. The optimizer's memory settings on the card (issue 24): the small preset trained 5 steps under
#    --activation-checkpointing auto with each (bf16 moments, the step in the backward, torchao's 8-bit AdamW
#    compiled, whose temporaries are planned as its eager step's; the optimizer on the host, whose step and copies
#    are timed against the modelled ones by the step times logged), the allocator's peak beside the prediction.
# 7. Issue 44: Adafactor, Muon, GaLore, APOLLO, APOLLO-Mini and pure bf16 weights in step 6's loop; GaLore's
#    LLaMA-7B shape (bf16 weights, Adafactor in the backward, 16 x 256) trained 5 steps under a 22 GiB plan, the
#    allocator's peak beside it; and GaLore's own recipe (8-bit GaLore AdamW, rank 1024: bitsandbytes, not planned)
#    on that shape, its allocator peak beside the 22.8 GB its README gives. Needs pip install '.[lowbit,lowrank]'.
#    7c: each setting's validation loss on the issue's larger run (26M parameters, 2,000 steps), and its curves.
# 8. Issue 45: torchtitan's 70B recipe (FSDP 32 x TP 8) planned from the CPU, block and block+fused-loss; TP 2 on 2
#    GPUs (block, block+fused-loss) and FSDP 2 x TP 2 on 4,
#    trained (llama-1b, bf16, 4 x 1024), rank 0's allocator peak beside the plan of one rank.
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
  --policies none pointwise selective block group:2 every:2 chunked-loss block+chunked-loss auto:50% auto:25% \
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
  # FSDP planned per rank (fake ranks, this card modelled) and each rank's max_memory_allocated at its second step
  torchrun --nproc-per-node 2 -m fitgpt train --preset small --batch-size 4 --model.context-length 512 --max-steps 5 \
    --parallel fsdp --precision bf16 --activation-checkpointing auto --memory-budget 4GiB --out-dir "$OUT/fsdp_auto" \
    --no-progress | tail -n 1 > "$OUT/fsdp_auto.json"
  fitgpt plan --preset small --batch-size 4 --context 512 --world-size 2 --parallel fsdp --device cuda \
    --memory-budget 20GiB | tail -n 1 > "$OUT/plan_fsdp.json"
  # Each rank's max_memory_allocated and max_memory_reserved under DDP and FSDP (2 micro-batches) against the
  # allocator replay for one rank of 2, planned on fake CPU tensors for this card
  torchrun --nproc-per-node 2 benchmarks/plan_check.py ranks --out "$OUT/plan_check_ranks.json" | tee "$OUT/plan_check_ranks.md"
  # Issue 36: distributed checkpoints with NCCL (each rank writes its shards from the GPU; in the background the
  # state is staged to host memory first: the log's "staged ... in" is the step's stall, "written in" the write),
  # a resume on 2 GPUs from them, FSDP with --compile (each block compiled before sharding) and --init-from into shards
  torchrun --nproc-per-node 2 -m fitgpt train --preset small --batch-size 4 --model.context-length 512 --max-steps 20 \
    --checkpoint-interval 5 --parallel fsdp --compile --out-dir "$OUT/fsdp_dcp" --no-progress 2>&1 \
    | tee "$OUT/fsdp_dcp.log" | grep -E "staged|saved|run:"
  torchrun --nproc-per-node 2 -m fitgpt train --preset small --batch-size 4 --model.context-length 512 --max-steps 25 \
    --parallel fsdp --compile --async-checkpoint off --resume latest --out-dir "$OUT/fsdp_dcp" --no-progress 2>&1 \
    | tee -a "$OUT/fsdp_dcp.log" | grep -E "resumed|saved|run:"
  fitgpt export --run "$OUT/fsdp_dcp" --out "$OUT/fsdp_dcp_hf"
  torchrun --nproc-per-node 2 -m fitgpt train --init-from "$OUT/fsdp_dcp_hf" \
    --batch-size 4 --max-steps 5 --parallel fsdp --out-dir "$OUT/fsdp_init_from" --no-progress 2>&1 | tail -n 2
  python -m pytest -q tests/test_distributed.py tests/test_dist_checkpoint.py tests/test_elastic.py
else
  echo "== 3. skipped: needs 2 GPUs, found $NGPU"
fi

echo "== 3b. issue 38: snapshots and expandable segments on the card"
# A real step's snapshot (the allocator's history) against the plan's prediction, and max_memory_reserved under
# expandable_segments:True against the expandable-segments replay.
fitgpt train --preset small --batch-size 8 --model.context-length 1024 --grad-accum 1 --max-steps 3 --device cuda \
  --precision bf16 --memory-snapshot 2 --out-dir "$OUT/snapshot" --no-progress 2>&1 | grep -E "snapshot|run:"
fitgpt plan --preset small --batch-size 8 --context 1024 --grad-accum 1 --device cuda --memory-budget 70GiB \
  --activation-checkpointing none --compare "$OUT/snapshot/memory_snapshot.pickle" --report "$OUT/report" | grep -E "against|report"
for conf in "" "expandable_segments:True"; do
  PYTORCH_CUDA_ALLOC_CONF="$conf" fitgpt bench --preset small --batch-size 8 --context 1024 --grad-accum 1 --device cuda \
    --precision bf16 --policies none block --repeats 3 --warmup 1 --out-dir "$OUT/bench_alloc_${conf:-default}" | tail -n 1
  fitgpt plan --preset small --batch-size 8 --context 1024 --grad-accum 1 --gpu "$(python -c 'import torch; print(torch.cuda.get_device_name())')" \
    --memory-budget 70GiB --activation-checkpointing block --alloc-conf "${conf:-expandable_segments:False}" | grep -E "allocator:|replayed"
done

echo "== 4. CPU-only predictions for this card vs the allocator"
python benchmarks/plan_check.py cuda --out "$OUT/plan_check_cuda.json" | tee "$OUT/plan_check_cuda.md"

echo "== 5. roofline from the CPU vs the card; 3b with the configuration fit picks"
GPU=$(python - <<'PY'
import torch
from fitgpt.estimate.hardware import GPUS
name = torch.cuda.get_device_name(0).lower()
print(next((g for g in GPUS if g.split("-")[0].replace("rtx-", "") in name.replace(" ", "-")), "h100-80gb"))
PY
)
CUDA_VISIBLE_DEVICES="" fitgpt plan --preset small --batch-size 8 --context 1024 --grad-accum 1 --gpu "$GPU" \
  --precision bf16 --memory-budget 70GiB | tail -n 1 > "$OUT/roofline_small.json"
CUDA_VISIBLE_DEVICES="" fitgpt fit --preset 3b --gpu "$GPU" --precision bf16 --top 3 | tee "$OUT/fit_3b.txt" | tail -n 8
CMD=$(grep "^train the fastest:" "$OUT/fit_3b.txt" | sed 's/^train the fastest: //')
eval "$CMD --max-steps 30 --log-interval 10 --eval-interval 1000 --compile --out-dir $OUT/3b --no-progress" 2>&1 \
  | tee "$OUT/3b.log" | grep -E "step 30|run:"
python - "$OUT" "$GPU" <<'PY'
import json, pathlib, sys
from fitgpt.estimate.hardware import GPUS
out, gpu = pathlib.Path(sys.argv[1]), GPUS[sys.argv[2]]
metrics = out / "3b" / "metrics.jsonl"
rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][1:]  # the first interval includes compilation
params = 3.2e9
if tps:
    mfu = 6 * params * tps[-1] / gpu.half_flops
    (out / "mfu_3b.txt").write_text(f"3b: {tps[-1]:.0f} tokens/s, MFU {mfu:.1%} of {gpu.half_flops / 1e12:.0f} TFLOP/s\n")
PY

echo "== 6. optimizer memory settings on CUDA: predicted vs allocator peak"
for OPT in "--optim.state-dtype bf16" "--optim.in-backward" "--optim.state-dtype bf16 --optim.in-backward" \
           "--optim.name adamw8bit --optim.in-backward" "--optim.name adamw4bit" "--optim.offload" \
           "--optim.offload --optim.in-backward" "--optim.name adafactor --optim.in-backward --optim.lr 3e-2" \
           "--optim.name muon" "--model.weights-dtype bf16 --optim.name adafactor --optim.in-backward --optim.lr 3e-2" \
           "--model.weights-dtype bf16 --optim.in-backward" "--optim.name galore-adamw --optim.rank 256 --optim.in-backward" \
           "--optim.name apollo --optim.rank 256" \
           "--model.weights-dtype bf16 --optim.name apollo-mini --optim.in-backward --optim.lr 1e-2"; do
  NAME=$(echo "$OPT" | tr -d '-' | tr ' .' '__')
  # shellcheck disable=SC2086
  fitgpt train --preset small --batch-size 8 --model.context-length 1024 --grad-accum 1 --max-steps 5 --device cuda \
    --precision bf16 $OPT --activation-checkpointing auto --memory-budget 6GiB --out-dir "$OUT/opt_$NAME" --no-progress \
    2>&1 | grep -E "auto:" | sed "s/^/$OPT: /" | tee -a "$OUT/optimizers.log" || true
done

echo "== 7. issue 44: GaLore's LLaMA-7B shape (16 x 256) in a 22 GiB budget, bf16 weights, Adafactor in the backward"
# The plan's peak (fitted to an RTX 4090's budget) against the allocator's on this card, and its tokens/s.
fitgpt train --preset llama-1b --model.n-embed 4096 --model.n-head 32 --model.n-kv-head 32 --model.n-blocks 32 \
  --model.ffn-hidden 11008 --model.vocab-size 32000 --model.tie-embeddings False --model.context-length 256 \
  --batch-size 16 --grad-accum 1 --max-steps 5 --device cuda --precision bf16 --model.weights-dtype bf16 \
  --optim.name adafactor --optim.in-backward --optim.grad-clip 0 --optim.lr 3e-2 --activation-checkpointing auto \
  --memory-budget 22GiB --out-dir "$OUT/galore7b" --no-progress 2>&1 | grep -E "auto:|tokens/s" \
  | sed "s/^/galore-7b-shape: /" | tee -a "$OUT/optimizers.log" || true

echo "== 7b. GaLore's own recipe on that shape: 8-bit GaLore AdamW (bitsandbytes, CUDA only: not planned), rank 1024"
# Its README gives 22.8 GB on an RTX 4090 (per-layer steps, checkpointing): the allocator's peak (peak_allocated in
# metrics.jsonl), each block checkpointed, beside it and beside the Adafactor plan above.
fitgpt train --preset llama-1b --model.n-embed 4096 --model.n-head 32 --model.n-kv-head 32 --model.n-blocks 32 \
  --model.ffn-hidden 11008 --model.vocab-size 32000 --model.tie-embeddings False --model.context-length 256 \
  --batch-size 16 --grad-accum 1 --max-steps 5 --log-interval 1 --device cuda --precision bf16 --model.weights-dtype bf16 \
  --optim.name galore-adamw8bit --optim.rank 1024 --optim.update-proj-gap 500 --optim.proj-scale 0.25 \
  --optim.in-backward --optim.grad-clip 0 --optim.lr 1e-2 --activation-checkpointing block \
  --out-dir "$OUT/galore7b_8bit" --no-progress 2>&1 | tail -3 | sed "s/^/galore-7b-8bit: /" | tee -a "$OUT/optimizers.log" || true
python - "$OUT" <<'PY'
import json, pathlib, sys
f = pathlib.Path(sys.argv[1]) / "galore7b_8bit" / "metrics.jsonl"
peaks = [json.loads(l).get("peak_allocated") for l in f.read_text().splitlines()] if f.is_file() else []
peaks = [p for p in peaks if p]
if peaks:
    with open(pathlib.Path(sys.argv[1]) / "optimizers.log", "a") as log:
        log.write(f"auto: galore-7b-8bit (GaLore's recipe, block): max_memory_allocated {max(peaks) / 2**30:.2f} GiB "
                  "(its README: 22.8 GB)\n")
PY

echo "== 7c. issue 44: what each setting costs in loss, the larger run (26M parameters, 2,000 steps) on the card"
python benchmarks/optimizers.py quality --size gpu --out "$OUT/quality_gpu" --only "AdamW fp32" "8-bit AdamW" \
  "Adafactor, lr 3e-2" "Muon" "GaLore AdamW, lr 1e-2" "APOLLO, lr 1e-2" "APOLLO-Mini, lr 1e-2" \
  | tee "$OUT/quality_gpu.md" || true
python benchmarks/optimizers.py curves --size gpu --out "$OUT/quality_gpu" --png "$OUT/optimizer-loss-gpu.png" || true

echo "== 8. issue 45: tensor parallelism on the cards (NCCL), each rank's allocator peak beside one rank's plan"
# torchtitan's Llama-3.1-70B recipe (FSDP 32 x TP 8 on 256 H100s, full checkpointing, 16 x 8192, bf16), planned
# from the CPU (block, and block+fused-loss); then TP 2 (2 GPUs; block, and block+fused-loss) and FSDP 2 x TP 2
# (4 GPUs) trained at a size a card runs, their plans beside them.
for POLICY in block block+fused-loss; do
  CUDA_VISIBLE_DEVICES="" fitgpt plan --preset llama-1b --model.n-embed 8192 --model.n-blocks 80 --model.n-head 64 \
    --model.n-kv-head 8 --model.ffn-hidden 28672 --model.vocab-size 128256 --model.context-length 8192 \
    --model.tie-embeddings False --batch-size 16 --grad-accum 1 --world-size 256 --parallel fsdp --tensor-parallel 8 \
    --activation-checkpointing "$POLICY" --gpu h100-80gb --precision bf16 | tail -n 1 > "$OUT/plan_70b_${POLICY//+/_}.json"
done
TP_FLAGS=(--preset llama-1b --model.tie-embeddings False --batch-size 4 --grad-accum 1 --precision bf16)
for LAYOUT in "2 1 block" "4 2 block" "2 1 block+fused-loss"; do  # processes, data-parallel groups, policy
  read -r N DP POLICY <<< "$LAYOUT"
  [ "$NGPU" -ge "$N" ] || { echo "TP over $N GPUs: skipped, found $NGPU"; continue; }
  EXTRA=(--activation-checkpointing "$POLICY"); [ "$DP" -gt 1 ] && EXTRA+=(--parallel fsdp)
  TAG="${N}_${POLICY//+/_}"
  torchrun --nproc-per-node "$N" -m fitgpt train "${TP_FLAGS[@]}" "${EXTRA[@]}" --tensor-parallel 2 \
    --model.context-length 1024 --max-steps 10 --log-interval 1 --out-dir "$OUT/tp_$TAG" --no-progress 2>&1 | tail -n 2
  CUDA_VISIBLE_DEVICES="" fitgpt plan "${TP_FLAGS[@]}" "${EXTRA[@]}" --tensor-parallel 2 --world-size "$N" \
    --context 1024 --gpu "$GPU" | tail -n 1 > "$OUT/plan_tp_$TAG.json"
done

python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
lines = []
bench = json.loads((out / "bench_line.json").read_text())
for r in bench["rows"]:
    lines.append(f"bench {r['policy']:>20} = {r['spec']:<40} peak {r['peak_bytes']/2**30:6.2f} GiB  step {r['step_seconds']*1e3:7.1f} ms")
for name in ("auto.log", "optimizers.log"):
    f = out / name
    lines += [line for line in f.read_text().splitlines() if "auto:" in line] if f.is_file() else []
for name in ("ddp", "fsdp", "fsdp_resumed_on_one_gpu"):
    f = out / f"{name}.json"
    if f.is_file():
        s = json.loads(f.read_text())
        lines.append(f"{name}: steps {s['steps']} train loss {s['train_loss']:.4f} val loss {s['val_loss']:.4f}")
f = out / "fsdp_auto.json"
if f.is_file():
    plan = json.loads(f.read_text())["memory_plan"]
    for rank, m in enumerate(plan.get("measured_peaks", [])):
        lines.append(f"fsdp per rank, {plan['policy']}: rank {rank} max_memory_allocated {m / 2**30:.3f} GiB vs predicted "
                     f"{plan['predicted_peak'] / 2**30:.3f} GiB ({m / plan['predicted_peak'] - 1:+.2%}; goal 2%)")
for r in bench["rows"]:
    lines.append(f"time {r['policy']:>20}: measured {r['step_seconds'] / bench['rows'][0]['step_seconds']:.2f}x, "
                 f"predicted {(r.get('predicted_seconds') or 0) / (bench['rows'][0].get('predicted_seconds') or 1):.2f}x")
for name in ("mfu_3b.txt",):
    if (out / name).is_file():
        lines.append((out / name).read_text().strip())
for f in (out / "plan_70b_block.json", out / "plan_70b_block_fused-loss.json"):
    if f.is_file():
        p = json.loads(f.read_text())
        lines.append(f"70B, FSDP 32 x TP 8, {p['policy']} (planned): {p['predicted_peak'] / 2**30:.2f} GiB a rank, "
                     f"max_memory_allocated {p['predicted_max_allocated'] / 2**30:.2f} GiB, in {p['profile_seconds']:.0f} s")
for tag in ("2_block", "4_block", "2_block_fused-loss"):
    run, plan = out / f"tp_{tag}" / "metrics.jsonl", out / f"plan_tp_{tag}.json"
    if run.is_file() and plan.is_file():
        peak = max((json.loads(l).get("peak_allocated") or 0) for l in run.read_text().splitlines())
        p = json.loads(plan.read_text())
        lines.append(f"TP 2 over {tag.replace('_', ' GPUs, ', 1)}: rank 0's max_memory_allocated {peak / 2**30:.3f} GiB "
                     f"vs predicted {p['predicted_max_allocated'] / 2**30:.3f} GiB ({peak / p['predicted_max_allocated'] - 1:+.2%})")
check = out / "plan_check_cuda.md"
if check.is_file():
    lines += ["", "CPU-only predictions vs the allocator:", check.read_text()]
check = out / "plan_check_ranks.md"
if check.is_file():
    lines += ["", "Per rank under DDP and FSDP, the replay vs the allocator (goals: 2% allocated, 5% reserved):",
              check.read_text()]
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
