"""Under DDP (2 processes, gloo, CPU), gradients with block checkpointing equal those without."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.model import Transformer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, cfg) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=g)
        grads = {}
        for spec in ("none", "block", "selective"):
            torch.manual_seed(0)
            model = Transformer(cfg)
            apply_activation_checkpointing(model, spec)  # checkpointing first, then DDP
            ddp = DDP(model)
            _, loss = ddp(idx, idx)
            loss.backward()
            grads[spec] = {n.replace(".inner", ""): p.grad.clone() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, os.path.join(out_dir, "grads.pt"))
        dist.barrier()  # leave together: a rank tearing down while the other still writes can abort it (gloo)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_ddp_gradients_equal_with_and_without_checkpointing(tmp_path, tiny_model_config):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), tiny_model_config(dropout=0.0)), nprocs=2, join=True)
    grads = torch.load(tmp_path / "grads.pt")
    for spec in ("block", "selective"):
        for name, g in grads["none"].items():
            assert torch.equal(grads[spec][name], g), (spec, name)
