"""Profile a model once per option: per-block bytes and FLOPs the planner composes into any plan.

Four profiled steps cover every plan: all blocks ``none`` with the plain head, all blocks ``block``
with the chunked loss (the plain head for a model whose head is not fitgpt's), all blocks ``selective``,
all blocks ``pointwise``; torchtitan's rule is a fifth where a policy names it. A block's segments do not
depend on what the other blocks do (a block's output is held by its successor whatever the option),
so block i under option o is read from the run where every block had option o. The one exception, the
inputs every block reads (a Hugging Face model's mask), is measured apart (``StepProfile.shared_inputs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.activation_checkpoint.apply import find_blocks
from fitgpt.activation_checkpoint.policy import parse_policy
from fitgpt.config import OptimConfig
from fitgpt.device import autocast
from fitgpt.estimate.card import offload_option, with_cuda_attention
from fitgpt.estimate.cuda_autocast import cuda_autocast_rules
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.heaviest import heaviest, on_each_rank
from fitgpt.estimate.optimizer import create_state, grads_at_once, host_step_time, optimizer_costs, running_loss, second_pass
from fitgpt.estimate.options import BlockOption, HeadOption
from fitgpt.estimate.ranks import fake_meshes
from fitgpt.estimate.source import ModelSource, as_source
from fitgpt.estimate.subject import BLOCK_OPTIONS, Subject, fake_model, sharded
from fitgpt.memory.fake import fake_mode
from fitgpt.memory.flops import OpCost
from fitgpt.memory.timeline import (
    StepTimeline,
    grad_bytes,
    optimizer_state_bytes,
    param_bytes,
    profile_step,
)
from fitgpt.model import ModelConfig
from fitgpt.optim import build_optimizer
from fitgpt.parallel.fsdp import precision_roles
from fitgpt.parallel.tensor import step_context
from fitgpt.utils import Forked

log = logging.getLogger(__name__)

EXTRA_OPTIONS = ("torchtitan",)
"""Profiled when asked for (a policy that names one): torchtitan's rule, for comparing like with like."""


def named_options(*policies: str) -> tuple[str, ...]:
    """The EXTRA_OPTIONS the policies name, for ``profile_model(extra_options=...)`` (auto and auto:... name none)."""
    named = {o for spec in policies if not spec.startswith("auto") for o in parse_policy(spec).recompute_options}
    return tuple(o for o in EXTRA_OPTIONS if o in named)
HEAD_OPTIONS = ("plain", "chunked", "fused")
# One profiled step per option; the head option of each run is read from the same run.
_RUNS = {"none": ("none", "plain"), "block": ("block+chunked-loss", "chunked"), "selective": ("selective+fused-loss", "fused"),
         "pointwise": ("pointwise", None), "torchtitan": ("torchtitan", None)}
# A model whose head cannot chunk its loss (one that is not fitgpt's) has the plain head alone.
_PLAIN_RUNS = {**_RUNS, "block": ("block", None), "selective": ("selective", None)}


@dataclass
class StepProfile:
    """Everything the planner needs, in bytes and FLOPs, for one config, batch shape and device."""

    batch_size: int
    context: int
    grad_accum: int
    persistent_grads: bool
    """Gradients stay allocated across steps (accumulation, or DDP's gradient buckets)."""
    device: str
    params: int
    optimizer: int
    grads: int
    baseline: int
    """Held before each micro-batch: params + optimizer state (+ gradients when accumulating)."""
    embed_saved: int
    embed_fwd_rise: int
    embed_bwd_rise: int
    embed_bwd_delta: int
    optimizer_rise: int
    blocks: list[dict[str, BlockOption]]
    block_grads: list[int]
    """Bytes each block's backward leaves behind once its saved bytes are freed: its new gradients."""
    heads: dict[str, HeadOption]
    block_flops: list[int]
    """FLOPs of each block's forward + backward without checkpointing."""
    block_param_bytes: int
    step_flops: int
    """FLOPs of one forward + backward without checkpointing."""
    seconds: float = 0.0
    """How long profiling took."""
    embed_time: float = 0.0
    """Seconds of the embedding's forward and backward, per micro-batch (with a cost model; 0 without)."""
    optimizer_time: float = 0.0
    """Seconds of the optimizer step (clipping included), once per step."""
    time_source: str = ""
    """Where the seconds come from: measured on a device, or a roofline estimate ("" for none)."""
    fsdp_ranks: int = 1
    """Ranks the step is one of under FSDP (1: not sharded)."""
    passes: int = 1
    """Forward and backward passes a micro-batch runs: 2 when the optimizer steps in the backward and clips (the
    first finds the global norm); the peak is the second's."""
    host: int = 0
    """Host memory the optimizer holds (--optim.offload: the weights' copies, their gradients and the state)."""
    shared_inputs: int = 0
    """Bytes made before the first block and read by every block (a Hugging Face model's attention mask and position
    ids; none in fitgpt's): freed as the head's forward begins (the model body returns), unless a block recomputes,
    whose checkpoint holds them as its inputs until its backward ends. The heads' bytes are as if they were freed."""

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def with_blocks(self, n: int, ends: int = 1) -> StepProfile:
        """The same profile for a model of ``n`` blocks (fixed costs scaled to match): blocks added before the last
        ``ends`` are like the one before those (a middle block), and the last ``ends`` keep their own profiles. Under
        FSDP the two blocks at each end differ from the middle ones: what a gather leaves is freed two blocks on."""
        extra, k = n - self.n_blocks, self.n_blocks
        middle = k - ends - 1 if k > ends else 0
        like = list(range(k - ends)) + [middle] * extra + list(range(k - ends, k)) if k > ends else [0] * n
        p = self.block_param_bytes
        opt = int(p * self.optimizer / max(self.params, 1))  # AdamW: two moments per parameter
        return dataclasses.replace(
            self,
            params=self.params + extra * p,
            optimizer=self.optimizer + extra * opt,
            grads=self.grads + extra * p,
            baseline=self.baseline + extra * (p + opt + (p if self.persistent_grads else 0)),
            blocks=[self.blocks[i] for i in like],
            block_grads=[self.block_grads[i] for i in like],
            block_flops=[self.block_flops[i] for i in like],
            # Each block added runs a middle block's FLOPs; the embedding and head run theirs once whatever the depth.
            step_flops=self.step_flops + extra * self.block_flops[middle],
        )


def _block_option(tl: StepTimeline, base: StepTimeline, i: int, machinery: float) -> BlockOption:
    f, b, t = tl.fwd_blocks[i], tl.bwd_blocks[i], tl.fwd_transient[i]
    # Recomputing never makes a block faster: a cost model that says so is within its own error.
    time = max(f.seconds + b.seconds, base.fwd_blocks[i].seconds + base.bwd_blocks[i].seconds) + machinery
    return BlockOption(saved=f.delta - t, fwd_rise=f.rise, bwd_rise=b.rise, recompute_flops=b.flops - base.bwd_blocks[i].flops,
                       transient=t, time=time)


def _head_option(tl: StepTimeline, base: StepTimeline, held: int = 0) -> HeadOption:
    """``held``: the shared inputs ``tl``'s recomputing blocks kept past the forward (``StepProfile.shared_inputs``),
    taken out: a head's bytes are as if they were freed as its forward begins (a model body returning)."""
    extra = tl.fwd_head.flops + tl.bwd_head.flops - base.fwd_head.flops - base.bwd_head.flops
    time = max(tl.fwd_head.seconds + tl.bwd_head.seconds, base.fwd_head.seconds + base.bwd_head.seconds)
    # The head's own bytes: the blocks' transients, freed as the forward ends, are theirs.
    return HeadOption(saved=tl.fwd_head.delta + sum(tl.fwd_transient) - held, fwd_rise=tl.fwd_head.rise - held,
                      bwd_rise=tl.bwd_head.rise,
                      bwd_delta=tl.bwd_head.delta, recompute_flops=extra, time=time)


def profile_model(model: ModelConfig | ModelSource, batch_size: int, context: int | None = None, device: str | torch.device = "cpu",
                  optim_cfg=None, grad_accum: int = 1, dtype: torch.dtype | None = None, seed: int = 0,
                  persistent_grads: bool = False, fake: bool = False, target: Target | None = None,
                  cost: OpCost | None = None, fsdp_ranks: int = 1, extra_options: tuple[str, ...] = (),
                  tp_ranks: int = 1, reshard_after_forward: bool = True) -> StepProfile:
    """Profile one training step per option (four, and one per extra option) of ``model`` on ``device``: fitgpt's own of a config,
    or any model a `fitgpt.estimate.source` builds (a Hugging Face config's, a module's).

    ``fake``: on fake tensors (shapes, no storage, no arithmetic), so that any size plans in seconds
    with no memory; the same numbers as real tensors (tested byte for byte on CPU).
    ``target``: a CUDA target planned on fake CPU tensors, with what differs on CUDA modelled (see
    ``fitgpt.estimate.hardware``); by default the device itself.
    ``cost``: a model of each op's seconds (``fitgpt.estimate.timing``), giving every segment its time.
    ``fsdp_ranks``: above 1, the step of one rank of that many under FSDP2, sharded as the trainer shards
    (``fitgpt.parallel``) on a fake process group in this process: every gather, reduce-scatter and shard
    is the real one's, in its dtype (tested equal to each rank's measured peak under torchrun).
    ``extra_options``: options of EXTRA_OPTIONS to profile besides BLOCK_OPTIONS (one more step each).
    ``tp_ranks``: above 1, the step of one rank of that many under tensor and sequence parallelism, split as the
    trainer splits (``fitgpt.parallel.tensor``) on a fake process group; with ``fsdp_ranks`` too, one rank of the
    trainer's 2-D mesh (fsdp_ranks x tp_ranks), each split sharded by FSDP over the data-parallel ranks. Rank 0's
    step, or where a whole-matrix optimizer steps in the backward, every rank's that owns a matrix, as one profile
    whose every plan peaks where the heaviest rank does (``fitgpt.estimate.heaviest``). ``reshard_after_forward``
    False: FSDP keeps each block's gathered weights from its forward to its backward (--fsdp-reshard-after-forward).
    """
    source = as_source(model)
    return heaviest(on_each_rank(source, optim_cfg or OptimConfig(), fsdp_ranks * tp_ranks, tp_ranks, lambda dp, tp: _profile_model(
        source, batch_size, context, device, optim_cfg, grad_accum, dtype, seed, persistent_grads, fake, target, cost, dp,
        extra_options, tp, reshard_after_forward)))


def _profile_model(source, batch_size, context, device, optim_cfg, grad_accum, dtype, seed, persistent_grads, fake,
                   target, cost, mesh, extra_options, tp_mesh=None, reshard: bool = True) -> StepProfile:
    t0 = time.perf_counter()
    device = torch.device(device)
    target = target or Target(device.type)
    if target.cuda and device.type != "cuda" and not fake:
        raise ValueError("a CUDA target is planned on fake tensors or measured on a CUDA device")
    context = context or source.context_length
    if context > source.context_length:
        source = source.at(context=context)
    run = Subject(source, batch_size, context, device, optim_cfg or OptimConfig(), grad_accum, dtype, persistent_grads, target,
              cost=cost, mesh=mesh, tp_mesh=tp_mesh, reshard=reshard,
              options=BLOCK_OPTIONS + tuple(o for o in EXTRA_OPTIONS if o in extra_options))
    torch.manual_seed(seed)
    if not fake:
        return _profile(sharded(source.build().to(device), run), run, seed, t0)
    if source.n_blocks >= DEEP and source.resizable:
        return _deepen(run, t0)
    return _fake_profile(run, t0)


SHALLOW, DEEP = 3, 8
"""A fake profile of a model of DEEP blocks or more is taken at SHALLOW + 1 blocks and deepened (exact: middle
blocks are alike); below that, profiling every block is as quick."""


def _fake_profile(run: Subject, t0: float) -> StepProfile:
    model, mode = fake_model(run.source, run.device)
    with mode:
        return _profile(sharded(model, run), run, None, t0)


def _deepen(run: Subject, t0: float) -> StepProfile:
    """The profile of ``run``'s depth from a fake profile at SHALLOW + 1 blocks (SHALLOW + 3 under FSDP), its
    middle blocks repeated (``StepProfile.with_blocks``), with the fixed costs (weights, gradients, optimizer
    state and step) measured on the full-depth model. Tested equal, byte for byte and FLOP for FLOP, to
    profiling every block."""
    n = run.source.n_blocks
    # Under FSDP a block's gather is let go two blocks on: two blocks at each end differ from a middle one.
    shallow, ends = (SHALLOW + 2, 2) if run.mesh is not None else (SHALLOW, 1)
    k = shallow + 1
    # The two are independent, so the shallow profile runs meanwhile in a forked copy of this process. The fixed costs
    # stay here: they leave the optimizer's DTensor sharding rules cached for the replays that follow (2-3 s at 8B).
    fake_mode()  # a first fake mode imports torch._dynamo (about 2 s): once, before the fork, not in both copies
    with Forked(_fake_profile, dataclasses.replace(run, source=run.source.at(n_blocks=k), optimizer_step=False), t0) as shallow:
        costs = _fixed_costs(run)
        b = shallow.result()
    deep = b.with_blocks(n, ends)
    # The shallow profile took no step after the backward (a step inside it is in its blocks' FLOPs already).
    flops = costs.pop("optimizer_flops")
    return dataclasses.replace(deep, **costs, step_flops=deep.step_flops + flops, seconds=time.perf_counter() - t0)


def fixed_costs(model: ModelConfig | ModelSource, device: str | torch.device = "cpu", optim_cfg=None, grad_accum: int = 1,
                dtype: torch.dtype | None = None, persistent_grads: bool = False, target: Target | None = None,
                fsdp_ranks: int = 1, tp_ranks: int = 1, reshard_after_forward: bool = True) -> dict[str, int | float]:
    """What no plan, micro-batch or context changes, without profiling a step: the parameters, gradients and optimizer
    state (``params``, ``grads``, ``optimizer``, as `StepProfile` counts them) and the optimizer step, on fake tensors,
    per rank as ``profile_model`` takes the ranks. A check against a budget in a fraction of a profile's time."""
    source, device = as_source(model), torch.device(device)
    target = target or Target(device.type)
    with fake_meshes(fsdp_ranks * tp_ranks, tp_ranks) as (dp_mesh, tp_mesh):
        run = Subject(source, 1, source.context_length, device, optim_cfg or OptimConfig(), grad_accum, dtype,
                      persistent_grads, target, mesh=dp_mesh, tp_mesh=tp_mesh, reshard=reshard_after_forward)
        return _fixed_costs(run)


def _fixed_costs(run: Subject) -> dict[str, int | float]:
    """The full model's parameters, gradients, optimizer state and optimizer step, on fake tensors (sharded as run)."""
    model, mode = fake_model(run.source, run.device)
    with mode:
        return optimizer_costs(sharded(model, run), run.optim, run.target, run.grad_accum, run.persistent_grads, run.cost)


def _profile(model: torch.nn.Module, run: Subject, seed: int | None, t0: float) -> StepProfile:
    device, round_to = run.device, run.target.round_to
    batch_size, context, grad_accum = run.batch_size, run.context, run.grad_accum
    model.train()
    # The optimizer as it is built on the target (fused AdamW on CUDA unless optim.impl says otherwise).
    # An optimizer that steps inside the backward is part of the blocks' segments: shallow profiles run it too.
    stepping = run.optimizer_step or run.optim.in_backward
    optimizer = build_optimizer(model, run.optim, torch.device(run.target.device)) if stepping else None
    if optimizer is not None:
        create_state(optimizer)
    # (B, T + 1) token ids; their values matter to no byte count, so fake runs take zeros.
    if seed is None:
        idx = torch.zeros(batch_size, context + 1, dtype=torch.long, device=device)
    else:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, run.source.vocab_size, (batch_size, context + 1), generator=g).to(device)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    amp = autocast(device, precision_roles(run.dtype, run.mesh is not None)[0])
    # The math backend on CUDA is the math path: run it here as it will run there.
    math_sdpa = run.simulated and run.backend == "math"

    def loss_fn():
        with amp():
            return model(x, y)[1]

    accumulate = grad_accum > 1 or run.persistent_grads
    timelines: dict[str, StepTimeline] = {}
    runs = {o: r for o, r in (_RUNS if run.source.chunked_head else _PLAIN_RUNS).items() if o in run.options}
    # A CUDA step's tensors get CUDA autocast's dtypes, not the CPU's we run on.
    rules = cuda_autocast_rules() if run.simulated and run.dtype else contextlib.nullcontext()
    with rules, sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext(), step_context(model):
        if accumulate:  # gradients stay allocated between micro-batches: give them their tensors up front
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        # The first run (none) also creates the optimizer state, as any first step does: its forward and
        # backward segments are unaffected, and the optimizer's workspace is read from the second run. Its segment
        # is the same under every option, so later runs skip the step (they hold its state), unless it is taken
        # inside the backward.
        for k, (option, (spec, _)) in enumerate(runs.items()):
            apply_activation_checkpointing(model, spec)
            second_pass(optimizer, run.optim)
            timelines[option] = profile_step(model, x, y, optimizer, loss_fn=loss_fn, zero_grad=not accumulate,
                                             grad_clip=run.optim.grad_clip, round_to=round_to, cost=run.cost,
                                             step=k < 2 or run.optim.in_backward)
    base = timelines["none"]
    machinery = getattr(run.cost, "recompute_overhead", {})
    n = len(base.fwd_blocks)
    blocks = [{o: _block_option(timelines[o], base, i, machinery.get(o, 0.0)) for o in run.options} for i in range(n)]
    if run.simulated:
        blocks = [with_cuda_attention(b, run.target, run.dtype, s.attention) for b, s in zip(blocks, base.fwd_blocks)]
    if run.target.cuda and run.tp_mesh is None:  # a split block's saved tensors are not offloaded (the trainer refuses it)
        blocks = [{**b, "offload": offload_option(b["none"], out, run.target)} for b, out in zip(blocks, base.block_out)]
    # What a recomputing block holds past the forward (run "block") that keeping everything lets go (run "none").
    shared = max(0, base.inputs_freed_at_forward_end - timelines["block"].inputs_freed_at_forward_end)
    heads = {head: _head_option(timelines[o], base, shared if o != "none" else 0) for o, (_, head) in runs.items() if head}
    # What a block's backward leaves behind besides freeing its saved bytes: the same under every option.
    block_grads = [max(timelines[o].fwd_blocks[i].delta - timelines[o].fwd_transient[i] + timelines[o].bwd_blocks[i].delta
                       for o in run.options) for i in range(n)]
    params, opt_bytes = param_bytes(model, round_to), optimizer_state_bytes(optimizer, round_to)
    held_grads = grad_bytes(model, round_to) if accumulate else 0
    profile = StepProfile(
        batch_size=batch_size, context=context, grad_accum=grad_accum, persistent_grads=accumulate,
        device=run.target.device if run.simulated else str(device),
        params=params, optimizer=opt_bytes, grads=held_grads if accumulate else grads_at_once(model, run.optim, round_to),
        baseline=params + opt_bytes + held_grads + running_loss(grad_accum, round_to),
        embed_saved=base.fwd_embed.delta, embed_fwd_rise=base.fwd_embed.rise,
        embed_bwd_rise=base.bwd_embed.rise, embed_bwd_delta=base.bwd_embed.delta,
        optimizer_rise=timelines[list(runs)[1]].optimizer.rise,
        blocks=blocks, block_grads=block_grads, heads=heads,
        block_flops=[f.flops + b.flops for f, b in zip(base.fwd_blocks, base.bwd_blocks)],
        block_param_bytes=param_bytes(find_blocks(model)[1][-1], round_to),
        step_flops=base.flops, seconds=time.perf_counter() - t0,
        embed_time=base.fwd_embed.seconds + base.bwd_embed.seconds,
        optimizer_time=timelines[list(runs)[1]].optimizer.seconds + host_step_time(optimizer, run.cost),
        host=optimizer.host_bytes() if hasattr(optimizer, "host_bytes") else 0,
        time_source=getattr(run.cost, "source", ""), fsdp_ranks=run.mesh.size() if run.mesh is not None else 1,
        shared_inputs=shared, passes=2 if run.optim.clips_in_two_passes else 1,
    )
    log.debug("profiled %d blocks at batch %d x %d in %.1fs", n, batch_size, context, profile.seconds)
    return profile
