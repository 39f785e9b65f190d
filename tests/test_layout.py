"""The code's shape: lint-clean, imports that run one way between the package's parts, and light settings (the
layout page's tree is checked in test_docs.py)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "fitgpt"


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    result = subprocess.run([str(ruff), "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _imports() -> dict[str, set[str]]:
    """For each part of the package (a subpackage or a top-level module), the other parts it imports."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        part = rel.parts[0] if len(rel.parts) > 1 else rel.name
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(
                node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                if name.startswith("fitgpt."):
                    target = name.split(".")[1]
                    if target != part:
                        graph.setdefault(part, set()).add(target)
        graph.setdefault(part, set())
    return graph


def test_imports_run_one_way():
    graph = _imports()
    assert "activation_checkpoint" not in graph["model"] and "model" not in graph["activation_checkpoint"]
    assert "train" not in graph["plan"] and "plan" not in graph["train"]
    # Modelling a step, then deciding from it, then measuring against it: estimate <- plan <- bench.
    assert not graph["estimate"] & {"plan", "bench", "train", "data"}
    assert not graph["plan"] & {"bench", "train", "data"}
    assert not graph["bench"] & {"train", "data"}
    assert not graph["train"] & {"estimate", "bench"}
    assert all("cli" not in deps for part, deps in graph.items() if part not in ("cli", "__main__"))
    # No cycle between parts: a depth-first walk never meets a part on its own path.
    def walk(part, path):
        assert part not in path, " -> ".join([*path, part])
        for dep in graph.get(part, ()):
            walk(dep, [*path, part])

    for part in graph:
        walk(part, [])


@pytest.mark.slow  # a Python and torch start-up, 3 s here: the quick loop leaves it to the full suite
def test_the_settings_load_nothing_heavy():
    """The training config is read by every part (the planner, the CLI, the loop): loading it must not pull in the
    data pipeline, the tokenizer library or the flag parser (before: all three, and tqdm through the pipeline)."""
    code = ("import sys, fitgpt.config, fitgpt.optim, fitgpt.plan.solver; "
            "print(' '.join(m for m in ('tokenizers', 'tyro', 'fitgpt.data.prepare', 'fitgpt.data.corpus') "
            "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def _module_imports() -> dict[str, set[str]]:
    """For each module, the package's modules it imports anywhere in it (at the top, in a function, for type checks)."""
    graph: dict[str, set[str]] = {}
    modules = {".".join(("fitgpt",) + p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
               for p in SRC.rglob("*.py")}
    for path in SRC.rglob("*.py"):
        name = ".".join(("fitgpt",) + path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fitgpt"):
                for alias in node.names:  # `from fitgpt.x import y`: module y if it is one, else x
                    deps.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
        deps.discard(name)
    return {m: {d for d in deps if d in modules and not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_two_modules_import_each_other_around_a_circle():
    """Module by module (a package's __init__ re-exporting its own modules aside): a circle means the type or helper
    both need belongs where both can import it (before: estimate/card.py and estimate/profile.py)."""
    graph = _module_imports()
    done: set[str] = set()

    def walk(module, path):
        assert module not in path, " -> ".join([*path, module])
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            walk(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        walk(module, [])
