"""`fitgpt train --pipeline-parallel P` under torchrun (gloo CPU ranks): trains as one process does, checkpoints with
DCP (the optimizer's state numbered as the whole model's), resumes on the same layout and in one process, and its
checkpoint is read by `generate`. (A step's loss and gradients against one process: test_pipeline.py.)"""

import pytest
import torch
from test_doors import one_line, run_cli
from test_tensor_parallel_runs import _flags, _losses


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule, policy", [("gpipe", "block --compile"), ("1f1b", "selective"),
                                              ("interleaved-1f1b", "chunked-loss:32"), ("zbv", "none"),
                                              ("dualpipev", "block")])
def test_a_pipeline_trains_as_one_process_checkpoints_and_resumes(schedule, policy, data_dir, corpus_dir, tmp_path,
                                                                  capsys, ranks):
    """Llama-tiny (4 blocks) over 2 ranks, 2 micro-batches of the batch of 4 (4 stages interleaved or in ZBV's V, 4
    micro-batches; ZBV and DualPipeV evaluate by ZBV's forwards alone), each stage's blocks checkpointed by ``policy`` (the last
    stage's loss in chunks, where it says so; GPipe's blocks compiled besides, each inside its wrapper): every logged
    loss within fp32 rounding of one process's (which checkpoints nothing); resumed at step 3, the straight run's last
    losses; the checkpoint trains on in one process and `generate` samples from it."""
    from fitgpt.cli import main

    assert main(_flags(data_dir, corpus_dir, tmp_path / "one")) == 0
    run = tmp_path / "pp"
    flags = ["--pipeline-parallel", "2", "--pipeline-schedule", schedule, "--activation-checkpointing", *policy.split()]
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags))
    (one, one_val), (pp, pp_val) = _losses(tmp_path / "one"), _losses(run)
    assert len(pp) == 6 and len(pp_val) == 2
    torch.testing.assert_close(torch.tensor(pp + pp_val), torch.tensor(one + one_val), rtol=1e-5, atol=0)
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags, "--resume", str(run / "checkpoints" / "step_00000003")))
    again, again_val = _losses(run)
    assert again[-3:] == pp[-3:] and again_val[-1:] == pp_val[-1:]  # bitwise: the optimizer's state came back
    assert main(_flags(data_dir, corpus_dir, run, "--max-steps", "7", "--resume",
                       str(run / "checkpoints" / "step_00000006"))) == 0
    assert len(_losses(run)[0]) == 7 and abs(_losses(run)[0][-1] - one[-1]) < 0.5
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert "def " in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_apollo_over_stages_trains_as_one_process_and_its_checkpoint_resumes_on_any_layout(data_dir, corpus_dir,
                                                                                            tmp_path, ranks):
    """APOLLO-Mini over 2 stages (issue 69): each matrix projected by the seed of its place in the whole model, so
    every loss is one process's; its checkpoint holds one process's groups (APOLLO's projected runs, numbered as the
    whole model's), so that it resumes bitwise on the pipeline and, in one process, on the straight run's losses (once
    refused: "a different number of parameter groups")."""
    from fitgpt.cli import main

    apollo = ["--optim.name", "apollo-mini"]
    assert main(_flags(data_dir, corpus_dir, tmp_path / "one", *apollo)) == 0
    run, flags = tmp_path / "pp", [*apollo, "--pipeline-parallel", "2"]
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags))
    one, pp = _losses(tmp_path / "one")[0], _losses(run)[0]
    torch.testing.assert_close(torch.tensor(pp), torch.tensor(one), rtol=1e-5, atol=0)
    ranks(2).cli(_flags(data_dir, corpus_dir, run, *flags, "--resume", str(run / "checkpoints" / "step_00000003")))
    assert _losses(run)[0][-3:] == pp[-3:]  # bitwise: the moments and projections came back
    assert main(_flags(data_dir, corpus_dir, run, *apollo, "--resume", str(run / "checkpoints" / "step_00000003"))) == 0
    torch.testing.assert_close(torch.tensor(_losses(run)[0]), torch.tensor(one), rtol=1e-5, atol=0)


@pytest.mark.parametrize("extra, needle", [
    (["--pipeline-parallel", "2"], "launch a multiple of 2 with torchrun"),
    (["--pipeline-microbatches", "-1"], "--pipeline-microbatches"),
    (["--pipeline-parallel", "0"], "--pipeline-parallel"),
])
def test_what_a_pipeline_cannot_take_is_refused_in_one_line(extra, needle, data_dir, corpus_dir, tmp_path, capsys):
    code, err = run_cli(_flags(data_dir, corpus_dir, tmp_path / "run", *extra), capsys)
    assert code == 2 and one_line(err) and needle in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("extra, world, needle", [
    (["--pipeline-parallel", "2"], 3, "launch a multiple of 2"),
    (["--pipeline-parallel", "2"], 4, "add --parallel fsdp"),
    (["--pipeline-parallel", "2", "--parallel", "fsdp"], 2, "drop --parallel fsdp"),
    (["--pipeline-parallel", "2", "--grad-accum", "2"], 2, "--pipeline-microbatches 4"),
    (["--pipeline-parallel", "2", "--optim.in-backward"], 2, "drop --optim.in-backward"),
    (["--pipeline-parallel", "4", "--pipeline-schedule", "interleaved-1f1b"], 4, "more than its 4 blocks"),
    (["--pipeline-parallel", "2", "--pipeline-microbatches", "3"], 2, "does not divide --batch-size 4"),
    (["--pipeline-parallel", "2", "--optim.offload"], 2, "drop --optim.offload"),
    (["--pipeline-parallel", "2", "--pipeline-schedule", "zbv", "--parallel", "fsdp"], 4,
     "add --fsdp-reshard-after-forward torchtitan"),
    (["--pipeline-parallel", "2", "--pipeline-schedule", "interleaved-zero-bubble", "--compile"], 2, "drop --compile"),
    (["--pipeline-parallel", "2", "--pipeline-schedule", "zbv", "--model.tie-embeddings", "True"], 2,
     "use --model.tie-embeddings False"),
    (["--pipeline-parallel", "2", "--pipeline-microbatches", "1"], 2, "--pipeline-microbatches 2 or more"),
    (["--pipeline-parallel", "2", "--pipeline-schedule", "dualpipev", "--pipeline-microbatches", "2"], 2,
     "--pipeline-microbatches 4 or more"),
    (["--pipeline-parallel", "2", "--pipeline-schedule", "interleaved-1f1b", "--batch-size", "10",
      "--pipeline-microbatches", "5"], 2, "use a multiple of 2 for --pipeline-microbatches"),
    (["--pipeline-parallel", "2", "--tensor-parallel", "2"], 6, "launch a multiple of 4"),
    (["--pipeline-parallel", "2", "--tensor-parallel", "3"], 6, "splits the model's n_head (4)"),
    (["--pipeline-parallel", "2", "--tensor-parallel", "2"], 8, "add --parallel fsdp"),
])
def test_a_launch_a_pipeline_cannot_take_is_refused_before_any_rank_works(extra, world, needle, data_dir, corpus_dir,
                                                                          tmp_path):
    """Asked as the trainer asks every rank before it starts (`fitgpt.refusals.launch_refusal`)."""
    from fitgpt.cli.train import parse
    from fitgpt.refusals import launch_refusal

    cfg = parse(_flags(data_dir, corpus_dir, tmp_path / "run", *extra)[1:])
    why = launch_refusal(cfg, world, "cpu", None)
    assert why is not None and needle in why and "\n" not in why


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-zero-bubble", "dualpipev"])
def test_a_zero_bubble_schedule_trains_over_fsdp_with_each_blocks_weights_kept_gathered(schedule, data_dir, corpus_dir,
                                                                                        tmp_path):
    """Once refused whatever the setting (issue 69): the split backward misses only a resharded block's weights."""
    from fitgpt.cli.train import parse
    from fitgpt.refusals import launch_refusal

    flags = ["--pipeline-parallel", "2", "--pipeline-schedule", schedule, "--parallel", "fsdp", "--pipeline-microbatches",
             "4", "--model.tie-embeddings", "False"]
    for keep in ("torchtitan", "never"):
        cfg = parse(_flags(data_dir, corpus_dir, tmp_path / "run", *flags, "--fsdp-reshard-after-forward", keep)[1:])
        assert launch_refusal(cfg, 4, "cpu", None) is None, keep


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_stages_sharded_by_fsdp_train_as_fsdp_does(data_dir, corpus_dir, tmp_path, ranks):
    """PP 2 x FSDP 2 on 4 ranks (its state offloaded to the host), GPT-2 with its head tied to the embedding (the tiny
    preset's), each block checkpointed: every logged loss within fp32 rounding of FSDP over 2 ranks, of DDP over 2 and of one process of 2
    micro-batches: each a cut of the same global batch of 8 windows, which the sampler draws alike for every layout
    (Megatron's rule; once, 2 data-parallel ranks drew other windows than one process, and logged 6.2342 at step 6
    where one process logged 6.2138). A resume from step 3 ends on the straight run's losses, and one process
    resumes the same checkpoint on the same windows, then samples from it."""
    def flags(out, *extra):
        return [*_flags(data_dir, corpus_dir, out, "--activation-checkpointing", "block", "--parallel", "fsdp",
                        preset="tiny"), "--model.tie-embeddings", "True", "--model.dropout", "0", *extra]

    from fitgpt.cli import main

    ranks(2).cli(flags(tmp_path / "fsdp"))
    ranks(2).cli(flags(tmp_path / "ddp", "--parallel", "ddp"))
    assert main(flags(tmp_path / "one", "--parallel", "ddp", "--grad-accum", "2")) == 0
    run = tmp_path / "pp-fsdp"
    # Its stages' shards, gradients and AdamW state in host memory (FSDP2's CPUOffloadPolicy): the same arithmetic.
    ranks(4).cli(flags(run, "--pipeline-parallel", "2", "--fsdp-offload"))
    (fsdp, fsdp_val), (pp, pp_val) = _losses(tmp_path / "fsdp"), _losses(run)
    assert len(pp) == 6 and len(pp_val) == 2
    torch.testing.assert_close(torch.tensor(pp + pp_val), torch.tensor(fsdp + fsdp_val), rtol=1e-5, atol=0)
    for layout in ("ddp", "one"):
        torch.testing.assert_close(torch.tensor(sum(_losses(tmp_path / layout), [])), torch.tensor(fsdp + fsdp_val),
                                   rtol=1e-5, atol=0, msg=layout)
    ranks(4).cli(flags(run, "--pipeline-parallel", "2", "--fsdp-offload", "--resume",
                       str(run / "checkpoints" / "step_00000003")))
    again, _ = _losses(run)
    torch.testing.assert_close(torch.tensor(again[-3:]), torch.tensor(pp[-3:]), rtol=1e-6, atol=0)
    # Its checkpoint in one process (the stages' shards read whole, the tied head's two copies one weight again), 2
    # micro-batches a step for the same global batch: the same windows from step 4, the same losses.
    assert main([*flags(run, "--parallel", "ddp", "--grad-accum", "2"), "--resume",
                 str(run / "checkpoints" / "step_00000003")]) == 0
    torch.testing.assert_close(torch.tensor(_losses(run)[0][-3:]), torch.tensor(pp[-3:]), rtol=1e-5, atol=0)
    assert main(["generate", "--run", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_stages_split_by_tensor_parallelism_train_as_one_process_and_resume_on_four_stages(
        data_dir, corpus_dir, tmp_path, ranks):
    """PP 2 x TP 2 on 4 ranks (Llama, 1F1B, selective checkpointing): every logged loss within fp32 rounding of one
    process's; its step-3 checkpoint (each matrix in tensor-parallel shards of two stages) resumed on 4 stages of one
    block each, no tensor parallelism, ends on the straight run's losses: the weights and the optimizer's state
    followed their parameters to another layout."""
    from fitgpt.cli import main

    assert main(_flags(data_dir, corpus_dir, tmp_path / "one")) == 0
    run = tmp_path / "pp-tp"
    flags = ["--pipeline-parallel", "2", "--tensor-parallel", "2", "--activation-checkpointing", "selective"]
    ranks(4).cli(_flags(data_dir, corpus_dir, run, *flags))
    (one, one_val), (pp, pp_val) = _losses(tmp_path / "one"), _losses(run)
    assert len(pp) == 6 and len(pp_val) == 2
    torch.testing.assert_close(torch.tensor(pp + pp_val), torch.tensor(one + one_val), rtol=1e-5, atol=0)
    four = ["--pipeline-parallel", "4", "--resume", str(run / "checkpoints" / "step_00000003")]
    ranks(4).cli(_flags(data_dir, corpus_dir, run, *four))
    again, _ = _losses(run)
    torch.testing.assert_close(torch.tensor(again[-3:]), torch.tensor(pp[-3:]), rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pipeline_plans_its_own_checkpointing_within_a_budget(data_dir, corpus_dir, tmp_path, ranks):
    """--activation-checkpointing auto under --pipeline-parallel: rank 0 plans every pipeline rank (fake ranks, in a
    process of its own: this one is in the real group) and takes the least recomputing policy that fits all of them;
    each rank's measured peak is logged beside the largest rank's plan, which it matches."""
    import re

    from fitgpt.config import load_config
    from fitgpt.estimate.pipeline import plan_pipeline

    base = {"model": {"vocab_size": 512, "tie_embeddings": False}, "batch_size": 4, "pipeline_parallel": 2}
    peak = {p: max(r.peak for r in plan_pipeline(load_config("llama-tiny", overrides={**base, "activation_checkpointing": p}), 2))
            for p in ("none", "block")}
    budget = (peak["none"] + peak["block"]) // 2
    _, err = ranks(2).cli(_flags(data_dir, corpus_dir, tmp_path / "run", "--pipeline-parallel", "2", "--max-steps", "2",
                                 "--activation-checkpointing", "auto", "--memory-budget", f"{budget}B"))
    chosen = re.search(r"auto: (\w+), every pipeline rank within", err).group(1)
    assert chosen in ("pointwise", "selective", "block")
    measured = re.search(r"auto: measured peak rank 0: ([\d.]+ \w+), rank 1: ([\d.]+ \w+) .* vs predicted ([\d.]+ \w+)", err)
    assert measured.group(3) in measured.group(1, 2), err[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_pipeline_starts_from_a_hugging_face_folder_as_one_process_does(arch, data_dir, corpus_dir, tmp_path, ranks):
    """--init-from over 2 stages: rank 0 reads the folder and each stage keeps its own weights (GPT-2's tied head on
    the last stage, from the embedding): every loss is one process's started from the same folder, within fp32
    rounding (a stage left at its random start, or a head not the embedding, would differ at the first)."""
    transformers = pytest.importorskip("transformers")
    from fitgpt.cli import main

    hf = tmp_path / "hf"
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        transformers.GPT2LMHeadModel(config).save_pretrained(hf)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=128, vocab_size=512, max_position_embeddings=128,
                                          tie_word_embeddings=False)
        transformers.LlamaForCausalLM(config).save_pretrained(hf)
    start = ["--init-from", str(hf), "--max-steps", "3"]
    assert main(_flags(data_dir, corpus_dir, tmp_path / "one", *start)) == 0
    ranks(2).cli(_flags(data_dir, corpus_dir, tmp_path / "pp", *start, "--pipeline-parallel", "2"))
    (one, _), (pp, _) = _losses(tmp_path / "one"), _losses(tmp_path / "pp")
    assert len(pp) == 3
    torch.testing.assert_close(torch.tensor(pp), torch.tensor(one), rtol=1e-5, atol=0)
