"""The `fitgpt` command: prepare, train, generate, bench, plan, fit, export. Only this package prints."""

from __future__ import annotations

import logging
import sys
import time
import traceback

COMMANDS = {
    "prepare": ("fitgpt.cli.prepare", "tokenize text (files, dirs, globs, or the built-in corpus) into train/val memmaps"),
    "train": ("fitgpt.cli.train", "train a model (no arguments: the tiny preset on the built-in corpus)"),
    "generate": ("fitgpt.cli.generate", "sample text from a trained run"),
    "bench": ("fitgpt.cli.bench", "measure checkpointing policies side by side: peak memory, FLOPs, step time"),
    "plan": ("fitgpt.cli.plan", "the fastest checkpointing plan that fits --memory-budget"),
    "fit": ("fitgpt.cli.fit", "the largest sizes and the fastest configurations that fit --memory-budget"),
    "ladder": ("fitgpt.cli.ladder", "train a ladder of small models on your data and fit a scaling law (law.json)"),
    "export": ("fitgpt.cli.export", "write a run as a Hugging Face transformers folder (the [hf] extra)"),
}


def _usage() -> str:
    lines = ["usage: fitgpt COMMAND [--help] [FLAGS] [--verbose]", "", "commands:"]
    lines += [f"  {name:10s} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "--verbose (any command): debug logging, and the traceback behind an error's one line"]
    return "\n".join(lines)


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname).1s %(name)s: %(message)s", force=True)
    for noisy in ("matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


_started: float | None = None  # when the running command began


def command_started() -> float:
    """When the running command began (`time.perf_counter`'s clock): the process's start for the command line's
    (`fitgpt ...`, `python -m fitgpt ...`: the interpreter and the imports count, so that `train --time-budget` keeps
    to the wall clock; under torchrun, its launcher's start), the call of ``main(argv)`` for a program's (a test's, a
    notebook's)."""
    return time.perf_counter() if _started is None else _started


def main(argv: list[str] | None = None) -> int:
    global _started
    from fitgpt.utils import launch_age

    _started = time.perf_counter() - (launch_age() if argv is None else 0.0)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from fitgpt import __version__

        print(__version__)
        return 0
    verbose = "--verbose" in argv
    argv = [a for a in argv if a != "--verbose"]
    if not argv:
        print(_usage())
        return 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"fitgpt: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    from fitgpt.errors import UserError

    module = importlib.import_module(COMMANDS[command][0])
    setup_logging(verbose)
    try:
        return module.run(rest)
    except UserError as e:  # what the user can change, named in the message; anything else is a bug: its traceback
        if verbose:
            traceback.print_exc()
        print(f"fitgpt {command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fitgpt plan ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # outside the training loop (which saves and exits 0): temporary files are cleaned up
        resume = "; `fitgpt prepare ... --resume` continues it" if command == "prepare" else ""
        print(f"fitgpt {command}: interrupted; nothing half-written was left behind{resume}", file=sys.stderr)
        return 130
