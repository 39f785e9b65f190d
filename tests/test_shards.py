"""Streaming preparation: token shards, the document-level split, resuming after a kill, the loader across shards."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest

from fitgpt.data.config import DataConfig
from fitgpt.data.loader import BatchSampler, TokenData
from fitgpt.data.prepare import ensure_prepared, prepare
from fitgpt.data.shards import PROGRESS_FILE, ShardWriter, StaleProgress, load_progress, save_progress
from fitgpt.errors import UserError


@pytest.fixture(scope="module")
def records(corpus_dir, tmp_path_factory):
    """A JSON Lines corpus of 114 records: the test corpus's files cut every 20 lines."""
    texts = []
    for p in sorted(corpus_dir.iterdir()):
        lines = p.read_text().splitlines(keepends=True)
        texts += ["".join(lines[i : i + 20]) for i in range(0, len(lines), 20)]
    path = tmp_path_factory.mktemp("records") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path, texts


def cfg(records, data_dir, out, **kw) -> DataConfig:
    return DataConfig(dir=str(out), inputs=(str(records[0]),), tokenizer=str(data_dir / "tokenizer.json"), **kw)


def files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != ".fitgpt-lock"}


def documents(out, split):
    """The split's documents, as token tuples in stream order."""
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta["shards"][split]])
    ends = np.flatnonzero(tokens == meta["eot_id"])
    return [tuple(tokens[a + 1 : b].tolist()) for a, b in zip([-1, *ends[:-1]], ends)]


def test_shards_hold_whole_documents_and_the_split_is_by_document(records, data_dir, tmp_path):
    one = prepare(cfg(records, data_dir, tmp_path / "one", val_fraction=0.1), progress=False)
    many = prepare(cfg(records, data_dir, tmp_path / "many", val_fraction=0.1, shard_tokens=500), progress=False)
    assert len(one["shards"]["train"]) == 1 and len(many["shards"]["train"]) > 10
    for split in ("train", "val"):
        # The same documents in the same order, however they are cut into shards...
        assert documents(tmp_path / "one", split) == documents(tmp_path / "many", split)
        for s in many["shards"][split]:  # ...each shard ending at a document's end, past 500 tokens but the last
            tokens = np.fromfile(tmp_path / "many" / s["file"], dtype=many["dtype"])
            assert tokens[-1] == many["eot_id"] and len(tokens) == s["tokens"]
        assert all(s["tokens"] >= 500 for s in many["shards"][split][:-1])
    # Whole documents on each side, about a tenth of them held out, drawn by the seed.
    tok = TokenData(tmp_path / "one")
    assert one["split"] == "documents" and one["documents"] == len(records[1])
    assert 0 < one["val_documents"] < one["documents"]  # about a tenth: the names hold the test's random tmp path
    import importlib

    draw = importlib.import_module("fitgpt.data.prepare")._draw
    held = [draw(1337, "val", f"corpus.jsonl#{i}") < 0.1 for i in range(20000)]
    assert abs(sum(held) / len(held) - 0.1) < 0.01  # 4.7 standard deviations
    assert len(documents(tmp_path / "one", "val")) == one["val_documents"]
    assert tok.meta == one
    other = prepare(cfg(records, data_dir, tmp_path / "seed", val_fraction=0.1, seed=7), progress=False)
    assert set(documents(tmp_path / "seed", "val")) != set(documents(tmp_path / "one", "val"))
    assert other["train_tokens"] + other["val_tokens"] == one["train_tokens"] + one["val_tokens"]


def test_a_resumed_shard_closes_without_a_new_token_cut_back_to_its_checkpoint(tmp_path):
    """Found by the random-kill test: a preparation killed after its last checkpoint wrote more tokens to a split's open
    shard, and resumed; that split got no token before the input ended, and closing its shard crashed (no open file)."""
    dtype = np.dtype(np.uint16)
    path = tmp_path / "val_000000.bin"
    path.write_bytes(np.arange(10, dtype=dtype).tobytes())  # 6 tokens committed, 4 written after the checkpoint
    w = ShardWriter(tmp_path, "val", dtype, shard_tokens=100, open_tokens=6)
    w.close_shard()
    assert w.shards == [{"file": "val_000000.bin", "tokens": 6}] and w.open_tokens == 0
    assert np.fromfile(path, dtype=dtype).tolist() == list(range(6))


def test_too_few_documents_hold_out_the_last_tokens(corpus_dir, data_dir, tmp_path):
    meta = prepare(DataConfig(dir=str(tmp_path / "d"), inputs=(str(corpus_dir / "glob.py"),),
                              tokenizer=str(data_dir / "tokenizer.json")), progress=False)
    total = meta["train_tokens"] + meta["val_tokens"]
    assert meta["split"] == "last tokens" and meta["val_tokens"] == int(total * 0.05) and meta["documents"] == 1
    TokenData(tmp_path / "d").check_context(32)


def test_windows_run_across_shards_so_that_short_shards_are_drawn_too():
    """Shards read as one stream: each start equally likely, windows continuing into the next shards. Before,
    windows stayed inside one shard, and shards shorter than a window were never drawn (the 3-token one here;
    with --shard-tokens 50 at context 512, 67% of the train tokens)."""
    shards = [np.arange(0, 10, dtype=np.uint16), np.arange(10, 13, dtype=np.uint16), np.arange(13, 20, dtype=np.uint16)]
    s = BatchSampler(shards, 64, 4, seed=0)
    starts, seen = set(), set()
    for _ in range(20):
        x, y = s.next_batch()
        assert ((x[:, 1:] - x[:, :-1]) == 1).all() and (y == x + 1).all()  # contiguous in the stream
        starts |= set(x[:, 0].tolist())
        seen |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert starts == set(range(0, 16)) and seen == set(range(20))  # every start, every token
    tiny = BatchSampler([np.arange(i * 3, i * 3 + 3, dtype=np.uint16) for i in range(10)], 8, 16, seed=1)
    x, y = tiny.next_batch()  # windows across six 3-token shards
    assert ((x[:, 1:] - x[:, :-1]) == 1).all() and (y == x + 1).all()
    # One shard: exactly the draws of the single-array sampler before shards.
    tokens = np.arange(1000, dtype=np.uint16)
    rng = np.random.Generator(np.random.PCG64(5))
    ix = rng.integers(0, len(tokens) - 8, size=3)
    assert (BatchSampler([tokens], 3, 8, seed=5).next_batch()[0].numpy() == np.stack([tokens[i : i + 8] for i in ix])).all()


def test_a_resumed_shard_drops_what_was_written_after_its_checkpoint(tmp_path):
    dtype = np.dtype(np.uint16)
    w = ShardWriter(tmp_path, "val", dtype, shard_tokens=10)
    assert w.write(np.arange(4, dtype=dtype), doc_end=True) is False
    save_progress(tmp_path, {"val": w}, state := {})
    w.write(np.arange(50, 53, dtype=dtype), doc_end=False)  # after the checkpoint: on disk, then a kill
    w.flush()
    w.close()
    resumed = ShardWriter(tmp_path, "val", dtype, 10, **load_progress(tmp_path)[0]["splits"]["val"])
    assert resumed.write(np.arange(10, 17, dtype=dtype), doc_end=True) is True  # 11 tokens: the shard closes
    assert np.fromfile(tmp_path / "val_000000.bin", dtype).tolist() == [0, 1, 2, 3, *range(10, 17)]
    assert resumed.shards == [{"file": "val_000000.bin", "tokens": 11}] and state["splits"]["val"]["open_tokens"] == 4
    (tmp_path / "val_000000.bin").write_bytes(b"\0" * 4)  # a closed shard that changed: no resuming from it
    with pytest.raises(StaleProgress, match="val_000000.bin holds 4 bytes, not the 22"):
        ShardWriter(tmp_path, "val", dtype, 10, shards=resumed.shards)


SLOW = textwrap.dedent("""
    import importlib, sys, time
    from fitgpt.data import tokenizer
    prepare = importlib.import_module("fitgpt.data.prepare")  # the module (the package exports the function)
    prepare._batches.__defaults__ = (4 << 20, 4)  # batches of 4 documents: many moments to be killed at
    real = tokenizer.Tokenizer.encode_batch
    def slow(self, texts):
        time.sleep(0.05)
        return real(self, texts)
    tokenizer.Tokenizer.encode_batch = slow
    from fitgpt.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def kill_at_random(args, out, rng) -> None:
    """Start a slowed `fitgpt prepare`, SIGKILL it at a random moment after its first closed shard."""
    p = subprocess.Popen([sys.executable, "-c", SLOW, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    progress = out / ".partial" / PROGRESS_FILE
    deadline = time.time() + 60
    while not (progress.is_file() and json.loads(progress.read_text())["journaled"]["shards"].get("train")):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 0.4))
    assert p.poll() is None, "finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "meta.json").exists()  # nothing that looks complete


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_a_preparation_killed_at_random_resumes_to_the_same_bytes(records, data_dir, tmp_path, capsys, test_rng):
    from fitgpt.cli import main

    # Shards larger than a file buffer, so that a kill finds bytes on disk past the last checkpoint.
    ref = tmp_path / "ref"
    prepare(cfg(records, data_dir, ref, shard_tokens=6000), progress=False)
    out = tmp_path / "out"
    args = ["prepare", "--inputs", str(records[0]), "--dir", str(out), "--tokenizer", str(data_dir / "tokenizer.json"),
            "--shard-tokens", "6000"]
    kill_at_random(args, out, test_rng)
    with pytest.raises(UserError, match="the interrupted preparation in .* was made with other shard_tokens .*without --resume"):
        prepare(cfg(records, data_dir, out, shard_tokens=7000), progress=False, resume=True)
    with pytest.raises(UserError, match="meta.json is missing"):
        TokenData(out)
    kill_at_random([*args, "--resume"], out, test_rng)  # killed again, while resuming
    assert main([*args, "--resume"]) == 0
    assert "resuming the preparation" in capsys.readouterr().err
    assert files(out) == files(ref)  # every shard, the tokenizer and meta.json, byte for byte


@pytest.mark.slow
def test_training_resumes_an_interrupted_first_preparation(records, data_dir, tmp_path, caplog):
    out = tmp_path / "out"
    args = ["prepare", "--inputs", str(records[0]), "--dir", str(out), "--tokenizer", str(data_dir / "tokenizer.json"),
            "--shard-tokens", "500"]
    kill_at_random(args, out, random.Random(1))
    with caplog.at_level(logging.INFO, logger="fitgpt.data.prepare"):
        _, meta = ensure_prepared(cfg(records, data_dir, out, shard_tokens=500), progress=False)
    assert "resuming the preparation" in caplog.text and not (out / ".partial").exists()
    ref = prepare(cfg(records, data_dir, tmp_path / "ref", shard_tokens=500), progress=False)
    assert meta == ref
    # Without --resume an interrupted preparation starts over, and says how to keep it next time.
    kill_at_random([*args[:3], "--dir", str(tmp_path / "again"), *args[5:]], tmp_path / "again", random.Random(2))
    with caplog.at_level(logging.WARNING, logger="fitgpt.data.prepare"):
        prepare(cfg(records, data_dir, tmp_path / "again", shard_tokens=500), progress=False)
    assert "discarding the interrupted preparation" in caplog.text and "--resume continues one" in caplog.text
    assert files(tmp_path / "again") == files(tmp_path / "ref")
    # Training asked for other settings than the interrupted preparation had: it starts over, and says so.
    kill_at_random([*args[:3], "--dir", str(tmp_path / "other"), *args[5:]], tmp_path / "other", random.Random(3))
    with caplog.at_level(logging.WARNING, logger="fitgpt.data.prepare"):
        _, meta = ensure_prepared(cfg(records, data_dir, tmp_path / "other", shard_tokens=500, val_fraction=0.2), progress=False)
    assert "was made with other val_fraction (0.05, now 0.2); starting over" in caplog.text and meta["val_fraction"] == 0.2


def test_data_prepared_before_shards_is_refused_and_re_prepared(data_dir, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(data_dir, old)
    meta = json.loads((old / "meta.json").read_text())
    for split in ("train", "val"):
        (old / meta["shards"][split][0]["file"]).rename(old / f"{split}.bin")
    del meta["shards"]
    meta["format_version"] = 1
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=f"format 1 .*re-run `fitgpt prepare --dir {old}`"):
        TokenData(old)
    # Re-preparing it replaces the old files with shards.
    new = prepare(DataConfig(dir=str(old), inputs=tuple(meta["inputs"]), vocab_size=512), progress=False)
    assert not (old / "train.bin").exists() and sorted(p.name for p in old.glob("*.bin")) == ["train_000000.bin", "val_000000.bin"]
    assert TokenData(old).meta == new


class FakeDataset:
    """What fitgpt uses of a `datasets.Dataset`."""

    def __init__(self, rows):
        self.rows, self.column_names = rows, ["text"]
        self.data = types.SimpleNamespace(column=lambda name: types.SimpleNamespace(nbytes=sum(len(r.encode()) for r in rows)))

    def select_columns(self, columns):
        return self

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, s):
        return {"text": self.rows[s]}


def test_hf_datasets_are_read_from_the_local_cache_only(monkeypatch, data_dir, tmp_path, records):
    calls = []

    def load_dataset(name, split):
        calls.append((name, os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE")))
        if name != "me/cached":
            raise FileNotFoundError(f"Couldn't find cache for {name}")
        return FakeDataset(records[1])

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    tok = str(data_dir / "tokenizer.json")
    with pytest.raises(UserError, match=r"'me/absent' is not in the local cache .*reads hf: inputs offline.*\.jsonl, \.parquet"):
        prepare(DataConfig(dir=str(tmp_path / "a"), inputs=("hf:me/absent",), tokenizer=tok), progress=False)
    assert calls[-1] == ("me/absent", "1", "1")
    prepare(DataConfig(dir=str(tmp_path / "hf"), inputs=("hf:me/cached",), tokenizer=tok), progress=False)
    prepare(cfg(records, data_dir, tmp_path / "jsonl"), progress=False)
    assert sorted(documents(tmp_path / "hf", "train") + documents(tmp_path / "hf", "val")) == \
        sorted(documents(tmp_path / "jsonl", "train") + documents(tmp_path / "jsonl", "val"))


def test_the_tokenizer_sample_is_drawn_evenly_across_inputs(records, tmp_path):
    """Two inputs of the same size and a sample of a third of the corpus: each input gives a fair share of it
    (the first documents in reading order would all be the first input's), within the limit, the same every time."""
    import importlib

    prep = importlib.import_module("fitgpt.data.prepare")
    from fitgpt.data.corpus import list_inputs

    texts = records[1] * 3
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name}: {t}"}) + "\n" for t in texts))
    config = DataConfig(dir=str(tmp_path / "d"), inputs=(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")))
    items = list_inputs(list(config.inputs))
    total = 2 * sum(len(t.encode()) + 3 for t in texts)
    draws = []
    for _ in range(2):
        sample = prep._Sample(config, items, limit=total // 3, total=total)
        draws.append(list(sample))
        assert sample.bytes <= total // 3 and sample.documents == len(draws[-1])
    assert draws[0] == draws[1]
    from_b = sum(t.startswith("b: ") for t in draws[0]) / len(draws[0])
    assert 0.3 < from_b < 0.7, from_b
