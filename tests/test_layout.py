"""The code's shape: lint-clean, and imports that run one way between the package's parts."""

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
