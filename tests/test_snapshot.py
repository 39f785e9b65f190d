"""Memory snapshots in PyTorch's format (issue 38, items 2 and 3): the planner's predicted step, read by PyTorch's own
viewer code, and a real CPU step recorded by the live-tensor tracker, equal to the prediction event for event."""

import pytest
import torch
from torch.cuda import _memory_viz as viz

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.estimate.hardware import Target, find_gpu
from fitgpt.estimate.replay import predicted_snapshot, simulate_step
from fitgpt.memory.snapshot import MeasuredSnapshot, first_difference, read_snapshot, step_events
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.step import train_step

H100 = Target("cuda", find_gpu("h100-80gb"))


def _peak_from(snapshot: dict, first_phase: str) -> int:
    """The most bytes allocated at once from the first event of ``first_phase`` on."""
    allocated, peak, seen = 0, 0, False
    for e in snapshot["device_traces"][0]:
        seen = seen or e["frames"] and e["frames"][0]["filename"].startswith(first_phase)
        allocated += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, allocated) if seen else peak
    return peak


@pytest.mark.parametrize("policy", ["none", "block"])
def test_a_predicted_snapshot_is_read_by_pytorchs_viewer_and_holds_the_replayed_peaks(tiny_model_config, policy):
    cfg = tiny_model_config(n_blocks=2)
    snap = predicted_snapshot(cfg, policy, 2, 32, 1, torch.bfloat16, OptimConfig(), H100)
    # PyTorch's own readers: segsum checks that every segment's blocks add up; trace walks every event.
    summary = viz.segsum(snap)
    assert f"segments: {len(snap['segments'])}" in summary
    assert f"{len(snap['device_traces'][0])} entries" in viz.trace(snap)
    held = viz.memory(snap, format_flamegraph=lambda lines: lines)  # what is alive as the step ends, by frames
    assert "weights:0:" in held and "step 1: optimizer step:0:aten." in held  # the weights; the AdamW state step 1 made
    for html in (viz.trace_plot(snap), viz.segment_plot(snap)):
        assert "snapshot.pickle" in html
    replayed = simulate_step(cfg, policy, 2, 32, 1, torch.bfloat16, OptimConfig(), H100, repeat=False)
    assert _peak_from(snap, "step 2") == replayed["max_allocated"]  # the steady step, as the plan reports it
    assert sum(s["total_size"] for s in snap["segments"]) == replayed["max_reserved"]  # segments are never returned
    assert all(e["frames"][0]["name"] for e in snap["device_traces"][0] if e["action"] == "alloc")


@pytest.mark.parametrize("policy", ["none", "block", "selective"])
def test_a_real_cpu_step_is_the_predicted_one_event_for_event(tiny_model_config, policy):
    cfg = tiny_model_config(n_blocks=2)
    predicted = predicted_snapshot(cfg, policy, 2, 32, 1, None, OptimConfig(), Target("cpu"))
    model = Transformer(cfg)
    apply_activation_checkpointing(model, policy)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))

    def step():  # as the replay and the trainer step: the token batches made in the step, freed before its results
        batches = [(torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))]
        return train_step(model, optimizer, batches, grad_clip=OptimConfig().grad_clip)

    with MeasuredSnapshot(model, optimizer) as rec:
        step()
        rec.next_step()
        step()
    measured = rec.snapshot
    assert first_difference(predicted, measured) is None
    events = step_events(measured)
    assert len(events) == len(step_events(predicted)) > 500
    assert {"step 1: optimizer step", "step 2: backward, block 0"} <= {phase for _, _, phase, _ in events}
    viz.segsum(measured)


def test_the_first_difference_is_named_with_its_phase_op_and_bytes(tiny_model_config):
    cfg = tiny_model_config(n_blocks=2)
    a = predicted_snapshot(cfg, "none", 2, 32, 1, None, OptimConfig(), Target("cpu"))
    b = predicted_snapshot(cfg, "none", 2, 32, 1, None, OptimConfig(), Target("cpu"))
    allocs = [e for e in b["device_traces"][0]
              if e["action"] == "alloc" and e["frames"][0]["filename"].startswith("step 1: forward, block 1")]
    allocs[0]["size"] += 512
    why = first_difference(a, b)
    assert "step 1: forward, block 1" in why and f"measured alloc of {allocs[0]['size']:,} bytes" in why


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_train_records_its_first_steps_and_plan_compares_them(cli_train_args, tmp_path, capsys):
    """`train --memory-snapshot 2` on the CPU writes the tracker's snapshot, which PyTorch's viewer reads; `plan
    --compare` puts the plan's step beside it, names where they part, and draws both."""
    from fitgpt.cli import main

    run = tmp_path / "run"
    assert main(cli_train_args(run, steps=3) + ["--memory-snapshot", "2"]) == 0
    snap = run / "memory_snapshot.pickle"
    data = read_snapshot(snap)
    assert {"step 1: forward, block 0", "step 2: optimizer step"} <= {p for _, _, p, _ in step_events(data)}
    viz.segsum(data)
    capsys.readouterr()
    assert main(["plan", "--preset", "tiny", "--model.n-embed", "32", "--model.n-head", "4", "--model.n-blocks", "2",
                 "--model.vocab-size", "512", "--context", "32", "--batch-size", "4", "--memory-budget", "1GiB",
                 "--activation-checkpointing", "none", "--compare", str(snap), "--report", str(tmp_path / "rep"),
                 "--memory-snapshot", str(tmp_path / "plan.pickle")]) == 0
    out = capsys.readouterr().out
    assert f"against {snap}: " in out and "report:" in out
    assert (tmp_path / "rep/plan.png").stat().st_size > 10_000 and read_snapshot(tmp_path / "plan.pickle")


# ---- expandable segments (issue 38, item 4) -------------------------------------------------------

def test_expandable_segments_are_read_from_the_allocator_settings(monkeypatch):
    from fitgpt.memory.allocator import expandable_from

    assert expandable_from("max_split_size_mb:128,expandable_segments:True")
    assert not expandable_from("expandable_segments:False") and not expandable_from("max_split_size_mb:128")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # torchtitan's launcher sets this one
    assert expandable_from()


def test_expandable_segments_grow_one_segment_by_pages_and_leave_fewer_slivers():
    """Batch N, then N + 1 (PyTorch's own example): the default allocator takes a new segment for each larger
    request; one expandable segment maps pages at its end, and reserves less."""
    from fitgpt.memory.allocator import LARGE_PAGE, CachingAllocatorModel, ExpandableAllocatorModel
    from fitgpt.memory.snapshot import SnapshotTrace

    reserved = {}
    for model in (CachingAllocatorModel, ExpandableAllocatorModel):
        trace = SnapshotTrace(model())
        for step, grow in enumerate((0, 2**20)):
            for i in range(10):
                trace.malloc((step, i), 30 * 2**20 + grow + i * 2**20)
            for i in range(10):
                trace.free((step, i))
        reserved[model.__name__] = trace.peak_reserved
        snap = trace.snapshot()
        viz.segsum(snap)  # PyTorch's accounting holds
        if model is ExpandableAllocatorModel:
            assert len(snap["segments"]) == 1 and snap["segments"][0]["is_expandable"]
            assert trace.peak_reserved % LARGE_PAGE == 0
            assert any(e["action"] == "segment_map" for e in snap["device_traces"][0])
    assert reserved["ExpandableAllocatorModel"] < reserved["CachingAllocatorModel"]


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_plan_names_the_allocator_it_models_and_replays_it(capsys, monkeypatch):
    import json

    from fitgpt.cli import main

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    plans = {}
    for conf in ([], ["--alloc-conf", "expandable_segments:True"]):
        assert main(["plan", "--preset", "tiny", "--gpu", "h100-80gb", "--batch-size", "4", "--context", "128", *conf]) == 0
        out = capsys.readouterr().out
        plans[bool(conf)] = (out, json.loads(out.strip().splitlines()[-1])["replay"])
    assert "allocator: the default caching allocator" in plans[False][0]
    assert "allocator: expandable segments" in plans[True][0]
    assert plans[True][1]["max_reserved"] % (2 * 2**20) == 0  # whole pages
    assert plans[True][1]["max_reserved"] != plans[False][1]["max_reserved"]


def test_snapshot_and_report_paths_are_refused_in_one_line_before_any_work(tmp_path, capsys):
    from fitgpt.cli import main

    (tmp_path / "bad.pickle").write_bytes(b"not a pickle")
    (tmp_path / "file").write_text("x")
    plan = ["plan", "--preset", "tiny", "--memory-budget", "1GiB"]
    for flags, says in ((["--compare", str(tmp_path / "bad.pickle")], "is not a memory snapshot"),
                        (["--compare", str(tmp_path / "none.pickle")], "no such snapshot file"),
                        (["--report", str(tmp_path / "file")], "--report"),
                        (["--memory-snapshot", str(tmp_path)], "is a folder; name a file")):
        assert main(plan + flags) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
