"""8-bit and 4-bit AdamW: torchao's (``torchao.optim.AdamW8bit``/``AdamW4bit``), moments quantized block-wise
(8-bit: 2 bytes a parameter for both moments, plus a 4-byte scale per 256 values; 4-bit: 1 byte, a scale per 128).
Tensors under 4096 values keep fp32 moments, as torchao (and bitsandbytes) do.

Where it steps: on CUDA, torchao's step compiled per parameter shape, as torchao ships it; on the CPU (and on the
planner's fake tensors) the same function eagerly, as written: no C++ toolchain or compile time needed, and the
temporaries it makes are the ones a profile measures. MPS is not supported (refused).

Checkpoints hold the moments dequantized to plain fp32 tensors on the host, a tensor at a time, so that a checkpoint
resumes under any optimizer setting and loads with ``weights_only=True``; beside them, under ``EXACT``, each quantized
moment as it is (its uint8 codes and fp32 block scales), which the same optimizer loads back bit for bit: quantizing
the fp32 copy again would choose other scales, and a resumed run would drift from the uninterrupted one (by 1e-3 after
12 steps). Any other optimizer ignores that entry and quantizes (or takes) the fp32 moments, a tensor at a time,
never holding every fp32 moment on the device at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fitgpt.errors import UserError
from fitgpt.utils import import_torchao

MOMENTS = ("exp_avg", "exp_avg_sq")
EXACT = "lowbit_exact"
"""The optimizer state dict's entry holding each quantized moment's codes and scales: {index: {moment: {"codes": t,
"scale": t}}} (tensors in dicts, which a distributed checkpoint stores as tensors; older checkpoints hold a tuple)."""


def low_bit_adamw(name: str, groups: list[dict], lr: float, betas: tuple[float, float],
                  device: torch.device) -> torch.optim.Optimizer:
    """torchao's AdamW8bit or AdamW4bit (``name``: adamw8bit, adamw4bit) over ``groups``, stepping on ``device``."""
    if device.type not in ("cuda", "cpu"):
        raise UserError(f"--optim.name {name} runs on CUDA and the CPU (torchao), not {device.type}: use --optim.name "
                        "adamw (with --optim.state-dtype bf16 for 2-byte moments)")
    try:
        import_torchao("torchao.optim")
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError:
        raise UserError(f"--optim.name {name} needs torchao: pip install 'fitgpt[lowbit]'") from None
    from torchao.optim import subclass_4bit, subclass_8bit

    # The quantization maps are built once, with .tolist(), and cached: build them on real tensors even when the
    # optimizer is made under the planner's fake tensors (which hold no values to list).
    with unset_fake_temporarily():
        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed(), module.get_qmap_unsigned()
    base = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[name]
    return type(base.__name__, (_Portable, base), {})(groups, lr=lr, betas=betas)


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """torchao's step calls ``torch.compile(single_param_adam, fullgraph=True)``: make that the function itself."""
    compile_ = torch.compile
    torch.compile = lambda fn, **_: fn
    try:
        yield
    finally:
        torch.compile = compile_


class _Portable:
    """Mixed into a torchao optimizer: eager off CUDA, and checkpoints in plain fp32 tensors."""

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        compiled = all(p.device.type == "cuda" and not isinstance(p, FakeTensor) for p in params)
        with contextlib.nullcontext() if compiled else _eager():
            return super().step(closure)

    def create_state(self) -> None:
        """Each parameter's state as its first step makes it (the planner's: a step on the fake tensors of a large
        model costs seconds, and no byte the step holds depends on it having run)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        exact: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for i, state in sd["state"].items():
            state = sd["state"][i] = dict(state)  # PyTorch's dict is the live state's: copied, not changed
            for k in MOMENTS:
                if hasattr(state.get(k), "codes"):  # quantized (a moment under 4096 values is a plain tensor)
                    exact.setdefault(i, {})[k] = {"codes": state[k].codes.cpu(), "scale": state[k].scale.cpu()}
                    state[k] = state[k].dequantize().cpu()  # plain fp32, one tensor at a time
        for g in sd["param_groups"]:
            g["lr"] = float(g["lr"])
        return {**sd, EXACT: exact}

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        exact = state_dict.get(EXACT) or {}
        state = {}
        for i, s in state_dict["state"].items():
            p = params[int(i)]
            s = dict(s)
            for k in MOMENTS:
                if k in s:
                    buf = self._new_buffer(p, signed=k == "exp_avg")
                    s[k] = _restore(buf, s[k], exact.get(i, {}).get(k))
            state[i] = s
        super().load_state_dict({key: v for key, v in state_dict.items() if key != EXACT} | {"state": state})
        for g in self.param_groups:  # PyTorch loads the saved lr as the float it was saved as
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32)


def _restore(buf: torch.Tensor, fp32: torch.Tensor, exact: dict | tuple | None) -> torch.Tensor:
    """``buf`` (a quantized moment, or a plain one under 4096 values) holding the saved moment: its own codes and
    scales where they were saved for a buffer of this kind and size, else ``fp32`` quantized again."""
    if exact is not None and hasattr(buf, "codes"):
        codes, scale = (exact["codes"], exact["scale"]) if isinstance(exact, dict) else exact
        if codes.shape == buf.codes.shape and scale.shape == buf.scale.shape:
            buf.codes.copy_(codes)
            buf.scale.copy_(scale)
            return buf
    return buf.copy_(fp32.to(device=buf.device, dtype=torch.float32))
