"""Every optimizer through the trainer on gloo ranks (issue 57): `fitgpt train --parallel fsdp` with Muon, 8-bit AdamW
and pure bf16 weights, and the step in the backward with AdamW and Muon (once refused), checkpoints each rank's state
with DCP, resumes it bitwise on the same layout, and its checkpoint resumes in one process (each matrix's state read
whole by whichever rank steps it) and is read by `generate`. (Step by step against one process: test_split_optimizers.py.)"""

import json

import pytest
import torch


def _flags(data_dir, corpus_dir, out, *extra):
    return ["train", "--preset", "llama-tiny", "--data.dir", str(data_dir), "--data.inputs", str(corpus_dir),
            "--data.vocab-size", "512", "--batch-size", "2", "--max-steps", "6", "--checkpoint-interval", "3",
            "--log-interval", "1", "--eval-interval", "100", "--out-dir", str(out), "--no-progress", "--no-tensorboard",
            *extra]


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("extra", [["--optim.name", "muon"], ["--optim.name", "adamw8bit"],
                                   ["--model.weights-dtype", "bf16", "--optim.name", "adafactor"],
                                   ["--optim.in-backward"], ["--optim.in-backward", "--optim.name", "muon"]])
def test_fsdp_trains_checkpoints_and_resumes_every_optimizer(data_dir, corpus_dir, tmp_path, ranks, capsys, extra):
    from fitgpt.cli import main

    run = tmp_path / "fsdp"
    flags = [*extra, "--parallel", "fsdp"]
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags))
    straight = _losses(run)
    assert len(straight) == 6 and all(torch.isfinite(torch.tensor(straight)))
    # Resumed at step 3 on the same layout: the straight run's last three losses, to the bit.
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags, "--resume", str(run / "checkpoints" / "step_00000003")))
    assert _losses(run)[-3:] == straight[-3:]
    # Every parameter's state is in the checkpoint, each written by the rank that stepped it, read whole.
    from fitgpt.train import dcp_read

    saved = dcp_read.read_whole(str(run / "checkpoints" / "step_00000006" / "dcp"), "optimizer")
    n_params = len(saved["param_groups"][0]["params"]) + sum(len(g["params"]) for g in saved["param_groups"][1:])
    assert len(saved["state"]) == n_params
    # Resumed in one process (the state follows the weights to whoever steps them), and read by generate.
    assert main(_flags(data_dir, corpus_dir, run, *extra, "--max-steps", "7",
                       "--resume", str(run / "checkpoints" / "step_00000006"))) == 0
    assert len(_losses(run)) == 7 and abs(_losses(run)[-1] - straight[-1]) < 0.5
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert "def " in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp_trains_and_resumes_pure_bf16_weights_with_a_whole_matrix_optimizer(data_dir, corpus_dir, tmp_path, ranks):
    """DDP's replicas each step the whole model (Muon's whole matrices, bf16 weights rounded stochastically, each
    parameter's bits drawn alike on every rank): the run resumed at step 3 ends on the straight run's losses, to the
    bit, the generator's state in its checkpoint."""
    run = tmp_path / "ddp"
    flags = ["--optim.name", "muon", "--model.weights-dtype", "bf16", "--parallel", "ddp"]
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags))
    straight = _losses(run)
    assert len(straight) == 6 and all(torch.isfinite(torch.tensor(straight)))
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags, "--resume", str(run / "checkpoints" / "step_00000003")))
    assert _losses(run)[-3:] == straight[-3:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_whole_matrix_checkpoint_resumes_on_another_layout(data_dir, corpus_dir, tmp_path, ranks):
    """Muon's state written under FSDP x 2 (each matrix's by its owner, whole) resumes under FSDP 2 x TP 2 (the same
    data-parallel ranks, so the same batches), where other ranks own the matrices and AdamW's shards are cut by
    columns too: the two steps after the resume are the straight run's, to the rounding of the other layout (the
    second's loss is after a step of the resumed state)."""
    run, other = tmp_path / "fsdp", tmp_path / "fsdp-tp"
    flags = ["--optim.name", "muon", "--parallel", "fsdp"]
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags, "--max-steps", "5"))
    straight = _losses(run)
    ranks(4).cli(_flags(data_dir, corpus_dir, other, *flags, "--max-steps", "5", "--tensor-parallel", "2",
                        "--resume", str(run / "checkpoints" / "step_00000003")))
    resumed = _losses(other)
    assert resumed == pytest.approx(straight[-2:], rel=1e-4), (resumed, straight)
