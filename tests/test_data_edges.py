"""The careless day, part 4, for data: ids past the vocabulary, formats at the edges and users left stuck in
prepare (moved from test_edges.py, issue 47: files under 400 lines). Each test failed on the code before its fix
(issue 37); "(own)" marks a case found beside the reported one, of the same class."""

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hang import guard
from test_doors import one_line, run_cli

from fitgpt.cli import main
from fitgpt.data.config import DataConfig
from fitgpt.data.loader import BatchSampler, TokenData
from fitgpt.data.prepare import ensure_prepared, prepare
from fitgpt.errors import UserError


def _data_with_a_bad_id(data_dir: Path, out: Path, tokens: int = 1 << 20) -> tuple[Path, int]:
    """A copy of ``data_dir`` whose one train shard holds ``tokens`` ids and one id past the vocabulary, where the
    sampled check of before (64 windows of 4096 from a seeded draw, and the shard's end) never looked; with that id."""
    shutil.copytree(data_dir, out)
    meta = json.loads((out / "meta.json").read_text())
    ids = np.random.default_rng(1).integers(0, meta["vocab_size"], tokens).astype(meta["dtype"])
    seen = np.zeros(tokens, bool)
    for s in np.random.default_rng(0).integers(0, tokens - 4096, size=64):
        seen[s:s + 4096] = True
    seen[-4096:] = True
    bad = meta["vocab_size"] + 3
    ids[int(np.flatnonzero(~seen)[0])] = bad
    for s in meta["shards"]["train"]:
        (out / s["file"]).unlink()
    ids.tofile(out / "train_bad.bin")
    meta["shards"]["train"] = [{"file": "train_bad.bin", "tokens": tokens}]
    meta["train_tokens"] = tokens
    (out / "meta.json").write_text(json.dumps(meta))
    return out / "train_bad.bin", bad


def test_an_out_of_vocabulary_id_anywhere_is_refused_naming_its_shard(data_dir, tmp_path):
    """An id the sampled check did not read reached the embedding as an IndexError on the ranks that drew it: now every
    id of a split this size is read at start (by every rank alike), and every batch drawn is checked besides."""
    path, bad = _data_with_a_bad_id(data_dir, tmp_path / "d")
    with pytest.raises(UserError, match=f"{path.name} holds token id {bad}"):
        TokenData(tmp_path / "d")
    shard = np.fromfile(path, dtype=json.loads((tmp_path / "d" / "meta.json").read_text())["dtype"])
    sampler = BatchSampler([shard[:1000], shard], batch_size=64, context_length=4096, seed=0, vocab_size=bad - 3)
    with pytest.raises(UserError, match=f"holds token id {bad}"):
        for _ in range(200):
            sampler.next_batch()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_torchrun_an_out_of_vocabulary_id_stops_every_rank_in_one_line(data_dir, corpus_dir, tmp_path):
    from test_distributed import torchrun

    _data_with_a_bad_id(data_dir, tmp_path / "d")
    p = torchrun(["train", "--data.dir", str(tmp_path / "d"), "--model.context-length", "32", "--model.n-embed", "32",
                  "--model.n-head", "4", "--model.n-blocks", "2", "--batch-size", "2", "--max-steps", "2", "--out-dir",
                  str(tmp_path / "run"), "--no-progress", "--no-tensorboard"], tmp_path)
    _, err = p.communicate(timeout=guard(240))
    assert p.returncode != 0
    assert err.count("train_bad.bin holds token id") == 2, err[-3000:]  # each rank, one line
    assert "IndexError" not in err and "src/fitgpt" not in err, err[-3000:]  # no traceback of ours


# ---- formats at the edges ---------------------------------------------------------------------------------

DOCS = [{"text": f"def f{i}(x):\n    return x * {i}\n" * 5} for i in range(10)]


@pytest.mark.parametrize("content, documents", [
    ("\ufeff" + json.dumps(DOCS), 10),  # with a byte-order mark: was the raw JSON as one document
    ("\ufeff" + json.dumps(DOCS[:1] + [{"id": 3}]), 1),  # (own) and a record without text among them, counted
])
def test_json_arrays_with_a_byte_order_mark_are_records(content, documents, tmp_path):
    """The records' text is what is tokenized, as the same texts given as files are: never the raw JSON."""
    f = tmp_path / "docs.json"
    f.write_text(content, encoding="utf-8")
    meta = prepare(DataConfig(dir=str(tmp_path / "d"), inputs=(str(f),), vocab_size=300), progress=False)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(DOCS[:documents]):
        (texts / f"{i:02d}.txt").write_text(doc["text"])
    same = prepare(DataConfig(dir=str(tmp_path / "e"), inputs=(str(texts),), vocab_size=300), progress=False)
    assert meta["documents"] == documents
    assert meta["train_tokens"] + meta["val_tokens"] == same["train_tokens"] + same["val_tokens"]


@pytest.mark.parametrize("records, words", [([{"body": "x" * 50}] * 3, "its records have: body"),
                                            ([{"text": 7}] * 3, "hold a number")])  # (own) the field of numbers
def test_a_json_array_without_the_text_field_is_refused_as_jsonl_is(records, words, tmp_path, capsys):
    f = tmp_path / "docs.json"
    f.write_text(json.dumps(records))
    code, err = run_cli(["prepare", "--inputs", str(f), "--dir", str(tmp_path / "d"), "--vocab-size", "300"], capsys)
    assert code == 2 and one_line(err) and words in err and "--text-field" in err, err


def test_a_parquet_text_column_of_numbers_says_so(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), f)
    code, err = run_cli(["prepare", "--inputs", str(f), "--dir", str(tmp_path / "d"), "--vocab-size", "300"], capsys)
    assert code == 2 and one_line(err) and "hold a number" in err and "its records have: text" not in err, err


@pytest.mark.parametrize("data, words", [(b"", None), (gzip.compress(b"")[:3], "cannot be read as gzip")])  # 3 bytes: (own)
def test_an_empty_or_cut_gzip_names_the_input_not_the_disk(data, words, corpus_dir, tmp_path, capsys):
    f = tmp_path / "empty.jsonl.gz"
    f.write_bytes(data)
    args = ["prepare", "--inputs", str(f), str(corpus_dir / "glob.py"), "--dir", str(tmp_path / "d"), "--vocab-size", "300"]
    code, err = run_cli(args, capsys)
    assert "free disk space" not in err
    if words is None:  # empty: skipped as an empty file is
        assert code == 0
        assert json.loads((tmp_path / "d" / "meta.json").read_text())["skipped"].get("empty", 0) == 1
    else:
        assert code == 2 and one_line(err) and words in err and "empty.jsonl.gz" in err


# ---- users left stuck -------------------------------------------------------------------------------------

def test_prepare_never_reads_its_own_output_or_a_run(tmp_path, monkeypatch, capsys):
    """`prepare --inputs . --dir data` folded its meta.json and tokenizer.json into the corpus; training then refused
    ("inputs changed") and preparing again, as advised, looped. (own) a run's metrics.jsonl under the input."""
    monkeypatch.chdir(tmp_path)
    for i in range(10):
        Path(f"f{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / ".fitgpt-run").write_text("")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    args = ["prepare", "--inputs", ".", "--dir", "data", "--vocab-size", "300"]
    assert main(args) == 0 and main(args) == 0  # the second: its own output is there now
    meta = json.loads(Path("data/meta.json").read_text())
    assert meta["documents"] == 10
    ensure_prepared(DataConfig(dir="data", inputs=(".",), vocab_size=300), progress=False)  # no "inputs changed"
    code, err = run_cli(["prepare", "--inputs", "data", "--dir", "other"], capsys)
    assert code == 2 and one_line(err) and "a folder fitgpt wrote" in err


def test_data_prepared_with_a_tokenizer_file_trains_after_the_file_is_gone(data_dir, corpus_dir, tmp_path):
    """Refused ("prepared with tokenizer='tokA.json', but this run asks for 'bpe'"), and naming the data's own copy
    was refused too: the data directory holds its tokenizer, and a run needs nothing else."""
    tok = tmp_path / "tokA.json"
    shutil.copy(data_dir / "tokenizer.json", tok)
    d = tmp_path / "d"
    prepare(DataConfig(dir=str(d), inputs=(str(corpus_dir / "glob.py"),), tokenizer=str(tok)), progress=False)
    tok.unlink()
    ensure_prepared(DataConfig(dir=str(d), inputs=(str(corpus_dir / "glob.py"),)), progress=False)
    ensure_prepared(DataConfig(dir=str(d), inputs=(str(corpus_dir / "glob.py"),), tokenizer=str(d / "tokenizer.json")),
                    progress=False)
    with pytest.raises(UserError, match="--data.tokenizer"):  # another tokenizer is still refused
        ensure_prepared(DataConfig(dir=str(d), inputs=(str(corpus_dir / "glob.py"),), tokenizer="gpt2"), progress=False)
