"""What the planner profiles: a model it can build with no memory, at the depth and context it asks for.

Three kinds. `OwnModel`: fitgpt's own, from a `ModelConfig`. `HFModel`: any causal LM the installed
``transformers`` knows, from its config.json alone (built with ``from_config`` on the meta device; attention
as the config selects: eager, SDPA, ...). `ModuleModel`: any ``nn.Module``, from a function that builds it.
Every model built answers ``model(idx, targets) -> (logits, loss)`` as ``train_step`` calls it (`CausalLM`
adapts the others) and keeps its blocks in one ``nn.ModuleList`` (``find_blocks``), where the profile cuts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
import torch.nn as nn

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, Transformer
from fitgpt.model.adapter import CausalLM


class ModelSource(Protocol):
    """A model the planner can build; its size, as far as the profile needs it."""

    n_blocks: int
    context_length: int
    vocab_size: int
    head_dim: int | None
    """Of each attention call (None: not known), for the attention kernel CUDA would pick."""
    resizable: bool
    """``at`` changes depth and context: a deep model is profiled shallow and deepened (its middle blocks alike)."""
    chunked_head: bool
    """The head computes logits and loss in one call (``lm_head(x, targets)``), so the chunked loss applies."""

    def build(self) -> nn.Module:
        """The model, on the default device (the planner builds it under ``torch.device("meta")``)."""
        ...

    def at(self, n_blocks: int | None = None, context: int | None = None, vocab_size: int | None = None) -> ModelSource:
        """The same model with those changed (what a source cannot change it leaves)."""
        ...

    def describe(self) -> str:
        """One line for the plan's headline: the architecture and its shape."""
        ...


@dataclass(frozen=True)
class OwnModel:
    cfg: ModelConfig
    resizable: ClassVar[bool] = True
    chunked_head: ClassVar[bool] = True

    n_blocks = property(lambda self: self.cfg.n_blocks)
    context_length = property(lambda self: self.cfg.context_length)
    vocab_size = property(lambda self: self.cfg.vocab_size)
    head_dim = property(lambda self: self.cfg.head_dim)

    def build(self) -> nn.Module:
        return Transformer(self.cfg)

    def at(self, n_blocks=None, context=None, vocab_size=None) -> OwnModel:
        changes = {"n_blocks": n_blocks, "context_length": context, "vocab_size": vocab_size}
        return OwnModel(dataclasses.replace(self.cfg, **{k: v for k, v in changes.items() if v is not None}))

    def describe(self) -> str:
        m = self.cfg
        heads = f"{m.n_head} heads" + (f" ({m.n_kv_head} kv)" if m.n_kv_head and m.n_kv_head != m.n_head else "")
        return f"{m.arch}, {m.n_blocks} blocks x {m.n_embed} wide, {heads}, vocab {m.vocab_size}"


@dataclass(frozen=True)
class Float8Model:
    """``inner``'s model with float8 linears (--float8: `fitgpt.float8.convert`), as the trainer converts it."""

    inner: ModelSource
    recipe: str

    n_blocks = property(lambda self: self.inner.n_blocks)
    context_length = property(lambda self: self.inner.context_length)
    vocab_size = property(lambda self: self.inner.vocab_size)
    head_dim = property(lambda self: self.inner.head_dim)
    resizable = property(lambda self: self.inner.resizable)
    chunked_head = property(lambda self: self.inner.chunked_head)

    def build(self) -> nn.Module:
        from fitgpt.float8 import convert

        return convert(self.inner.build(), self.recipe)

    def at(self, n_blocks=None, context=None, vocab_size=None) -> Float8Model:
        return Float8Model(self.inner.at(n_blocks, context, vocab_size), self.recipe)

    def describe(self) -> str:
        return f"{self.inner.describe()}, float8 linears ({self.recipe})"


def with_float8(source: ModelSource, recipe: str) -> ModelSource:
    """``source`` as --float8 ``recipe`` trains it."""
    return source if recipe == "none" else Float8Model(source, recipe)


def param_count(source: ModelSource) -> int:
    """Parameters of the model ``source`` builds (tied weights once), counted on the meta device; fitgpt's own from its
    one- and two-block models (its blocks are alike: building a deep one costs a second, searches ask often)."""
    if isinstance(source, Float8Model):  # the same parameters
        return param_count(source.inner)
    if isinstance(source, OwnModel) and source.n_blocks > 2:
        one, two = param_count(source.at(n_blocks=1)), param_count(source.at(n_blocks=2))
        return one + (source.n_blocks - 1) * (two - one)
    with torch.device("meta"):
        model = source.build()
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def as_source(model: ModelConfig | ModelSource) -> ModelSource:
    return OwnModel(model) if isinstance(model, ModelConfig) else model


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _check_shape(config, path: str | Path) -> None:
    """What the planner reads of a config: attention blocks, a positive whole number of them, their width."""
    name = type(config).__name__
    if not isinstance(getattr(config, "num_attention_heads", None), int):
        raise UserError(f"--hf-config {path}: {name} has no attention heads (num_attention_heads): fitgpt plans "
                        "transformers, whose blocks attend; a state-space or recurrent model is not one")
    for key in SHAPE_KEYS:
        _positive(getattr(config, key, None), key, path)


SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _positive(value: object, key: str, path: str | Path) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"--hf-config {path}: {key} must be a positive whole number, got {value!r}; fix it in the config")


@dataclass(frozen=True)
class HFModel:
    """A ``transformers`` causal LM of ``config`` (a ``PretrainedConfig``); ``path``: where it was read."""

    config: object
    path: str = ""
    chunked_head: ClassVar[bool] = False

    n_blocks = property(lambda self: self.config.num_hidden_layers)
    context_length = property(lambda self: self.config.max_position_embeddings)
    vocab_size = property(lambda self: self.config.vocab_size)

    @property
    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def resizable(self) -> bool:
        # Models that alternate layer kinds (sliding and full attention) have no one middle block.
        return len(set(getattr(self.config, "layer_types", None) or ["one"])) == 1

    def build(self) -> nn.Module:
        from fitgpt.hf import transformers_module

        # fp32 weights whatever dtype the config was saved in, as fitgpt trains: --precision is autocast over them.
        try:
            model = transformers_module().AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        except (ImportError, ValueError) as e:  # an attention implementation this machine lacks, a config it refuses
            raise UserError(f"--hf-config {self.path or 'the config'}: transformers cannot build this model here ({_first_line(e)}); "
                            "for another attention set attn_implementation to sdpa or eager") from None
        return CausalLM(model, hf=True)

    def at(self, n_blocks=None, context=None, vocab_size=None) -> HFModel:
        c = copy.deepcopy(self.config)
        if n_blocks is not None:
            c.num_hidden_layers = n_blocks
            types = getattr(c, "layer_types", None)
            if types:  # one kind of layer (resizable) at any depth; mixed kinds only cut short
                c.layer_types = [types[0]] * n_blocks if len(set(types)) == 1 else types[:n_blocks]
        if context is not None:
            c.max_position_embeddings = context
        if vocab_size is not None:
            c.vocab_size = vocab_size
        return HFModel(c, self.path)

    def describe(self) -> str:
        c = self.config
        kv = getattr(c, "num_key_value_heads", None)
        heads = f"{c.num_attention_heads} heads" + (f" ({kv} kv)" if kv and kv != c.num_attention_heads else "")
        return (f"{type(c).__name__.removesuffix('Config')} ({c._attn_implementation or 'default'} attention), "
                f"{c.num_hidden_layers} blocks x {c.hidden_size} wide, {heads}, vocab {c.vocab_size}")


def read_hf_config(path: str | Path) -> HFModel:
    """The model of a Hugging Face ``config.json`` (or of the local folder holding one), read alone: no weights,
    no download. Its attention implementation is the config's ``attn_implementation`` if it names one, else what
    ``transformers`` picks by default (SDPA)."""
    from fitgpt.hf import transformers_module

    tf = transformers_module()
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--hf-config {path}: cannot read a config.json there ({type(e).__name__}: {e})") from None
    kind = values.pop("model_type", None) if isinstance(values, dict) else None
    if kind not in tf.CONFIG_MAPPING:
        raise UserError(f"--hf-config {path}: model_type {kind!r} is not one transformers {tf.__version__} knows; "
                        "give a causal LM's config.json")
    attn = values.pop("attn_implementation", None) or values.pop("_attn_implementation", None)
    for key in SHAPE_KEYS:
        if key in values:
            _positive(values[key], key, path)
    try:
        config = tf.AutoConfig.for_model(kind, **values)
    except Exception as e:  # any of transformers' (and huggingface_hub's strict) checks of the file's fields
        raise UserError(f"--hf-config {path}: {_first_line(e)}; fix that field of the config") from None
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"--hf-config {path}: {type(config).__name__} has no causal LM in transformers (AutoModelForCausalLM)")
    _check_shape(config, path)
    config._attn_implementation = attn or "sdpa"
    return HFModel(config, str(path))


def check_held_tensors(model: nn.Module) -> None:
    """Refuse a tensor kept as a plain attribute: it is neither a parameter nor a buffer, so ``.to(device)`` (and the
    planner's fake tensors) leave it where it was made, and the step mixes devices."""
    for path, sub in model.named_modules():
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                where = f"{type(model).__name__}{'.' + path if path else ''}"
                raise UserError(f"{where} keeps a tensor in its attribute {name!r}, which is neither a parameter nor a "
                                f"buffer and so does not move with the module: register it, self.register_buffer("
                                f"{name!r}, tensor, persistent=False)")


@dataclass(frozen=True)
class ModuleModel:
    """Any module ``builder()`` makes, whose forward takes (idx, targets) and gives a loss, (logits, loss) or an
    object with ``.loss``: planned at the size it is built (it cannot be resized)."""

    builder: Callable[[], nn.Module]
    vocab_size: int
    context_length: int
    n_blocks: int = 0
    head_dim: ClassVar[None] = None  # not known: the profile reads each attention call it makes
    resizable: ClassVar[bool] = False
    chunked_head: ClassVar[bool] = False

    def build(self) -> nn.Module:
        model = self.builder()
        check_held_tensors(model)
        return CausalLM(model)

    def at(self, n_blocks=None, context=None, vocab_size=None) -> ModuleModel:
        if n_blocks not in (None, self.n_blocks):
            raise ValueError("a module built by a function is planned at its own depth")
        return self  # context and vocabulary are the batch's: nothing in the module to change

    def describe(self) -> str:
        return f"{self.n_blocks} blocks, vocab {self.vocab_size} (a module)"
