import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from fitgpt.data import DataConfig, prepare
from fitgpt.model import ModelConfig

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_FILES = ["textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py", "string.py", "keyword.py", "glob.py"]


def tiny_model_config(**kw) -> ModelConfig:
    base = dict(vocab_size=128, context_length=32, n_embed=32, n_head=4, n_blocks=4, dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A few real Python files: enough text for a tokenizer and a few training steps."""
    d = tmp_path_factory.mktemp("corpus")
    for name in CORPUS_FILES:
        shutil.copy(STDLIB / name, d / name)
    return d


@pytest.fixture(scope="session")
def data_dir(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small-bpe512"
    prepare(DataConfig(dir=str(out), inputs=(str(corpus_dir),), vocab_size=512), progress=False)
    return out


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
