"""What a plan is for: a device type, and for CUDA a card, with what differs from the CPU we profile on.

Plans for a CUDA card are made on fake CPU tensors (no GPU, no memory). What a CUDA step does
differently is modelled, and every modelled part is named here:

- the caching allocator hands out blocks in multiples of 512 bytes (``max_memory_allocated`` counts
  the blocks): every storage is rounded up when profiling for CUDA;
- AdamW is fused on CUDA unless ``optim.impl`` names another (``build_optimizer``): the profile runs that
  implementation's meta version;
- attention: the backend PyTorch picks on that card for this precision and head size, and what it
  saves for backward, from PyTorch's own meta kernels (flash: output, log-sum-exp per head and row,
  RNG state; memory-efficient: output, log-sum-exp padded to 32 rows, seed and offset; math: the
  attention matrix, profiled by running the math path itself);
- autocast casts by CUDA's rules, not the CPU's (``fitgpt.estimate.cuda_autocast``: CUDA keeps
  ``cross_entropy``'s log-softmax in half precision, runs ``softmax``, ``layer_norm`` and ``rms_norm``
  in fp32, ...), weight-cast cache included;
- cuBLAS workspaces (one per handle: the forward thread and autograd's device thread), held by the
  allocator; the CUDA context, outside it.

Card figures are the vendors' datasheets (dense peaks, no sparsity); memory is what ``nvidia-smi``
reports as the total.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitgpt.device import autocast_dtype
from fitgpt.errors import UserError
from fitgpt.memory.tracker import round_up

MiB, GiB = 2**20, 2**30
ALLOCATOR_BLOCK = 512
"""The CUDA caching allocator's rounding (kMinBlockSize)."""
CUDA_CONTEXT = 512 * MiB
"""Memory the CUDA context and kernels' modules take outside the allocator (typical, driver-dependent)."""


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int
    """Bytes, as nvidia-smi reports the total."""
    half_flops: float
    """Dense tensor-core peak FLOP/s in bf16 (fp16 where the card has no bf16), FP32 accumulate."""
    fp32_flops: float
    """Peak FP32 (non-tensor) FLOP/s."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    sm: tuple[int, int]
    """Compute capability."""
    source: str
    pcie: float = 32e9
    """Host link, bytes/s per direction (PCIe 4.0 x16 unless the datasheet says otherwise)."""
    nvlink: float = 0.0
    """GPU-to-GPU link, bytes/s per direction (0: none; peers talk over PCIe)."""

    @property
    def peer_link(self) -> float:
        return self.nvlink or self.pcie

    @property
    def bf16(self) -> bool:
        return self.sm >= (8, 0)

    @property
    def fp8(self) -> bool:
        """Float8 tensor cores (Ada, Hopper, Blackwell): dense float8 matmuls at twice the bf16 peak."""
        return self.sm >= (8, 9)

    @property
    def cublas_workspace(self) -> int:
        """PyTorch's default cuBLAS workspace per handle: 32 MiB on Hopper, else :4096:2:16:8 (8 MiB + 128 KiB)."""
        return 32 * MiB if self.sm[0] == 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


GPUS = {g.name: g for g in (
    GPU("h100-80gb", 81559 * MiB, 989.4e12, 66.9e12, 3.35e12, (9, 0), "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
        64e9, 450e9),
    GPU("h100-nvl", 95830 * MiB, 835e12, 60e12, 3.9e12, (9, 0), "NVIDIA H100 NVL datasheet (PCIe, NVLink bridge); memory "
        "as nvidia-smi reports it", 64e9, 300e9),
    GPU("h100-96gb", 97871 * MiB, 989.4e12, 66.9e12, 4.0e12, (9, 0), "H100 96GB HBM3 (the GH200's GPU, SXM): compute as "
        "the H100 SXM5 datasheet, 4 TB/s; memory as nvidia-smi reports it", 64e9, 450e9),
    GPU("h200", 143771 * MiB, 989.4e12, 66.9e12, 4.8e12, (9, 0), "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
        64e9, 450e9),
    GPU("a100-80gb", 81920 * MiB, 312e12, 19.5e12, 2.039e12, (8, 0), "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",
        32e9, 300e9),
    GPU("a100-40gb", 40960 * MiB, 312e12, 19.5e12, 1.555e12, (8, 0), "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)",
        32e9, 300e9),
    GPU("l4", 23034 * MiB, 121e12, 30.3e12, 300e9, (8, 9), "NVIDIA L4 Tensor Core GPU datasheet"),
    GPU("rtx-4090", 24564 * MiB, 165.2e12, 82.6e12, 1008e9, (8, 9), "NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090)"),
    GPU("rtx-3090", 24576 * MiB, 71e12, 35.6e12, 936e9, (8, 6), "NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090)",
        32e9, 56.25e9),
    GPU("t4", 15360 * MiB, 65e12, 8.1e12, 320e9, (7, 5), "NVIDIA T4 Tensor Core GPU datasheet (FP16 mixed precision)",
        16e9),
)}


def find_gpu(name: str) -> GPU:
    key = name.lower().replace("_", "-").replace(" ", "-")
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)} (--gpu): for a card not in the table, "
                        "the nearest one and its memory (--gpu-memory), or --memory-budget")
    return GPUS[key]


@dataclass(frozen=True)
class Target:
    """The device type a plan is for (``cpu`` or ``cuda``) and, for CUDA, the card if one was named."""

    device: str = "cpu"
    gpu: GPU | None = None
    expandable_segments: bool = False
    """CUDA's caching allocator with ``expandable_segments:True`` (PYTORCH_CUDA_ALLOC_CONF), as torchtitan runs it."""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def round_to(self) -> int:
        return ALLOCATOR_BLOCK if self.cuda else 1

    @property
    def sm(self) -> tuple[int, int]:
        return self.gpu.sm if self.gpu else (8, 0)  # an unnamed CUDA card: assume Ampere or newer

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        """As the trainer picks it on this target: auto is bf16 on CUDA (fp16 on cards without bf16), fp32 on CPU."""
        if precision == "auto" and self.cuda:  # the card is not here to ask whether it has bf16: its table row says
            return torch.bfloat16 if self.sm >= (8, 0) else torch.float16
        if precision == "bf16" and self.cuda and self.sm < (8, 0):
            card = f"the {self.gpu.name}" if self.gpu else "this card"
            raise UserError(f"--precision bf16: {card} (sm {self.sm[0]}.{self.sm[1]}) has no bf16 (it needs sm 8.0 or newer); "
                             "use --precision fp16 (or auto) or fp32")
        return autocast_dtype(precision, torch.device(self.device))

    def attention_backend(self, dtype: torch.dtype | None, head_dim: int | None) -> str:
        """The SDPA backend PyTorch picks on this card (causal, no mask): flash, efficient or math; cpu on CPU.
        ``head_dim`` None: not known (a module's), taken as a size both flash and efficient kernels take."""
        if not self.cuda:
            return "cpu-flash"
        head_dim = 64 if head_dim is None else head_dim
        half = dtype in (torch.float16, torch.bfloat16)
        if half and self.sm >= (8, 0) and head_dim <= 256:  # other head sizes are padded to a multiple of 8
            return "flash"
        if self.sm >= (5, 0) and head_dim % (8 if half else 4) == 0 and (dtype != torch.bfloat16 or self.sm >= (8, 0)):
            return "efficient"
        return "math"

    def workspace_bytes(self) -> int:
        """cuBLAS workspaces the allocator holds: two handles (forward thread, autograd's device thread)."""
        if not self.cuda:
            return 0
        return 2 * (self.gpu.cublas_workspace if self.gpu else 32 * MiB)

    def tensor_budget(self, device_bytes: int) -> int:
        """Bytes for a step's tensors out of ``device_bytes`` of the device's memory: less what the allocator holds
        besides them (cuBLAS workspaces on CUDA, modelled), so that max_memory_allocated stays within it."""
        return device_bytes - self.workspace_bytes()


def _saved_bytes(tensors, round_to: int) -> int:
    return sum(round_up(t.numel() * t.element_size(), round_to) for t in tensors if t.numel())


def attention_saved_delta(backend: str, batch: int, heads: int, context: int, head_dim: int, dtype: torch.dtype | None,
                          round_to: int) -> int:
    """Bytes one causal attention call saves for backward on CUDA with ``backend``, minus what the CPU
    kernel we profile saves, from the two kernels' meta implementations (the output is common to both)."""
    if backend in ("cpu-flash", "math"):
        return 0  # profiled as is: the CPU kernel itself, or the math path run on CPU
    dt = dtype or torch.float32
    q = torch.empty(batch, heads, context, head_dim, dtype=dt, device="meta")
    cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
    if backend == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)
        cuda = [out[1], out[6], out[7]]  # log-sum-exp, philox RNG state (seed, offset): what its backward takes
    else:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True)
        cuda = [out[1], out[2], out[3]]  # log-sum-exp (rows padded to 32), seed, offset
    return _saved_bytes(cuda, round_to) - _saved_bytes([cpu[1]], round_to)
