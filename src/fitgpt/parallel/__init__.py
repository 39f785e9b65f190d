"""How a model is split over ranks, one module a kind, as training runs it and as planning profiles it (on a fake
process group), so that the planner's per-rank step is exactly the trainer's:

- `data`: DDP, each rank the whole model, its gradients all-reduced in buckets;
- `fsdp`: FSDP2, each rank its shard of every parameter (and a sharded model's start and compilation);
- `tensor`: tensor and sequence parallelism, each block split by heads and columns over a group of ranks;
- `placement`: whole tensors into and out of any of those layouts (checkpoints, whole-matrix optimizer steps).

`fitgpt.train.setup.prepare_model` applies them, in torchtitan's order: the tensor-parallel split, activation
checkpointing, compilation, then FSDP or DDP over the data-parallel ranks.
"""
