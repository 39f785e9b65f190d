"""The Hugging Face door: a run out as a ``transformers`` folder, and a ``transformers`` folder in as a model.

GPT-2 runs become ``GPT2LMHeadModel`` (its ``Conv1D`` layers hold weights transposed), Llama runs
``LlamaForCausalLM`` (same layout as ours, names mapped). Weights are safetensors; the run's own tokenizer
goes with them as a fast tokenizer whose end-of-text token is its BOS and EOS. Anything that does not map
exactly (other architectures, rope scaling, biases a Llama does not have) is refused, naming what.
``transformers`` is the ``[hf]`` extra.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fitgpt.data.tokenizer import EOT, TOKENIZER_FILE, Tokenizer
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, Transformer

log = logging.getLogger(__name__)

_GPT2_GELU = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
_LLAMA = {  # ours -> Hugging Face's, per block
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
    **{f"attn.{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}
_GPT2 = {  # ours -> Hugging Face's, per block; True where Conv1D stores the weight transposed
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True), "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True), "mlp.proj.bias": ("mlp.c_proj.bias", False),
}


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise UserError("Hugging Face models (export, --init-from, --hf-config) need transformers: pip install 'fitgpt[hf]'") from None
    return transformers


def hf_config(cfg: ModelConfig, eot_id: int | None = None):
    """The ``transformers`` config of a fitgpt model."""
    tf = transformers_module()
    special = {"bos_token_id": eot_id, "eos_token_id": eot_id, "tie_word_embeddings": cfg.tied}
    if cfg.arch == "llama":
        return tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embed, intermediate_size=cfg.mlp_hidden,
                              num_hidden_layers=cfg.n_blocks, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
                              max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                              hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=cfg.dropout, **special)
    return tf.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_embd=cfg.n_embed, n_layer=cfg.n_blocks,
                         n_head=cfg.n_head, n_inner=4 * cfg.n_embed, layer_norm_epsilon=1e-5,
                         activation_function="gelu_new" if cfg.gelu == "tanh" else "gelu",
                         resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, **special)


def _name_map(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Hugging Face's name -> (ours, transposed) for every weight of a model of ``cfg``: both directions use it."""
    names: dict[str, tuple[str, bool]] = {"lm_head.weight": ("lm_head.weight", False)}
    if cfg.arch == "llama":
        names |= {"model.embed_tokens.weight": ("token_embed.weight", False), "model.norm.weight": ("layer_norm.weight", False)}
        for i in range(cfg.n_blocks):
            names |= {f"model.layers.{i}.{t}": (f"attn_blocks.{i}.{o}", False) for o, t in _LLAMA.items()}
        return names
    names |= {"transformer.wte.weight": ("token_embed.weight", False), "transformer.wpe.weight": ("position_embed.weight", False),
              "transformer.ln_f.weight": ("layer_norm.weight", False), "transformer.ln_f.bias": ("layer_norm.bias", False)}
    for i in range(cfg.n_blocks):
        names |= {f"transformer.h.{i}.{t}": (f"attn_blocks.{i}.{o}", tr) for o, (t, tr) in _GPT2.items()}
    return names


_INTO_RESIDUAL = ("attn.proj.", "mlp.proj.", "attn.o_proj.", "mlp.down_proj.")


def to_hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face's names and layouts (GPT-2 biases we do not have are zeros), muP's multipliers
    folded in: CompleteP's into the projections that write the residual, the output's into an untied head (a tied
    one, shared with the embedding, cannot take it)."""
    cfg, sd = model.config, model.state_dict()
    if cfg.width_mult != 1.0 and cfg.tied:
        raise UserError(f"this model's head is tied to its embedding and scaled by muP's 1/{cfg.width_mult:g}, which "
                        "Hugging Face's models have no place for: train it with --model.tie-embeddings False to export it")
    out: dict[str, torch.Tensor] = {}
    for theirs, (ours, transposed) in _name_map(cfg).items():
        w = sd.get(ours)
        if w is None:  # a bias-free GPT-2: Hugging Face's has biases, all zero here
            w = torch.zeros(_gpt2_bias_size(cfg, ours))
        elif ours.startswith("attn_blocks.") and ours.split(".", 2)[-1].startswith(_INTO_RESIDUAL):
            w = w * cfg.branch_mult
        elif ours == "lm_head.weight":
            w = w / cfg.width_mult
        out[theirs] = (w.t() if transposed else w).detach().contiguous()
    return out


def _gpt2_bias_size(cfg: ModelConfig, name: str) -> int:
    C = cfg.n_embed
    return {"attn.qkv.bias": 3 * C, "mlp.fc.bias": 4 * C}.get(name.split(".", 2)[-1], C)


def export_model(model: Transformer, tokenizer: Tokenizer, out_dir: str | Path) -> Path:
    """Write ``model`` and its ``tokenizer`` as a folder ``AutoModelForCausalLM`` and ``AutoTokenizer`` load offline."""
    tf = transformers_module()
    cfg = model.config
    cls = tf.LlamaForCausalLM if cfg.arch == "llama" else tf.GPT2LMHeadModel
    with torch.device("meta"):
        hf = cls(hf_config(cfg, tokenizer.eot_id))
    hf.load_state_dict(to_hf_state(model), strict=True, assign=True)
    if cfg.tied:
        hf.tie_weights()
    out = Path(out_dir)
    hf.save_pretrained(out, safe_serialization=True)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok, bos_token=EOT, eos_token=EOT, unk_token=None,
                                      model_max_length=cfg.context_length)
    fast.save_pretrained(out)
    log.info("exported the model to %s as %s", out, cls.__name__)
    return out


def _loaded(what: Path, load):
    """``load()``, or a one-line UserError naming the file: a folder's files are the user's, and the libraries that
    read them fail on a broken one in many ways (OSError, ValueError, RuntimeError, SafetensorError, ...)."""
    try:
        return load()
    except UserError:  # already ours
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read a user's file is reported as that
        reason = e
    first = (str(reason).strip().splitlines() or [""])[0][:300]
    if "mismatched_sizes" in first or "size mismatch" in first:
        first = "its weights do not have the shapes its config.json gives"
    raise UserError(f"--init-from: {what} cannot be loaded ({type(reason).__name__}: {first}); it is damaged or not a "
                     "Hugging Face GPT-2/Llama model folder: export or save it again") from None


def import_config(hf_dir: str | Path) -> ModelConfig:
    """Our config of a local Hugging Face GPT-2 or Llama folder, or a UserError naming what does not map."""
    tf = transformers_module()
    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: --init-from takes a folder written by save_pretrained")
    c = _loaded(path / "config.json", lambda: tf.AutoConfig.from_pretrained(str(path), local_files_only=True))
    tied = bool(getattr(c, "tie_word_embeddings", True))
    if c.model_type == "gpt2":
        act = _GPT2_GELU.get(c.activation_function)
        if act is None or (c.n_inner or 4 * c.n_embd) != 4 * c.n_embd or not c.scale_attn_weights:
            raise UserError(f"{path}: this GPT-2 variant (activation {c.activation_function}, n_inner {c.n_inner}) "
                             "does not map onto fitgpt's GPT-2 block")
        return ModelConfig(arch="gpt2", vocab_size=c.vocab_size, context_length=c.n_positions, n_embed=c.n_embd,
                           n_head=c.n_head, n_blocks=c.n_layer, dropout=0.0, tie_embeddings=tied, gelu=act)
    if c.model_type == "llama":
        scaling = getattr(c, "rope_scaling", None)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in (None, "default"):
            raise UserError(f"{path}: rope scaling {rope_type!r} is not implemented in fitgpt; only plain rotary embeddings")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or head_dim * c.num_attention_heads != c.hidden_size:
            raise UserError(f"{path}: attention/MLP biases or a head size other than hidden_size / heads do not map onto "
                             "fitgpt's Llama block")
        if c.hidden_act != "silu":
            raise UserError(f"{path}: activation {c.hidden_act!r}; fitgpt's Llama block uses silu")
        theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return ModelConfig(arch="llama", vocab_size=c.vocab_size, context_length=c.max_position_embeddings,
                           n_embed=c.hidden_size, n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads,
                           n_blocks=c.num_hidden_layers, ffn_hidden=c.intermediate_size, tie_embeddings=tied,
                           rope_theta=float(theta), norm_eps=c.rms_norm_eps, dropout=0.0)
    raise UserError(f"{path}: model_type {c.model_type!r} cannot be imported; fitgpt maps gpt2 and llama")


def import_weights(hf_dir: str | Path, model: Transformer) -> None:
    """Load a Hugging Face folder's weights into ``model`` (built from ``import_config`` of it)."""
    model.load_state_dict(hf_weights(hf_dir, model), strict=False)  # every name checked; a tied head is the embedding


def hf_weights(hf_dir: str | Path, model: Transformer) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's weights, whole, under ``model``'s names, checked against its shapes (``model`` may be on
    the meta device, or sharded: only its names and shapes are read). A tied head is left to the embedding."""
    tf = transformers_module()
    hf = _loaded(Path(hf_dir), lambda: tf.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True,
                                                                           torch_dtype=torch.float32))
    theirs, own = hf.state_dict(), model.state_dict()
    ours = {}
    for hf_name, (name, transposed) in _name_map(model.config).items():
        if hf_name not in theirs:
            raise UserError(f"{hf_dir}: weight {hf_name} is missing")
        w = theirs[hf_name].t() if transposed else theirs[hf_name]
        if w.shape != own[name].shape:
            raise UserError(f"{hf_dir}: {hf_name} has shape {tuple(theirs[hf_name].shape)}, fitgpt's model "
                             f"{tuple(own[name].shape)}")
        ours[name] = w.contiguous()
    if set(own) - set(ours) - ({"lm_head.weight"} if model.config.tied else set()):
        raise UserError(f"{hf_dir}: weights do not map onto the model (missing {sorted(set(own) - set(ours))[:3]})")
    return ours


def check_tokenizer(hf_dir: str | Path, data_tokenizer: Path) -> None:
    """Refuse to start from a folder whose tokenizer is not the one the training data was made with."""
    theirs = Path(hf_dir) / TOKENIZER_FILE
    if not theirs.is_file():
        log.warning("%s has no %s: make sure the training data was tokenized with the model's tokenizer", hf_dir, TOKENIZER_FILE)
        return
    a, b = _loaded(theirs, lambda: Tokenizer.load(Path(hf_dir))), Tokenizer.load(data_tokenizer.parent)
    if a._tok.get_vocab() != b._tok.get_vocab():
        raise UserError(f"{theirs} is not the tokenizer of the training data ({data_tokenizer}): prepare the data "
                         f"with it (--data.tokenizer {theirs} and another --data.dir), or start from a model trained with "
                         "this data's")
