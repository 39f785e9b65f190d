"""One mechanism for every policy: wrap blocks (and the head) in modules, never replace ``forward``.

``apply_activation_checkpointing(model, policy)`` finds the model's list of blocks, then puts a
``ActivationCheckpointWrapper`` at each position of that list. The wrapper holds the block under the child
name ``inner`` and hides that name from ``state_dict``, so checkpoints load with or without
checkpointing. A group region of K blocks is one checkpoint call made by the wrapper at the group's
first position; the wrappers at the other K-1 positions pass its result on. In eval mode or under
``no_grad`` every wrapper simply calls its own block: generation and evaluation pay nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fitgpt.activation_checkpoint.policy import (
    RECOMPUTE_BLOCK,
    RECOMPUTE_NONE,
    RECOMPUTE_SELECTIVE,
    RECOMPUTE_TORCHTITAN,
    Policy,
    parse_policy,
)
from fitgpt.activation_checkpoint.selective import pointwise_context_fn, selective_context_fn, torchtitan_context_fn
from fitgpt.device import loss_logits

log = logging.getLogger(__name__)


INNER = "inner"
_STATE_ATTR = "_fitgpt_checkpointing"
_warned_offload_on_cpu = False


def _strip_inner(module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(prefix + INNER + ".")]:
        state_dict[prefix + key[len(prefix) + len(INNER) + 1 :]] = state_dict.pop(key)


def _add_inner(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + INNER + ".")]:
        state_dict[prefix + INNER + "." + key[len(prefix) :]] = state_dict.pop(key)


class _Wrapper(nn.Module):
    """Holds one module as ``inner`` while keeping the inner module's state_dict keys."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_state_dict_post_hook(_strip_inner)
        self.register_load_state_dict_pre_hook(_add_inner)

    def _recording(self) -> bool:
        return self.training and torch.is_grad_enabled()


def _offload_context(args: tuple) -> object:
    global _warned_offload_on_cpu
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if device.type == "cpu":
        if not _warned_offload_on_cpu:
            log.warning("offload does nothing on CPU: activations already live in host memory")
            _warned_offload_on_cpu = True
        return nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


class _GroupState:
    """What the first wrapper of a group hands to the other wrappers of the same group."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.output = None
        self.pending = 0


class ActivationCheckpointWrapper(_Wrapper):
    """One position of the block list under a checkpointing region.

    recompute: none (keep everything), block (the whole block again in backward), selective, pointwise or torchtitan
    (a save list chooses which ops run again). offload: send what autograd saves to host memory.
    group: shared with the other wrappers of a multi-block region; ``members`` are the blocks the
    first wrapper runs (its own and the followers'), held as plain references, not submodules.
    """

    def __init__(self, inner: nn.Module, recompute: str, offload: bool = False, group: _GroupState | None = None,
                 members: list[nn.Module] | None = None) -> None:
        super().__init__(inner)
        self.recompute = recompute
        self.offload = offload
        self._group = group
        self._members = members  # set only on a group's first wrapper
        # Whether recomputing this region reruns dropout (pointwise then keeps the matmul output dropout reads).
        self._dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for b in members or [inner] for m in b.modules())

    def extra_repr(self) -> str:
        role = "" if self._group is None else (f", group of {self._group.size}" if self._members else ", in group")
        return f"recompute={self.recompute}, offload={self.offload}{role}"

    def forward(self, *args, **kwargs):
        if not self._recording():
            return self.inner(*args, **kwargs)
        if self._group is not None and self._members is None:
            return self._follow()
        run = self._run_members if self._members else self.inner
        with _offload_context(args) if self.offload else nullcontext():
            if self.recompute == RECOMPUTE_NONE:
                out = run(*args, **kwargs)
            else:
                # torch.compile accepts a context_fn only if it yields dispatch modes: pass one for op-level options alone.
                extra = {"context_fn": self._context_fn(args)} if self.recompute != RECOMPUTE_BLOCK else {}
                out = checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
        if self._members:
            self._group.output, self._group.pending = out, self._group.size - 1
        return out

    def _context_fn(self, args: tuple):
        if self.recompute == RECOMPUTE_SELECTIVE:
            return selective_context_fn
        if self.recompute == RECOMPUTE_TORCHTITAN:
            return torchtitan_context_fn
        width = next(a.shape[-1] for a in args if isinstance(a, torch.Tensor))  # the residual stream's
        return functools.partial(pointwise_context_fn, width, self._dropout)

    def _run_members(self, *args, **kwargs):
        out = None
        for i, block in enumerate(self._members):
            if i == 0:
                out = block(*args, **kwargs)
            else:
                # Blocks of other libraries may return tuples whose first item is the hidden state.
                hidden = out[0] if isinstance(out, tuple) else out
                out = block(hidden, *args[1:], **kwargs)
        return out

    def _follow(self):
        group = self._group
        if group.pending <= 0:
            raise RuntimeError(
                "a block inside a checkpointed group was called out of order; the model must call its "
                "blocks in sequence, or use a per-block policy such as 'block' instead of group:K"
            )
        group.pending -= 1
        out = group.output
        if group.pending == 0:
            group.output = None  # drop the reference so the last block's output is not kept alive
        return out


class _LossHead(_Wrapper):
    """A head that computes its loss ``rows`` tokens at a time (the head's ``forward(x, targets)`` replaced)."""

    def __init__(self, inner: nn.Module, rows: int) -> None:
        super().__init__(inner)
        self.rows = rows

    def extra_repr(self) -> str:
        return f"rows={self.rows}"


class ChunkedLossHead(_LossHead):
    """Head + cross-entropy over chunks of ``rows`` tokens, each chunk its own checkpoint region.

    Only the head's input is kept for backward; a chunk's logits live only while that chunk is
    computed (forward) or recomputed (backward), so the B x T x vocab logits are never held whole.
    Returns ``(None, loss)``: the logits are not returned, since keeping them would defeat the point.
    """

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        if targets is None:
            return self.inner(x)
        x2 = x.reshape(-1, x.size(-1))  # (B*T, C)
        t2 = targets.reshape(-1)  # (B*T,)
        total = x2.new_zeros((), dtype=torch.float32)
        use_ckpt = self._recording()
        for s in range(0, x2.size(0), self.rows):
            xc, tc = x2[s : s + self.rows], t2[s : s + self.rows]
            if use_ckpt:
                part = checkpoint(self._chunk_loss_sum, xc, tc, use_reentrant=False)
            else:
                part = self._chunk_loss_sum(xc, tc)
            total = total + part
        return None, total / t2.numel()

    def _chunk_loss_sum(self, xc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        logits = F.linear(xc, self.inner.weight, self.inner.bias)  # (rows, vocab)
        return F.cross_entropy(loss_logits(logits), tc.long(), reduction="sum").float()


class FusedLossHead(_LossHead):
    """Head + cross-entropy whose gradients are computed in the forward, ``rows`` tokens at a time: what the backward
    needs is the gradient of the head's input and of its weight (and bias), not the B x T x vocab logits, and nothing
    is computed twice (none's FLOPs). Each chunk's logits and their gradient live only while that chunk runs.

    The same idea as Liger-Kernel's FusedLinearCrossEntropy, in PyTorch's own ops: each chunk is the plain head's
    forward and backward (``torch.autograd.grad``, under whatever autocast is on), so its gradients are the plain
    head's, up to the order in which the chunks' weight gradients are summed. Returns ``(None, loss)``.
    """

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        if targets is None:
            return self.inner(x)
        w, b = self.inner.weight, self.inner.bias
        if not self._recording():  # evaluation: the loss alone, chunk by chunk
            return None, _chunks(x, targets, w, b, self.rows, (False, False, False))[0] / targets.numel()
        return None, _FusedLinearCrossEntropy.apply(x, w, b, targets, self.rows)


def _chunks(x: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
            wants: tuple[bool, ...]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The summed cross-entropy of ``x @ weight.T + bias`` against ``targets``, ``rows`` tokens at a time, and the
    gradients of its mean with respect to (x, weight, bias) where ``wants`` says."""
    x2, t2 = x.reshape(-1, x.size(-1)), targets.reshape(-1).long()  # (N, C), (N,)
    n = t2.numel()
    wants = (wants[0], wants[1], wants[2] and bias is not None)
    grads = [torch.zeros_like(t) if w else None for t, w in zip((x2, weight, bias), wants)]
    total = x2.new_zeros((), dtype=torch.float32)
    for s in range(0, n, rows):
        with torch.enable_grad() if any(wants) else torch.no_grad():
            inputs = [t.detach().requires_grad_(w) if t is not None else None
                      for t, w in zip((x2[s : s + rows], weight, bias), wants)]
            logits = F.linear(*inputs)  # (rows, vocab)
            part = F.cross_entropy(loss_logits(logits), t2[s : s + rows], reduction="sum").float()
            del logits
            needed = [t for t, w in zip(inputs, wants) if w]
            # d(mean)/d(each token's loss), made like the loss (a DTensor where the head is split)
            chunk_grads = iter(torch.autograd.grad(part, needed, torch.full_like(part, 1.0 / n)) if needed else ())
        for i, w in enumerate(wants):
            if w and i == 0:
                grads[0][s : s + rows] = next(chunk_grads)
            elif w:
                grads[i] += next(chunk_grads)
        total += part.detach()
    return total, grads


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                rows: int) -> torch.Tensor:
        total, ctx.grads = _chunks(x, targets, weight, bias, rows, ctx.needs_input_grad[:3])
        ctx.x_shape = x.shape
        return total / targets.numel()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # Handed over, not copied (the weight's becomes its .grad as it is), scaled in place by the loss's gradient
        # (1/micro-batches under accumulation, the loss scale under fp16).
        (dx, dw, db), ctx.grads = ctx.grads, None
        dx, dw, db = (g.mul_(grad_loss) if g is not None else None for g in (dx, dw, db))
        return dx.view(ctx.x_shape) if dx is not None else None, dw, db, None, None


# ---- finding the blocks -------------------------------------------------------------------------

KNOWN_BLOCK_PATHS = ("attn_blocks", "transformer.h", "model.layers", "layers", "h")


def _get(model: nn.Module, path: str) -> nn.Module | None:
    obj: object = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def find_blocks(model: nn.Module, blocks: str | nn.ModuleList | None = None) -> tuple[str, nn.ModuleList]:
    """The model's block list and its dotted path: a given path, a known name, else the longest
    ``nn.ModuleList`` whose entries are all of one type."""
    if isinstance(blocks, nn.ModuleList):
        for name, mod in model.named_modules():
            if mod is blocks:
                return name, blocks
        raise ValueError("the ModuleList passed as blocks is not part of the model")
    if blocks is not None:
        found = _get(model, blocks)
        if not isinstance(found, nn.ModuleList):
            raise ValueError(f"blocks={blocks!r} does not name an nn.ModuleList in {type(model).__name__}")
        return blocks, found
    for path in KNOWN_BLOCK_PATHS:
        found = _get(model, path)
        if isinstance(found, nn.ModuleList) and len(found) > 0:
            return path, found
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            types = {type(m.inner if isinstance(m, _Wrapper) else m) for m in mod}
            if len(types) == 1 and (best is None or len(mod) > len(best[1])):
                best = (name, mod)
    if best is None:
        raise ValueError(
            f"no list of blocks found in {type(model).__name__}: pass blocks='path.to.modulelist'"
        )
    return best


# ---- apply and remove ---------------------------------------------------------------------------


def _takes_targets(head: object) -> bool:
    """A head whose forward is ``forward(x, targets=None)``: logits alone, or (logits, loss) given targets."""
    if not isinstance(head, nn.Module):
        return False
    try:
        params = inspect.signature(head.forward).parameters
    except (TypeError, ValueError):
        return False
    return "targets" in params


def apply_activation_checkpointing(model: nn.Module, policy: str | Policy, blocks: str | nn.ModuleList | None = None) -> Policy:
    """Apply ``policy`` to ``model`` in place and return the parsed policy.

    Works on fitgpt's Transformer and on models we did not write (GPT-2 style ``transformer.h``,
    or any model with a ModuleList of identical blocks). Re-applying replaces the earlier policy.
    """
    policy = parse_policy(policy)
    # Everything that can refuse runs before the earlier policy is removed: a refused call leaves the model as it was.
    path, block_list = find_blocks(model, blocks)
    regions = policy.regions(len(block_list))  # validates the policy against this depth
    head = getattr(model, "lm_head", None)
    head = head.inner if isinstance(head, _LossHead) else head  # as it is once the earlier policy is removed
    if policy.loss_chunk_rows or policy.loss_fused_rows:
        term = "chunked-loss" if policy.loss_chunk_rows else "fused-loss"
        if not _takes_targets(head):
            raise ValueError(
                f"{term} needs a head that computes logits and loss in one call (model.lm_head with "
                f"forward(x, targets)); {type(model).__name__} has {type(head).__name__}. Drop '+{term}'."
            )
    if getattr(model, _STATE_ATTR, None) is not None:
        remove_activation_checkpointing(model)  # the same ModuleList, its entries unwrapped in place
    head_path = None
    if policy.loss_chunk_rows or policy.loss_fused_rows:
        model.lm_head = (ChunkedLossHead(head, policy.loss_chunk_rows) if policy.loss_chunk_rows
                         else FusedLossHead(head, policy.loss_fused_rows))
        head_path = "lm_head"
    for region in regions:
        if region.recompute == RECOMPUTE_NONE and not region.offload:
            continue
        members = [block_list[i] for i in range(region.start, region.stop)]
        if len(members) == 1:
            block_list[region.start] = ActivationCheckpointWrapper(members[0], region.recompute, region.offload)
            continue
        group = _GroupState(len(members))
        block_list[region.start] = ActivationCheckpointWrapper(members[0], region.recompute, region.offload, group, members)
        for i in range(region.start + 1, region.stop):
            block_list[i] = ActivationCheckpointWrapper(block_list[i], region.recompute, region.offload, group)
    recomputes = any(r.recompute != RECOMPUTE_NONE for r in regions) or bool(policy.loss_chunk_rows)
    setattr(model, _STATE_ATTR, (policy, path, head_path, _turn_off_cache(model) if recomputes else None))
    log.debug("checkpointing %s", policy.describe(len(block_list)))
    return policy


def _turn_off_cache(model: nn.Module) -> bool | None:
    """A model that keeps a key/value cache while training (Hugging Face's ``config.use_cache``, on by default) returns
    cache tensors from each block: a recomputed block then writes them again during backward, which op-level
    recompute refuses mid-backward. As Hugging Face's own ``gradient_checkpointing_enable`` does, the cache goes off
    (and back on when checkpointing is removed); returns the setting it had."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return None
    config.use_cache = False
    log.info("activation checkpointing: %s.config.use_cache set to False while it is applied (a training step keeps "
             "no key/value cache)", type(model).__name__)
    return True


def remove_activation_checkpointing(model: nn.Module) -> None:
    """Undo ``apply_activation_checkpointing``: the original modules go back to their places."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    _, path, head_path, cache = state
    if cache is not None:
        model.config.use_cache = cache
    block_list = _get(model, path)
    for i, mod in enumerate(block_list):
        if isinstance(mod, ActivationCheckpointWrapper):
            block_list[i] = mod.inner
    if head_path is not None and isinstance(getattr(model, head_path), _LossHead):
        setattr(model, head_path, getattr(model, head_path).inner)
    setattr(model, _STATE_ATTR, None)


def applied_policy(model: nn.Module) -> Policy:
    """The policy currently applied to ``model`` (``none`` if nothing is)."""
    state = getattr(model, _STATE_ATTR, None)
    return state[0] if state is not None else parse_policy("none")
