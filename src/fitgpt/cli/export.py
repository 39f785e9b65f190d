"""`fitgpt export --run runs/tiny --out hf/tiny`: a run as a Hugging Face transformers folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tyro

from fitgpt.errors import UserError
from fitgpt.hf import export_model
from fitgpt.train.load import load_run
from fitgpt.train.rundir import fitgpt_owner
from fitgpt.utils import writable_dir, write_error


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
    """Write into --out even if it already holds files (never into a run, a checkpoint or prepared data)."""

    def __post_init__(self) -> None:
        if not self.out:
            raise UserError("--out is required: the folder to write the Hugging Face model to")


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse, before any work, an --out that fitgpt keeps something in, that holds files (without --overwrite),
    or that cannot be written."""
    owner = fitgpt_owner(out)
    if owner:
        raise UserError(f"--out {out} is inside {owner}, which fitgpt keeps; export to a folder of its own, "
                         "e.g. --out hf/NAME")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} already exists and is not an empty folder; choose another or add --overwrite")
    writable_dir(out, "--out")


def run(args: list[str]) -> int:
    cfg = tyro.cli(ExportConfig, args=args, prog="fitgpt export")
    model, tokenizer, meta = load_run(cfg.run, cfg.checkpoint)
    check_out(Path(cfg.out), cfg.overwrite)
    try:
        out = export_model(model, tokenizer, cfg.out)
    except OSError as e:
        raise UserError(f"could not write the export to {cfg.out}: {write_error(e, cfg.out)}; free space or choose "
                         "another --out") from None
    print(f"exported {cfg.run} (step {meta['step']}) to {out}; load it with:\n"
          f"  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
          f"  model = AutoModelForCausalLM.from_pretrained('{out}')\n"
          f"  tokenizer = AutoTokenizer.from_pretrained('{out}')")
    return 0
