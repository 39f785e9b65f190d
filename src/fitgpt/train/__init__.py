"""Training: the loop, what it keeps on disk, and DDP/FSDP.

    trainer.py      train(): the recipe, from data to the last checkpoint
    setup.py        made once before the loop: data, model, policy; prepare_model (AC, then compile, then DDP/FSDP)
    loop.py         the loop: train_step, evaluation, logs, saves, signals
    resume.py       continuing from a checkpoint: the same model and tokenizer, every rank's data position and RNG
    signals.py      Ctrl-C and SIGTERM: save after this step, stop
    checkpoint.py   checkpoint files: atomic, checksummed, verified
    load.py         a trained run loaded, for generate and export
    rundir.py       one run per run directory
    metrics.py      metrics.jsonl, TensorBoard, the loss curve
    distributed.py  torchrun: process group, DDP / FSDP2, full-state checkpoints
"""
