"""Reading pickles that a user hands us without running their code: an unpickler that builds only the types a format
needs (plain data, and the named classes), and refuses anything else, naming it. Used for memory snapshots
(`fitgpt plan --compare`) and for the metadata and small objects of a distributed checkpoint (PyTorch's own reader
unpickles both with ``pickle.load``)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import IO

import torch


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global the format does not need (a function it would call, a class it would build)."""


class _Restricted(pickle.Unpickler):
    def __init__(self, file: IO[bytes], allowed: Callable[[str, str], bool]):
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str):
        if not self._allowed(module, name):
            raise UnsafePickleError(f"it needs {module}.{name}, which this format never holds")
        return super().find_class(module, name)


def load(file: IO[bytes], allowed: Callable[[str, str], bool] = lambda m, n: False) -> object:
    """The object pickled in ``file``, built only from plain data and the globals ``allowed(module, name)`` accepts.
    Raises UnsafePickleError (a pickle.UnpicklingError) for any other, before anything of it is called."""
    return _Restricted(file, allowed).load()


_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_DCP_NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
              ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


def dcp_metadata_global(module: str, name: str) -> bool:
    """What a DCP ``.metadata`` file may name: DCP's metadata dataclasses and enums, where each piece is stored, sizes,
    dtypes and layouts, paths."""
    if module in _DCP_MODULES and not name.startswith("__"):
        return isinstance(getattr(__import__(module, fromlist=[name]), name, None), type)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return True
    return (module, name) in _DCP_NAMES
