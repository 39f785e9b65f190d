"""The docs hold: every `fitgpt` and `torchrun ... -m fitgpt` command in the README, docs/ and benchmarks/RESULTS.md
parses with today's flags (no training), every relative link and named file resolves, and the layout page names every
module. A renamed flag breaks scripts people copied from the docs; here it breaks the suite first."""

from __future__ import annotations

import importlib
import re
import shlex
import warnings
from functools import cache
from pathlib import Path

import pytest

from fitgpt.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "fitgpt"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]

CONFIGS = {"train": "fitgpt.config:TrainConfig", "prepare": "fitgpt.cli.prepare:PrepareConfig",
           "generate": "fitgpt.cli.generate:GenerateConfig", "export": "fitgpt.cli.export:ExportConfig",
           "bench": "fitgpt.cli.bench:BenchConfig", "plan": "fitgpt.cli.plan:PlanConfig", "fit": "fitgpt.cli.fit:FitConfig",
           "ladder": "fitgpt.cli.ladder:LadderConfig"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*([:.][A-Za-z0-9_]*)?$")  # FILE, DIR, N, X, HOST:29500, ...


@cache
def _parser(command: str):
    """The argparse parser tyro builds for the command, over the defaults the command parses over."""
    import tyro.extras

    from fitgpt.cli.workload import WorkloadConfig, workload_default
    from fitgpt.config import load_config_named_in

    module, name = CONFIGS[command].split(":")
    cls = getattr(importlib.import_module(module), name)
    default = (workload_default(cls, []) if issubclass(cls, WorkloadConfig) else load_config_named_in([]) if command == "train"
               else tyro.MISSING_NONPROP)
    with warnings.catch_warnings():  # tyro keeps its argparse parser public but marks it deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        return tyro.extras.get_parser(cls, default=default)


def _check_value(flag: str, value: str) -> None:
    """The values whose meaning a renamed setting would change: policies, presets, cards, sizes."""
    from fitgpt.activation_checkpoint.policy import parse_policy
    from fitgpt.config import PRESETS
    from fitgpt.estimate.hardware import find_gpu
    from fitgpt.units import parse_bytes

    if PLACEHOLDER.match(value):
        return
    if flag in ("--activation-checkpointing", "--policies") and not value.startswith("auto"):
        parse_policy(value)
    elif flag == "--preset":
        if value not in PRESETS:
            raise AssertionError(f"unknown preset {value!r}")
    elif flag == "--gpu":
        find_gpu(value)
    elif flag in ("--memory-budget", "--gpu-memory", "--host-memory"):
        parse_bytes(value, flag)


def check_fitgpt(words: list[str], whole: bool) -> None:
    """``words`` after `fitgpt`: the command exists, each flag is one of its flags and its values are valid. A whole
    command (a line of a code block) is also parsed as the command line parses it; a phrase in the prose (`fitgpt plan
    ... --compare FILE`) may leave parts out."""
    if not (words and words[0] in CONFIGS):
        raise AssertionError(f"no such command: fitgpt {' '.join(words[:1])}")
    command, args = words[0], [w for w in words[1:] if w not in ("...", "…")]
    parser = _parser(command)
    options = parser._option_string_actions
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        i += 1
        if not flag.startswith("-"):
            raise AssertionError(f"fitgpt {command}: {flag!r} is not a flag")
        if flag not in options:
            raise AssertionError(f"fitgpt {command} has no flag {flag}")
        values = [inline] if inline else []
        while not inline and i < len(args) and not args[i].startswith("--") and options[flag].nargs != 0:
            values.append(args[i])
            i += 1
        for value in values:
            _check_value(flag, value)
    if whole and "--help" not in args:
        try:
            parser.parse_args(args)
        except SystemExit:
            raise AssertionError(f"fitgpt {command} does not parse {shlex.join(args)}") from None


def _torchrun_parses(launcher: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False
    try:
        parser.parse_args([*launcher, "train.py"])
    except SystemExit:
        raise AssertionError(f"torchrun does not parse {shlex.join(launcher)}") from None


def check_torchrun(words: list[str], whole: bool) -> None:
    """torchrun's own options parse, and what it runs is `-m fitgpt ...` or a file of this repository."""
    if "-m" in words:
        at = words.index("-m")
        if words[at + 1] != "fitgpt":
            raise AssertionError(f"torchrun runs {words[at + 1]}, not fitgpt")
        _torchrun_parses(words[:at])
        check_fitgpt(words[at + 2:], whole)
    else:
        scripts = [w for w in words if w.endswith(".py")]
        if scripts:
            if not (ROOT / scripts[0]).is_file():
                raise AssertionError(f"torchrun runs {scripts[0]}, which does not exist")
            words = words[:words.index(scripts[0])]
        _torchrun_parses(words)


def _segments(line: str) -> list[list[str]]:
    """A shell line as its simple commands (split at &&, ||, ; and |), comments dropped."""
    out, cur = [], []
    for word in shlex.split(line, comments=True):
        if word in ("&&", "||", ";", "|"):
            out.append(cur)
            cur = []
        else:
            cur.append(word)
    return [s for s in [*out, cur] if s]


def _blocks(text: str):
    """(language, lines) of each fenced code block."""
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        yield m.group(1), m.group(2).replace("\\\n", " ").splitlines()


def documented_commands(text: str) -> list[tuple[list[str], bool]]:
    """Every command line of the shell blocks (and `$ ` lines of output blocks), whole; every `fitgpt ...` and
    `torchrun ...` phrase of the prose, as a phrase."""
    found = []
    for lang, lines in _blocks(text):
        for line in lines:
            shell = lang in ("bash", "sh", "shell") or line.startswith("$ ")
            if shell and lang != "python":
                found += [(seg, True) for seg in _segments(line.removeprefix("$ "))]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found += [(shlex.split(m), False) for m in re.findall(r"`((?:fitgpt|torchrun) [^`]*)`", prose)]
    return found


def check_command(words: list[str], whole: bool) -> None:
    if words[0] == "fitgpt":
        check_fitgpt(words[1:], whole)
    elif words[0] == "torchrun":
        check_torchrun(words[1:], whole)
    elif words[:3] == ["python", "-m", "fitgpt"]:
        check_fitgpt(words[3:], whole)
    elif words[0] == "python" and len(words) > 1 and words[1].endswith(".py"):
        if not (ROOT / words[1]).is_file():
            raise AssertionError(f"{words[1]} does not exist")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses_with_todays_flags(page):
    commands = documented_commands(page.read_text())
    failures = []
    for words, whole in commands:
        try:
            check_command(words, whole)
        except Exception as e:  # noqa: BLE001 - each failure is reported with its command, all at once
            failures.append(f"{shlex.join(words)}\n    {type(e).__name__}: {e}")
    assert failures == [], f"{page.name}: commands that no longer parse:\n" + "\n".join(failures)


def test_the_check_refuses_a_renamed_flag_a_bad_value_and_a_missing_command():
    """The check itself can fail: the two flags renamed before release, a policy and a card that do not exist."""
    for text in ["fitgpt train --ckpt-interval 5", "fitgpt train --checkpointing block",
                 "fitgpt train --activation-checkpointing blok", "fitgpt plan --gpu h300",
                 "fitgpt plan --memory-budget 6 GiB", "fitgpt serve --run runs/tiny",
                 "torchrun --nproc-per-nodes 2 -m fitgpt train", "torchrun --nproc 2 -m fitgpt train", "fitgpt train --max-steps"]:
        words = shlex.split(text)
        with pytest.raises((AssertionError, UserError)):
            check_command(words, whole=True)
    check_command(shlex.split("fitgpt plan ... --compare FILE --memory-budget X"), whole=False)
    check_command(shlex.split("torchrun --nproc-per-node 2 -m fitgpt train --parallel fsdp"), whole=True)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_named_file_resolves(page):
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(target)
    for name in re.findall(r"`((?:src|tests|benchmarks|docs)/[\w./-]+)`", text):
        if not (ROOT / name).exists():
            broken.append(name)
    for name in re.findall(r"`fitgpt/([\w/]+\.py)`", text):
        if not (SRC / name).exists():
            broken.append("fitgpt/" + name)
    assert broken == [], f"{page.name} names what is not there: {broken}"


def test_the_readme_fits_on_a_screen_and_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    guides = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert guides == set(re.findall(r"\]\(docs/([\w-]+\.md)\)", readme))
    for page in (ROOT / "docs").glob("*.md"):  # each guide opens with a command to run
        lang, lines = next(_blocks(page.read_text()))
        assert lang == "bash" and documented_commands(f"```bash\n{lines[0]}\n```\n"), page.name


def _layout_tree() -> str:
    text = (ROOT / "docs" / "layout.md").read_text()
    start = text.index("pyproject.toml")
    return text[start : text.index("```", start)]


def test_the_layout_page_names_every_module_and_preset():
    """A newcomer reads the layout in docs/layout.md: every source file and preset is in its tree, under its folder
    (litgpt keeps the same promise with a test)."""
    tree = _layout_tree()
    folder = None
    listed = set()
    for line in tree.splitlines():
        name = line.strip().split("  ")[0]
        if line.startswith("  ") and not line.startswith("    ") and name.endswith("/"):
            folder = name
        elif line.startswith("    ") and folder:
            listed |= {folder + n.strip() for n in name.split(",")}
        elif line.startswith("  "):
            listed.add(name)
    missing = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py"))
               if p.name != "__init__.py" and str(p.relative_to(SRC)) not in listed]
    assert missing == [], f"add these to docs/layout.md's tree: {missing}"
    presets = {p.stem for p in (SRC / "presets").glob("*.json")}
    named = {n for group in re.findall(r"presets/\{([^}]*)\}\.json", tree) for n in group.split(",")}
    assert presets == named
    gone = [n for n in listed if n.endswith(".py") and not (SRC / n).exists()]
    assert gone == [], f"docs/layout.md's tree names files that do not exist: {gone}"
