"""Float8 linears (``--float8``): torchao's ``Float8Linear`` in place of each linear layer's matmuls, as torchtitan
trains them. Inputs, weights and output gradients are cast to float8 with dynamic scales (one a tensor:
``tensorwise``; one a row: ``rowwise``), multiplied by ``torch._scaled_mm``, and what autograd saves is what torchao
saves. The head stays in the model's precision (torchtitan's ``filter_fqns = ["output"]``), and so does any linear
whose sides are not multiples of 16 (``_scaled_mm``'s rule). Under FSDP, tensorwise weights are all-gathered in float8
(torchtitan's ``enable_fsdp_float8_all_gather``): half the bytes of bf16 in flight and gathered.

One function for the trainer and the planner: a model is converted after it is built and before anything splits,
checkpoints or shards it (torchtitan's model converters run there). The parameters keep their names, shapes and
dtypes, so optimizers, checkpoints and exports see a plain model's weights: a float8 run's checkpoint loads into a
model without float8, and back.

Float8 matmuls need a CUDA card of compute capability 8.9 or more (Ada, Hopper, Blackwell); PyTorch runs
``_scaled_mm`` on the CPU too, slowly, which is how the tests here train it and check the planner against it."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from fitgpt.errors import UserError
from fitgpt.utils import import_torchao

HEAD_NAMES = ("lm_head", "output")
"""The vocabulary projection's name in fitgpt's and Hugging Face's models, and in torchtitan's (left in its precision)."""


def eligible(module: nn.Module, fqn: str) -> bool:
    """A linear layer float8 takes: a plain ``nn.Linear`` (not a head, which may be a subclass), not named as a head,
    both sides multiples of 16."""
    return (isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] not in HEAD_NAMES
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


MISSING = "--float8 needs torchao: pip install 'fitgpt[float8]'"


def missing() -> str | None:
    """Why --float8 cannot run here for want of torchao (one line); None: it is installed."""
    try:
        import_torchao("torchao.float8")
    except ImportError:
        return MISSING
    return None


def unconvertible(model: nn.Module) -> str | None:
    """Why --float8 would change nothing in ``model`` (one line); None: some linear converts."""
    if any(eligible(m, name) for name, m in model.named_modules()):
        return None
    return ("--float8: no linear layer of this model has both sides a multiple of 16; widen the model "
            "(--model.n-embed) or drop --float8")


def _torchao():
    if why := missing():
        raise UserError(why)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return Float8LinearConfig, convert_to_float8_training


def convert(model: nn.Module, recipe: str) -> nn.Module:
    """``model`` with its eligible linears made torchao's ``Float8Linear`` (in place; ``recipe`` "none": unchanged):
    tensorwise is torchao's default config, rowwise its recipe of that name. Returns it. Raises UserError when
    torchao is missing or no linear is eligible (float8 would change nothing)."""
    if recipe == "none":
        return model
    Float8LinearConfig, convert_to_float8_training = _torchao()
    if why := unconvertible(model):
        raise UserError(why)
    config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, module_filter_fn=eligible, config=config)


def gather_in_float8(model: nn.Module) -> nn.Module:
    """Each tensorwise float8 linear's weight made one FSDP2 all-gathers in float8 (torchao's
    ``WeightWithDynamicFloat8CastTensor``: what its ``enable_fsdp_float8_all_gather`` does at conversion). Done by
    `fitgpt.parallel.fsdp.fsdp_shard` as it shards, for the trainer and the planner alike, so that a model faked or
    filled after it was built keeps it. Rowwise scales are per row of the whole weight, which no shard holds:
    torchao gathers those weights in their own precision. In place; returns ``model``."""
    if "torchao.float8.float8_linear" not in sys.modules:  # nothing converted (and torchao left unimported)
        return model
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for m in model.modules():
        if not isinstance(m, Float8Linear) or isinstance(m.weight, WeightWithDynamicFloat8CastTensor):
            continue
        cast = m.config.cast_config_weight
        if cast.scaling_granularity is ScalingGranularity.TENSORWISE:
            wrapped = _wrapped(m.weight, WeightWithDynamicFloat8CastTensor, m.linear_mm_config, cast.target_dtype)
            m.weight = nn.Parameter(wrapped, requires_grad=m.weight.requires_grad)
    return model


def converted(model: nn.Module) -> int:
    """How many of ``model``'s linears are float8."""
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())


def _wrapped(weight: torch.Tensor, wrapper, *args) -> torch.Tensor:
    """``wrapper(weight, *args)``, or, split by tensor parallelism, of its local shard (the wrapper goes inside the
    DTensor, where FSDP2 finds it when it shards the split weight again: torchao wraps before TP splits)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return wrapper(weight, *args)
    return DTensor.from_local(wrapper(weight.to_local(), *args), weight.device_mesh, weight.placements, run_check=False,
                              shape=weight.shape, stride=weight.stride())


def device_refusal(device: torch.device) -> str | None:
    """Why ``device``'s matmuls cannot run float8 (one line naming the flag); None: they can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"--float8 runs on CUDA cards of compute capability 8.9 or more (and the CPU), not {device.type}: drop --float8"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 9):
        return None
    return (f"--float8 needs a card of compute capability 8.9 or more (Ada, Hopper, Blackwell); this "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}: drop --float8")
