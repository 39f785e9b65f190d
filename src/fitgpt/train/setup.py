"""Everything made once before the loop: the data, the model, its checkpointing policy, and the one place that
prepares the model to train (activation checkpointing, then compile, then DDP/FSDP)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable

import torch
import torch.nn as nn

from fitgpt import float8
from fitgpt.activation_checkpoint import Policy, apply_activation_checkpointing, parse_policy
from fitgpt.config import TrainConfig, to_dict
from fitgpt.data.loader import TokenData
from fitgpt.data.prepare import ensure_prepared
from fitgpt.data.tokenizer import TOKENIZER_FILE
from fitgpt.device import is_host_oom
from fitgpt.errors import UserError
from fitgpt.hf import check_tokenizer, hf_weights, import_weights
from fitgpt.memory import measure_step_memory
from fitgpt.memory.tracker import round_up
from fitgpt.model import Transformer
from fitgpt.optim import StateLayout
from fitgpt.parallel.fsdp import compile_blocks, fsdp_shard, precision_roles
from fitgpt.train import distributed as dist_utils
from fitgpt.train.checkpoint import tied_parameter_names
from fitgpt.train.resume import rng_state, set_rng_state
from fitgpt.units import format_bytes, format_count
from fitgpt.utils import host_memory

log = logging.getLogger(__name__)

# (config, device, processes) -> {"policy": spec, "budget": bytes, "predicted_peak": bytes}
Planner = Callable[[TrainConfig, torch.device, int], dict]


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device, shards: int = 1) -> Transformer:
    """The model of ``cfg`` with its initial weights from --seed; ``shards`` above 1 (FSDP over that many ranks): on
    the meta device, for `fitgpt.parallel.materialise` to fill each rank's shards once sharded, never whole."""
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    _check_weights_fit(cfg, model_cfg, device, shards)
    # Float8 linears before anything splits, checkpoints or shards the model (torchtitan's converters run there).
    if shards > 1:
        with torch.device("meta"):
            return float8.convert(Transformer(model_cfg), cfg.float8)
    torch.manual_seed(cfg.seed)
    try:
        return float8.convert(Transformer(model_cfg).to(device), cfg.float8)
    except RuntimeError as e:
        if not is_host_oom(e):
            raise
        raise UserError(f"out of host memory building the model: {too_large(cfg)}") from None


def init_from_hf(cfg: TrainConfig, model: nn.Module, info: dist_utils.DistInfo, device: torch.device, sharded: bool,
                 stages: nn.Module | None = None) -> None:
    """--init-from: a Hugging Face folder's weights into the model. Under FSDP (``sharded``: the model built on the
    meta device and sharded) rank 0 reads them and every rank keeps its pieces, a tensor at a time; otherwise each
    process loads them whole. Under --pipeline-parallel ``model`` is the whole model (on the meta device) and
    ``stages`` what this rank holds of it: every weight is sent, each kept by the ranks that hold it (a tied head by
    the last stage's, from the embedding)."""
    check_tokenizer(cfg.init_from, cfg.data.path / TOKENIZER_FILE)
    if not sharded:
        import_weights(cfg.init_from, model)
    else:
        held: dict = {}

        def read() -> None:  # a bad folder: one line, every rank
            held.update(hf_weights(cfg.init_from, model))
            if stages is not None and cfg.model.tied:  # the last stage's own copy of the embedding
                held["lm_head.weight"] = held["token_embed.weight"]

        dist_utils.from_main(info, read)
        whole = model.state_dict(keep_vars=True) if stages is not None else None
        skip = set() if stages is not None else set(tied_parameter_names(model))
        dist_utils.broadcast_weights(info, model if stages is None else stages, held, device, skip, whole)
    log.info("initialised from %s (%s, %d blocks x %d)", cfg.init_from, cfg.model.arch, cfg.model.n_blocks, cfg.model.n_embed)


def too_large(cfg: TrainConfig) -> str:
    """What to do about a run larger than its device: the plan that says what fits."""
    return (f"run `fitgpt plan --preset {cfg.preset} --batch-size {cfg.batch_size} --context {cfg.model.context_length} "
            "--memory-budget <your memory>` for what fits, or use fewer blocks (--model.n-blocks) or a narrower model "
            "(--model.n-embed)")


def _check_weights_fit(cfg: TrainConfig, model_cfg, device: torch.device, shards: int) -> None:
    """Refused before anything is allocated: the weights alone (a rank's shard of them) over the device's memory (a
    52B model on a laptop would otherwise allocate for half a minute, then fail in the allocator)."""
    with torch.device("meta"):
        params = Transformer(model_cfg).num_params(non_embedding=False)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host_memory()
    per, dtype = (2, "bf16") if model_cfg.weights_dtype == "bf16" else (4, "fp32")
    if per * params // shards > memory:
        whose = f"{dtype} weights alone (a rank's shard of {shards}: {format_bytes(per * params // shards)})" if shards > 1 \
            else f"{dtype} weights alone ({format_bytes(per * params)})"
        raise UserError(f"the model has {format_count(params)} parameters, whose {whose} exceed this {device.type} "
                        f"device's memory ({format_bytes(memory)}); " + too_large(cfg))


def activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> int | None:
    """Measured activation bytes of one micro-batch through ``model`` as it is now (None: out of memory). The RNG
    and the gradients are left as they were."""
    rng = rng_state(device)
    try:
        return measure_step_memory(model, x, y).activation_bytes
    except torch.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        set_rng_state(rng, device)


def log_activation_memory(measured: dict[str, int | None], x: torch.Tensor) -> None:
    parts = [f"{k}: {v / 2**20:.1f} MiB" if v is not None else f"{k}: out of memory" for k, v in measured.items()]
    log.info("activation memory of one micro-batch (%d x %d): %s", x.size(0), x.size(1), ", ".join(parts))


def load_data(cfg: TrainConfig, info: dist_utils.DistInfo) -> tuple[TokenData, TrainConfig]:
    """The prepared tokens (rank 0 prepares them on first use, or checks them, and hands every rank their meta.json),
    and cfg with the data's settings (config.json records them) and the model's vocabulary set from them."""
    data_cfg, meta = dist_utils.from_main(info, lambda: ensure_prepared(cfg.data, progress=cfg.progress))
    data = TokenData(data_cfg.path, meta)
    data.check_context(cfg.model.context_length)
    cfg = dataclasses.replace(cfg, data=data_cfg)
    # Rounded up to a multiple of 64 for fast matmuls; a model started from elsewhere keeps its own.
    vocab_size = round_up(data.vocab_size, 64)
    if cfg.init_from:
        if data.vocab_size > cfg.model.vocab_size:
            raise UserError(f"--init-from {cfg.init_from}: the data has {data.vocab_size} token ids, the model "
                             f"{cfg.model.vocab_size}; prepare the data with the model's tokenizer")
        vocab_size = cfg.model.vocab_size
    return data, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def write_run_files(cfg: TrainConfig) -> None:
    # What this invocation did once (resume, overwrite, record the first steps' memory) is not a setting of the run:
    # `--config config.json --resume latest` must not repeat it (a second snapshot would replace the first steps').
    once = dataclasses.replace(cfg, resume=None, overwrite=False, memory_snapshot=0)
    (cfg.run_dir / "config.json").write_text(json.dumps(to_dict(once), indent=1))
    # The run keeps its own tokenizer, so sampling works even if the data directory moves.
    shutil.copyfile(cfg.data.path / "tokenizer.json", cfg.run_dir / "tokenizer.json")


def choose_policy(cfg: TrainConfig, planner: Planner | None, device: torch.device, info: dist_utils.DistInfo) -> tuple[Policy, dict | None]:
    """The run's checkpointing policy; for auto, the planner's plan for this device and process count, made on
    rank 0 (its time model is measured, so ranks planning apart could choose apart) and shared."""
    if cfg.activation_checkpointing != "auto":
        return cfg.policy, None
    if planner is None:
        raise UserError("--activation-checkpointing auto needs a planner: pass the planner's plan_for as train(cfg, planner=...)")
    planned = dist_utils.from_main(info, lambda: planner(cfg, device, info.world))
    return parse_policy(planned["policy"]), planned


def prepare_model(model: nn.Module, policy: Policy, cfg: TrainConfig, info: dist_utils.DistInfo, device: torch.device,
                  dtype: torch.dtype | None, inspect: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """The one place a model is made ready to train, in this order on every rank: tensor parallelism (in place, over
    the mesh's "tp" dimension), then activation checkpointing (in place), then torch.compile (the whole model; under
    FSDP or the split each block, as torchtitan does), then DDP or FSDP (over the mesh's "dp" dimension, with tensor
    parallelism).
    Returns the module the steps call. ``inspect`` sees the checkpointed model before it is compiled or sharded (the
    trainer measures its activations there)."""
    if cfg.pipeline_parallel > 1:
        return _pipelined(model, policy, cfg, info, device, dtype)
    mesh = None
    if cfg.tensor_parallel > 1:  # split first, as torchtitan orders them; FSDP then shards the splits over "dp"
        from fitgpt.parallel.tensor import apply_tensor_parallel, training_mesh

        mesh = training_mesh(device.type, info.world, cfg.tensor_parallel)
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, policy)
    log.info("checkpointing %s", policy.describe(cfg.model.n_blocks))
    if inspect is not None:
        inspect(model)
    sharded = info.enabled and cfg.parallel == "fsdp"
    # Each block, before sharding: FSDP's hooks stay outside the compiled code. Under the split too, as torchtitan
    # compiles it: the whole model compiled would give AOTAutograd the vocabulary-sharded logits, whose gradient a
    # training step never makes.
    per_block = cfg.compile and (sharded or mesh is not None)
    if per_block:
        compile_blocks(model)
    step_model = torch.compile(model) if cfg.compile and not per_block else model
    _, param_dtype = precision_roles(dtype, cfg.parallel == "fsdp")
    if mesh is not None:  # FSDP over the data-parallel groups, or (one group) no data-parallel wrapper
        return (fsdp_shard(step_model, param_dtype, mesh=mesh["dp"], reshard_after_forward=cfg.reshards_after_forward)
                if sharded else step_model)
    return dist_utils.wrap(step_model, info, cfg.parallel, device, param_dtype, cfg.fsdp_offload, cfg.reshards_after_forward)


def _pipelined(model: nn.Module, policy: Policy, cfg: TrainConfig, info: dist_utils.DistInfo, device: torch.device,
               dtype: torch.dtype | None):
    """``prepare_model`` for --pipeline-parallel (`fitgpt.parallel.pipeline.prepare_pipeline`: stages, checkpointing,
    FSDP over each stage's data-parallel ranks, the schedule)."""
    from fitgpt.parallel import pipeline

    mesh = pipeline.training_mesh(device.type, info.world, cfg.pipeline_parallel, cfg.tensor_parallel)
    pipe = pipeline.prepare_pipeline(model, policy, cfg, mesh, device, precision_roles(dtype, True)[1],
                                     StateLayout(cfg.optim))
    log.info("checkpointing %s; pipeline stage%s of blocks %s on this rank", policy.describe(cfg.model.n_blocks),
             "s" if len(pipe.stages) > 1 else "", ", ".join(f"{s.blocks[0]}-{s.blocks[-1]}" for s in pipe.stages))
    return pipe
