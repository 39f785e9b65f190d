"""Reading a distributed checkpoint without running code from it. PyTorch's reader unpickles ``dcp/.metadata`` with
``pickle.load`` and each non-tensor entry (an optimizer's hyperparameters) with ``torch.load(weights_only=False)``:
a crafted checkpoint whose meta.json hashes were recomputed would verify, then run its code. Here the metadata is
unpickled allowing only DCP's own metadata types, and every entry is loaded with ``weights_only=True``."""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from fitgpt import safe_pickle
from fitgpt.errors import CheckpointError
from fitgpt.parallel.placement import assign_whole, gather_whole, split_twice


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata may name only DCP's metadata types (else UnsafePickleError, kept in
    ``refused``)."""

    refused: safe_pickle.UnsafePickleError | None = None
    _read: dict | None = None  # each metadata file read, by rank: checked before DCP reads, then not read again

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        self._read = self._read or {}
        if rank not in self._read:
            self._read[rank] = self._unpickle(rank)
        metadata = self._read[rank]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self._read = None  # another checkpoint, maybe

    def _unpickle(self, rank: int | None) -> Metadata:
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = safe_pickle.load(f, safe_pickle.dcp_metadata_global)
            except safe_pickle.UnsafePickleError as e:
                self.refused = e  # DCP rewords what its reader raises; the reason is kept here
                raise
        if not isinstance(metadata, Metadata):
            self.refused = safe_pickle.UnsafePickleError(f"it holds a {type(metadata).__name__}, not DCP's metadata")
            raise self.refused
        return metadata


class _SafeBytes:
    """A load planner's non-tensor entries read with ``weights_only=True`` (plain data, tensors, no code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, _keys_as_held(self.original_state_dict,
                                                                self.mappings[read_item.dest_index.fqn]), obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _keys_as_held(root, path: tuple) -> tuple:
    """``path`` into ``root`` with each key as ``root`` holds it: DCP names a dict's keys by their text, so an optimizer's
    entry of parameter 0 comes back as ``"0"``, and a value that is not a tensor (GaLore's step, a Python int) was
    written beside the int-keyed entry rather than into it, which the next save refused as a duplicated key."""
    held, node = [], root
    for key in path:
        if isinstance(node, dict) and key not in node:
            key = next((k for k in node if str(k) == key), key)
        held.append(key)
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            node = None
    return tuple(held)


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    pass


class _SafeEmptyPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    pass


def load(state: dict, where: str) -> None:
    """``dcp.load`` of ``state`` in place from ``where``: on every rank under torchrun, alone in one process."""
    staged = contiguous(state)
    reader = SafeReader(where)
    with warnings.catch_warnings(), _refusals(reader):  # DCP warns that one process reads alone, as is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(staged, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not dist.is_initialized())
    if staged is not state:
        _restore(state, staged)


def _strided(t) -> bool:
    """A DTensor split in strided shards: over one mesh dimension (GPT-2's heads), or split so and sharded again by FSDP
    (``fitgpt.parallel.split_twice``). FSDP over a contiguous tensor-parallel split also records a strided shard (its
    own, on the data-parallel dimension): its pieces are blocks, which DCP writes and reads as they are."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return (isinstance(t, DTensor) and t.device_mesh.ndim == 1 and isinstance(t.placements[0], _StridedShard)
            or split_twice(t))


@torch.no_grad()
def contiguous(state):
    """``state`` (nested dicts and lists), each DTensor of strided shards in it replaced by a copy in row shards; the
    same object where it holds none. GPT-2's query/key/value matrix split by heads puts rows q_r, k_r and v_r on rank r:
    three pieces of the whole, where DCP takes a rank's piece to be one block. Written and read in row shards, the
    checkpoint holds the matrix as one process does, and any layout reads it."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves, tree_map_only

    if not any(_strided(t) for t in tree_leaves(state)):
        return state
    return tree_map_only(DTensor, lambda t: _in_rows(t) if _strided(t) else t, state)


def _in_rows(t):
    """A strided DTensor's copy in row shards over each of its mesh's dimensions."""
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = [Shard(0)] * t.device_mesh.ndim
    if split_twice(t):  # placed by fitgpt: DTensor's own redistribution takes its pieces out of order
        return distribute_tensor(gather_whole(t), t.device_mesh, rows, src_data_rank=None)
    return t.redistribute(t.device_mesh, rows)


@torch.no_grad()
def _restore(state, staged) -> None:
    """``state``'s entries as read into ``staged`` (``contiguous``'s copy of it): each strided tensor filled in place
    from its row shards, every other entry taken as read."""
    for k in state.keys() if isinstance(state, dict) else range(len(state)):
        mine, read = state[k], staged[k]
        if isinstance(mine, (dict, list)):
            _restore(mine, read)
        elif split_twice(mine):
            assign_whole(mine, read.full_tensor())  # each rank its own rows of the whole, as fitgpt places them
        elif _strided(mine):
            mine.to_local().copy_(read.redistribute(mine.device_mesh, mine.placements).to_local())
        else:
            state[k] = read


def read_whole(where: str, key: str) -> dict:
    """Entry ``key`` of a distributed checkpoint, every tensor whole, read in one process without a model."""
    out: dict = {}
    reader = SafeReader(where)
    with _refusals(reader):
        _load_state_dict(out, storage_reader=reader, planner=_SafeEmptyPlanner(keys={key}), no_dist=True)
    return out[key]


@contextlib.contextmanager
def _refusals(reader: SafeReader):
    """A metadata file the reader refuses is refused before DCP reads it (DCP would log the refusal's traceback and
    look for another); DCP's error for one refused later is replaced by the refusal itself."""
    try:
        reader.read_metadata()
    except safe_pickle.UnsafePickleError:
        raise
    except Exception:  # a missing or damaged file: DCP reports it as it reads
        pass
    try:
        yield
    except (Exception, CheckpointException):
        if reader.refused is not None:
            raise reader.refused from None
        raise


def dcp_cause(e: BaseException) -> BaseException:
    """What went wrong on the first rank that failed, out of DCP's exception for all of them (else ``e`` itself)."""
    failures = e.failures if isinstance(e, CheckpointException) else None
    return next(iter(failures.values()))[0] if failures else e


def one_line(e: BaseException) -> str:
    """The last line of an error's message (a DCP failure's: its cause's), for a one-line report."""
    e = dcp_cause(e)
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]


def refusal(where: str, e: BaseException, what: str) -> CheckpointError:
    """The one-line error of a read that failed: a file that would run code is refused as such, anything else does
    not fit ``what``."""
    cause = dcp_cause(e)
    if isinstance(cause, pickle.UnpicklingError):
        return CheckpointError(f"{where} holds objects other than DCP's metadata, tensors and plain data; refusing to "
                               f"load it ({one_line(cause)})")
    return CheckpointError(f"{where} does not fit {what}: {one_line(cause)}")


def load_model(dcp_dir: Path, state: dict) -> None:
    """Each rank reads the pieces of the shards it holds, whatever world size wrote them (one process: every piece)."""
    where = str(dcp_dir)
    try:
        load({"model": state}, where)
    except (Exception, CheckpointException) as e:  # DCP wraps a rank's failure (a missing key, another shape), on every rank
        raise refusal(where, e, "this model") from None
