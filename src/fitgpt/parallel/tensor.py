"""Tensor and sequence parallelism over fitgpt's model (Llama's blocks, and GPT-2's), with PyTorch's own tensor
parallelism (DTensor, ``parallelize_module``, ``SequenceParallel``, ``loss_parallel``), laid out as torchtitan lays out
Llama and as Korthikanti et al. (2022) describe it:

- each block's query, key, value, gate and up projections column-wise (each rank holds some heads and some of the MLP's
  hidden units), its output and down projections row-wise, their results reduce-scattered on the sequence. GPT-2's
  one query/key/value matrix is split by heads too: rank r holds its heads' rows of each third (``_FusedColwise``),
  written to checkpoints in row shards (``fitgpt.train.dcp_read.contiguous``); sharded again by FSDP, each rank's rows
  are placed by fitgpt (``fitgpt.parallel.split_twice``), not by DTensor; its learned positions are added to each
  rank's sequence shard;
- the norms (and the dropout after each residual branch) sequence-parallel: between blocks every activation is
  sharded on the sequence, (B, T / tp, C) a rank; each branch all-gathers its input;
- the token embedding row-wise (the vocabulary sharded) into sequence shards, and the head column-wise into logits
  sharded on the vocabulary, which ``loss_parallel`` reduces to the loss without ever gathering them whole (both hold
  the (vocab, C) matrix in rows of the vocabulary: tied, they stay one parameter, as Megatron ties them). The final
  norm's output is gathered for the head on the norm, not in the head, so that the loss heads (chunked-loss,
  fused-loss), which run the head's weight in chunks of their own, take it as the plain head does.

Under --compile each block is compiled after the split (``fitgpt.parallel.compile_blocks``), as torchtitan compiles;
the token embedding's reduce-scatter is then synchronous (``_EmbeddingRowwise``), since an asynchronous one waited on
at a compiled block's input loses DTensor's gradient type in the backward (PyTorch 2.13).

Dropout falls only on sharded activations (sequence shards, a rank's heads). On CUDA it draws from DTensor's RNG
tracker: the ranks share one seed, each shard its own offset. On CPU ranks, which the tracker does not cover, each
rank draws from its own generator, seeded apart (``seed_dropout_apart``).

The model knows nothing of this: its attention counts its heads from its projections, which is all it needs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from fitgpt.config import TrainConfig
from fitgpt.model.config import ModelConfig


def tensor_parallel_refusal(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``cfg``'s model cannot be split over ``tp`` ranks (one line naming what to change); None: it can."""
    for name, n in (("n_head", cfg.n_head), ("n_kv_head", cfg.kv_heads), ("vocab_size", cfg.vocab_size),
                    ("ffn_hidden", cfg.mlp_hidden)):
        if n % tp:
            return (f"--tensor-parallel {tp} splits the model's {name} ({n}) into {tp} equal parts: choose a degree that "
                    f"divides it, or change --model.{name.replace('_', '-')}")
    return None


def launch_refusal(cfg: TrainConfig, world: int) -> str | None:
    """Why ``cfg`` cannot train with --tensor-parallel under a launch of ``world`` processes (one line naming what to
    change); None: it can. The processes are a mesh of world / tp data-parallel shards (FSDP) x tp. Every optimizer
    trains there (AdamW on its shards, the others a whole matrix on one rank: `fitgpt.optim.whole`)."""
    tp = cfg.tensor_parallel
    if world % tp:
        return (f"--tensor-parallel {tp} over {world} rank{'s' if world > 1 else ''}: use a multiple of {tp} (torchrun "
                f"--nproc-per-node {tp}, or N x {tp} ranks with --parallel fsdp; plan's --world-size)")
    if world > tp and cfg.parallel != "fsdp":
        return (f"--tensor-parallel {tp} over {world} ranks makes {world // tp} data-parallel groups, which FSDP "
                f"shards: add --parallel fsdp (or use {tp} ranks)")
    if world == tp and cfg.parallel == "fsdp":
        return (f"--parallel fsdp with --tensor-parallel {tp} over {tp} ranks shards over one data-parallel rank, "
                f"which shards nothing: drop --parallel fsdp, or use N x {tp} ranks")
    if cfg.optim.offload or cfg.fsdp_offload:
        flag = "--optim.offload" if cfg.optim.offload else "--fsdp-offload"
        return (f"--tensor-parallel {tp} with {flag} is not built in fitgpt (neither is planned nor tested over a "
                f"split model): drop {flag}, or use --parallel fsdp --fsdp-offload without --tensor-parallel")
    spec = cfg.activation_checkpointing
    if "offload" in spec:
        return (f"--tensor-parallel {tp} does not offload a split block's saved tensors: drop offload from {spec!r} "
                "(block or selective recompute them instead)")
    return tensor_parallel_refusal(cfg.model, tp)


def training_mesh(device_type: str, world: int, tp: int) -> DeviceMesh:
    """The processes as a 2-D mesh, ("dp", "tp"): world / tp data-parallel shards (FSDP's) of tp ranks each, a
    tensor-parallel group being tp consecutive ranks (one node's, where a node has tp cards), as torchtitan lays it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if world > tp and hasattr(mesh, "_flatten"):
        # Both dimensions as one too: a reduction over every rank (the gradients' norm for clipping) is then one
        # all-reduce, not one per dimension (DTensor warns of the two at the first step, on every rank).
        mesh._flatten("dp_tp")
    return mesh


class _LossParallelHead(ColwiseParallel):
    """The head column-wise (its weight sharded on the vocabulary), taking the final norm's output gathered whole and
    giving logits sharded on the vocabulary, kept as a DTensor for ``loss_parallel``. fitgpt's head also takes the
    targets and returns (logits, loss): both pass through (the loss is made local on the model's output)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs[:1], device_mesh)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if isinstance(outputs, tuple):  # (logits, loss)
            return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs[0], device_mesh), outputs[1]
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def _local_loss(model: nn.Module, inputs: tuple, outputs: tuple) -> tuple:
    """The model's (logits, loss), the loss made local: ``loss_parallel``'s is whole on every rank. A forward hook on
    the model, not the head's, so that it holds whichever head a policy puts in place (the loss heads replace the
    head's forward with their chunks, and with it the head's own hooks)."""
    logits, loss = outputs
    # to_local() is a view, which FSDP warns of at every step (an in-place op on it would lose its hooks): a copy of
    # the scalar instead.
    return logits, loss.to_local().clone() if isinstance(loss, DTensor) else loss


class _EmbeddingRowwise(RowwiseParallel):
    """The token embedding row-wise (the vocabulary sharded), its partial sums reduce-scattered into sequence shards
    synchronously. PyTorch's style issues the reduce-scatter asynchronously; its result, waited on where a compiled
    block (--compile) takes it as input, reaches the redistribute's backward as a plain gradient, not a DTensor, and
    the backward fails (PyTorch 2.13). Nothing overlaps it in any case: the next op (the positions' add, the first
    norm) waits for it at once."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(1))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = outputs.redistribute(placements=output_layouts, async_op=False)  # (B, T / tp, C) a rank
        return outputs.to_local() if use_local_output else outputs


class _FusedColwise(ColwiseParallel):
    """GPT-2's one (3C, C) query/key/value matrix column-wise by heads: each rank holds the rows of its heads' query,
    key and value (q_r, k_r, v_r: PyTorch's ``_StridedShard(0, split_factor=3)``), and its output is those heads'
    [q_r, k_r, v_r], which the attention splits in thirds as it splits the whole one."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for n, param in module.named_parameters():
            split = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=3)], src_data_rank=self.src_data_rank)
            module.register_parameter(n, nn.Parameter(split, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()  # (B, T, 3C / tp): this rank's [q_r, k_r, v_r], as the matmul gives them


def _block_plan(arch: str) -> dict:
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if arch == "llama":
        attn = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=Shard(1))}
        mlp = {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
               "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}
    else:  # GPT-2's
        attn = {"attn.qkv": _FusedColwise(), "attn.proj": RowwiseParallel(output_layouts=Shard(1))}
        mlp = {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}
    return {
        "ln1": SequenceParallel(),
        # The attention's inputs: the normed activation, all-gathered, and the key/value cache (None in training).
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        **attn,
        "ln2": SequenceParallel(),
        "mlp": gathered,
        **mlp,
    }


def _split_positions(model: nn.Module, mesh: DeviceMesh) -> None:
    """GPT-2's learned positions added to the token embedding's sequence shards: the table replicated, each rank
    taking the rows of its own positions (its gradient the all-gather of every rank's rows)."""
    distribute_module(model.position_embed, mesh)  # the table replicated
    parallelize_module(model.position_embed, mesh, PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False))
    parallelize_module(model.position_embed, mesh, PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(0)))  # (T / tp, C) a rank


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split ``model`` (fitgpt's ``Transformer``, whole on every rank, the same weights) over ``mesh``'s ranks
    in place: each rank keeps its shards. Before activation checkpointing, compile and FSDP."""
    if why := tensor_parallel_refusal(model.config, mesh.size()):
        raise ValueError(why)
    tied = model.lm_head.weight is model.token_embed.weight
    for block in model.attn_blocks:
        parallelize_module(block, mesh, _block_plan(model.config.arch))
    if model.position_embed is not None:
        _split_positions(model, mesh)
    parallelize_module(model, mesh, {
        "token_embed": _EmbeddingRowwise(),
        "layer_norm": SequenceParallel(),
        "lm_head": _LossParallelHead(),
    })
    if tied:
        # The embedding (row-wise) and the head (column-wise) both shard the (vocab, C) matrix on the vocabulary, as
        # Megatron ties them: one split parameter, each rank the rows of its tokens, both gradients adding into it.
        model.lm_head.weight = model.token_embed.weight
    # The final norm's output gathered whole (the head's all-gather), on the norm rather than in the head: the loss
    # heads' chunks (chunked-loss, fused-loss) then take it as the plain head does.
    parallelize_module(model.layer_norm, mesh, PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False))
    model.register_forward_hook(_local_loss)


def seed_dropout_apart(device: torch.device, seed: int, tp_rank: int) -> None:
    """Once the weights are drawn (alike on every rank, from ``seed``), the generator each rank draws its dropout
    masks from. DTensor's RNG tracker (one seed, each shard its own offset) covers CUDA-like devices only; on CPU ranks
    each rank draws from its own generator, and seeded alike, the ranks of a group drew the same mask for every
    sequence shard. Every dropout of the split model falls on a shard (of the sequence, or a rank's heads), so the
    ranks are seeded apart: no rank's mask has to match another's."""
    if device.type == "cpu":
        torch.manual_seed((seed * 1_000_003 + 1 + tp_rank) % 2**63)


def step_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """What a step of ``model`` runs in: ``loss_parallel`` where its head gives vocabulary-sharded logits (the loss's
    forward and backward both need it), else nothing."""
    head = getattr(model, "lm_head", None)
    split = head is not None and any(isinstance(p, DTensor) for p in head.parameters())  # a loss head's too
    return loss_parallel() if split else contextlib.nullcontext()

