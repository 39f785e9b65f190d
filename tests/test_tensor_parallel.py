"""Tensor and sequence parallelism (issue 45, in part): fitgpt's Llama split over gloo CPU ranks with PyTorch's own
tensor parallelism gives one process's loss and gradients within fp32 rounding, under the checkpointing policies,
with grouped-query attention; what cannot be split is refused in one line."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import _free_port

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.model import ModelConfig, Transformer
from fitgpt.tensor_parallel import apply_tensor_parallel, step_context, tensor_parallel_refusal

# Llama with grouped-query attention (8 query heads sharing 4 key/value heads), untied, no dropout.
CFG = ModelConfig(arch="llama", vocab_size=128, context_length=16, n_embed=64, n_head=8, n_kv_head=4, n_blocks=2,
                  dropout=0.0, tie_embeddings=False)
POLICIES = ["none", "block", "selective", "pointwise"]


def _batch():
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.context_length + 1), generator=torch.Generator().manual_seed(1))
    return idx[:, :-1], idx[:, 1:]


def _grads(model):
    """Each parameter's gradient, gathered whole (a collective under tensor parallelism)."""
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        x, y = _batch()
        results = {}
        for spec in POLICIES:
            torch.manual_seed(0)
            model = Transformer(CFG)  # whole on every rank, the same weights; each keeps its shards
            apply_tensor_parallel(model, mesh)
            q_rows = model.attn_blocks[0].attn.q_proj.weight.to_local().shape[0]
            apply_activation_checkpointing(model, spec)  # after the split, as torchtitan orders them
            with step_context(model):
                loss = model(x, y)[1]
                loss.backward()
            results[spec] = {"loss": loss.full_tensor(), "grads": _grads(model), "q_rows": q_rows}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_one_process(tp, tmp_path):
    """1 x 2 and 1 x 4 (each rank 8 / tp query heads and 4 / tp key/value heads), every policy in one launch: the
    loss and every gradient within fp32 rounding of one process's, each rank holding 1 / tp of each projection."""
    out = str(tmp_path / "tp.pt")
    mp.spawn(_worker, args=(tp, _free_port(), out), nprocs=tp, join=True)
    results = torch.load(out)
    x, y = _batch()
    for spec in POLICIES:
        torch.manual_seed(0)
        model = Transformer(CFG)
        apply_activation_checkpointing(model, spec)
        loss = model(x, y)[1]
        loss.backward()
        got = results[spec]
        assert got["q_rows"] == CFG.n_embed // tp
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-6, atol=0)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-7, msg=f"{spec} {name}")


@pytest.mark.parametrize("change, words", [
    ({"arch": "gpt2", "n_kv_head": None}, "--model.arch llama"),
    ({"tie_embeddings": True}, "--model.tie-embeddings False"),
    ({"n_head": 6, "n_kv_head": 3, "n_embed": 48}, "model's n_kv_head (3)"),
    ({"vocab_size": 129}, "model's vocab_size (129)"),
])
def test_what_cannot_be_split_is_refused_in_one_line(change, words):
    import dataclasses

    why = tensor_parallel_refusal(dataclasses.replace(CFG, **change), 2)
    assert why is not None and words in why and "\n" not in why
    assert tensor_parallel_refusal(CFG, 4) is None and tensor_parallel_refusal(CFG, 8) is not None  # 4 kv heads
