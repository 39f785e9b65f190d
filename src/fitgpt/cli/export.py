"""`fitgpt export --run runs/tiny --out hf/tiny`: a run as a Hugging Face transformers folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tyro

from fitgpt.hf import export_model
from fitgpt.sample import load_run


@dataclass
class ExportConfig:
    """Write a run's checkpoint as a folder AutoModelForCausalLM and AutoTokenizer load (needs the [hf] extra)."""

    run: str = "runs/tiny"
    """Run directory written by `fitgpt train`."""
    out: str = ""
    """The folder to write (config.json, model.safetensors, tokenizer files)."""
    checkpoint: str = "latest"
    """'latest' or a checkpoint directory of the run."""
    overwrite: bool = False
    """Write into --out even if it already holds files."""

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out is required: the folder to write the Hugging Face model to")
        out = Path(self.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not self.overwrite:
            raise ValueError(f"--out {out} already exists and is not an empty folder; choose another or add --overwrite")


def run(args: list[str]) -> int:
    cfg = tyro.cli(ExportConfig, args=args, prog="fitgpt export")
    model, tokenizer, meta = load_run(cfg.run, cfg.checkpoint)
    out = export_model(model, tokenizer, cfg.out)
    print(f"exported {cfg.run} (step {meta['step']}) to {out}; load it with:\n"
          f"  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
          f"  model = AutoModelForCausalLM.from_pretrained('{out}')\n"
          f"  tokenizer = AutoTokenizer.from_pretrained('{out}')")
    return 0
