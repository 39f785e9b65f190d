"""The prepared-data contract: what a data directory `fitgpt prepare` wrote holds, and how training checks
that it was made as asked. Training reads this; only `fitgpt.data.prepare` writes it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fitgpt.data.config import BUILTIN, DataConfig
from fitgpt.data.corpus import changed_inputs
from fitgpt.errors import UserError
from fitgpt.utils import DirLock, sha256_file

META_FILE = "meta.json"
FORMAT_VERSION = 2
PARTIAL = ".partial"
"""The staging folder of a preparation in progress."""


def read_meta(cfg: DataConfig) -> dict | None:
    """The data directory's meta.json (None if it has none yet), refused if unreadable or not fitgpt's."""
    meta_path = cfg.path / META_FILE
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{meta_path} is unreadable ({e}); re-run `fitgpt prepare --dir {cfg.path}`") from None
    if not _fitgpt_meta(meta):
        raise UserError(f"{meta_path} is not a meta.json fitgpt prepare wrote (no format_version or tokenizer_sha256); "
                        f"re-run `fitgpt prepare --dir {cfg.path} --inputs ...` into it, or choose another --data.dir")
    return meta


def _fitgpt_meta(meta: object) -> bool:
    return isinstance(meta, dict) and "format_version" in meta and "tokenizer_sha256" in meta


def check_first_use(cfg: DataConfig) -> None:
    """Preparing on first use is for the built-in corpus's own folder, or for inputs that were named: a --data.dir
    alone that holds no data is a typo or a moved folder, not a request for the built-in corpus."""
    if cfg.dir and list(cfg.inputs) == [BUILTIN] and not (cfg.path / PARTIAL).is_dir():
        raise UserError(f"--data.dir {cfg.dir} holds no prepared data (no {META_FILE}); check the path, prepare it "
                         f"first (fitgpt prepare --dir {cfg.dir} --inputs ...), or name --data.inputs to prepare "
                         "them there on first use")


def is_prepared(directory: Path) -> bool:
    """Whether ``directory`` holds data `fitgpt prepare` wrote: a meta.json in fitgpt's format, or a preparation in
    progress (its staging folder). No other command writes there."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        return (directory / PARTIAL).is_dir()
    return _fitgpt_meta(meta)


def _is_ours(directory: Path) -> bool:
    """A data directory fitgpt prepared, or one whose first preparation was cut off (nothing but fitgpt's lock
    file, its staging folder and temporaries). A run directory is neither."""
    return is_prepared(directory) or all(p.name in (DirLock.FILE, PARTIAL) or p.name.endswith(".tmp")
                                         for p in directory.iterdir())


def check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--dir {out} is a file; choose a directory (new or empty, or one fitgpt prepared)")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not _is_ours(out):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UserError(f"--dir {out} holds files fitgpt did not write ({shown}); prepare into a new or empty --dir")


def prepared_settings(meta: dict) -> dict:
    """Every DataConfig setting (but the directory) a data directory was prepared with, from its meta.json:
    training adopts each one left at its default and refuses each one given otherwise."""
    settings = {"inputs": tuple(meta.get("inputs") or ()), "tokenizer": meta.get("tokenizer"),
                "text_field": meta.get("text_field", "text")}  # data prepared before record files had no field
    for key in ("val_fraction", "seed", "shard_tokens"):  # data prepared before one was recorded: not compared
        if key in meta:
            settings[key] = meta[key]
    if settings["tokenizer"] == "bpe":
        settings["vocab_size"] = meta.get("requested_vocab_size", meta.get("vocab_size"))
        if "tokenizer_sample" in meta:
            settings["tokenizer_sample"] = meta["tokenizer_sample"]
    return settings


def adopt_prepared(cfg: DataConfig, meta: dict) -> DataConfig:
    """``cfg`` with the settings its data directory was prepared with wherever it leaves them at their defaults and
    names the directory (--data.dir): training on data prepared with `fitgpt prepare` needs only its --dir."""
    if not cfg.dir:
        return cfg
    fields = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    have = prepared_settings(meta)  # a tokenizer file since removed is adopted too: the data's own copy is what trains
    return dataclasses.replace(cfg, **{k: v for k, v in have.items() if v is not None and getattr(cfg, k) == fields[k]})



def _same_tokenizer_file(name: str, meta: dict) -> bool:
    """--data.tokenizer naming a file with the very bytes the data was tokenized with (the data's own tokenizer.json,
    or a copy of it): the same tokenizer, whatever the file is called."""
    if name in ("bpe", "gpt2") or not Path(name).is_file():
        return False
    return sha256_file(Path(name)) == meta.get("tokenizer_sha256")


def check_prepared(cfg: DataConfig, meta: dict, out: Path) -> None:
    """Refuse data prepared otherwise than ``cfg`` asks (a setting, or inputs changed since), naming the flag."""
    meta_path = out / META_FILE
    have = prepared_settings(meta)
    for key in have:
        value = list(getattr(cfg, key)) if key == "inputs" else getattr(cfg, key)
        recorded = list(have[key]) if key == "inputs" else have[key]
        if key == "tokenizer" and _same_tokenizer_file(value, meta):
            continue
        if recorded != value:
            raise UserError(
                f"{meta_path} was prepared with {key}={recorded!r}, but this run asks for {value!r}; "
                f"use another --data.dir, or match --data.{key.replace('_', '-')}"
            )
    if isinstance(meta.get("files"), dict):
        changes = changed_inputs(list(cfg.inputs), meta["files"], meta.get("file_sha256") or {})
        if changes:
            shown = ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
            inputs = " ".join(repr(i) if " " in i else i for i in cfg.inputs)
            raise UserError(
                f"the inputs changed since {cfg.path} was prepared ({shown}); re-prepare with `fitgpt prepare --dir "
                f"{cfg.path} --inputs {inputs}` (runs on the old data keep their tokenizer), or use another --data.dir"
            )
