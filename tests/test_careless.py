"""The faults a careless day brings: reused and shared run directories, foreign data folders, pathological text,
changed inputs, a really full disk during prepare, read-only folders, Ctrl-C during prepare. Each test failed on
the code before its fix. (Checkpoint files, malformed or past step 999,999: test_checkpoint_files.py.)"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hang import guard

from fitgpt.cli import main
from fitgpt.data.config import DataConfig
from fitgpt.data.prepare import ensure_prepared, prepare
from fitgpt.data.tokenizer import MAX_PIECE, train_bpe
from fitgpt.errors import UserError
from fitgpt.train import checkpoint as ckpt
from fitgpt.train.trainer import train
from fitgpt.utils import DirLock


def cli(args):
    """The exit code of `fitgpt ARGS`, also when the flag parser exits by itself."""
    try:
        return main(args)
    except SystemExit as e:
        return e.code


def snapshot(run):
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != DirLock.FILE}


# ---- 1. a fresh run never overwrites an earlier one ---------------------------------------------------

def test_fresh_train_into_an_existing_run_is_refused_and_changes_nothing(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_train_args(run, steps=4)) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(cli_train_args(run, steps=4)) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume latest" in err and "--overwrite" in err and "Traceback" not in err
    assert snapshot(run) == before


def test_overwrite_removes_only_what_the_earlier_run_wrote(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_train_args(run, steps=4)) == 0
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "README").write_text("mine too")
    old = (run / "checkpoints" / "step_00000004" / ckpt.MODEL_FILE).read_bytes()
    assert main([*cli_train_args(run, steps=2), "--overwrite"]) == 0
    assert (run / "notes.txt").read_text() == "mine" and (run / "checkpoints" / "README").read_text() == "mine too"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_00000002"]
    err = capsys.readouterr().err
    assert "removed the earlier run's config.json, metrics.jsonl" in err and "checkpoints/step_00000004" in err
    assert old != (run / "checkpoints" / "step_00000002" / ckpt.MODEL_FILE).read_bytes()
    assert cli([*cli_train_args(run, steps=2), "--overwrite", "--resume", "latest"]) == 2


def test_config_json_of_an_overwritten_run_resumes(cli_train_args, tmp_path):
    run = tmp_path / "run"
    assert main([*cli_train_args(run, steps=2), "--overwrite"]) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["overwrite"] is False and saved["resume"] is None
    assert main(["train", "--config", str(run / "config.json"), "--resume", "latest", "--max-steps", "4"]) == 0


# ---- 2. one process per run directory --------------------------------------------------------------

def hold_lock(directory):
    """Another process that holds ``directory``'s lock until killed."""
    code = (f"from fitgpt.utils import DirLock; import time\nwith DirLock({str(directory)!r}, '--out-dir'):\n"
            "    print('held', flush=True)\n    time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_trainer_on_a_locked_run_directory_exits_2_naming_the_holder(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        assert main(cli_train_args(run, steps=2)) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"in use by another fitgpt process (pid {holder.pid})" in err and "--out-dir" in err
    assert not (run / "checkpoints").exists() and not (run / "config.json").exists()


def test_the_lock_of_a_killed_process_is_released(tmp_path):
    run = tmp_path / "run"
    p = hold_lock(run)
    with pytest.raises(UserError, match=f"pid {p.pid}"):
        DirLock(run, "--out-dir").__enter__()
    p.kill()
    p.wait()
    with DirLock(run, "--out-dir"):
        pass


@pytest.mark.slow
def test_two_trainers_started_together_one_trains_the_other_is_refused(cli_train_args, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code = f"import sys\nfrom fitgpt.cli import main\nsys.exit(main({cli_train_args(run, steps=6)!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=guard(300)), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    assert "in use by another fitgpt process" in loser or "already holds a run" in loser
    assert [p.name for p in ckpt.list_checkpoints(run)][-1] == "step_00000006"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # written by one trainer only


# ---- 3. prepare writes only where it may ------------------------------------------------------------

def test_prepare_refuses_a_folder_with_files_it_did_not_write(corpus_dir, tmp_path, capsys):
    d = tmp_path / "someone"
    d.mkdir()
    (d / "meta.json").write_text('{"owner": "someone"}')
    (d / "train.bin").write_bytes(b"precious")
    assert main(["prepare", "--inputs", str(corpus_dir), "--dir", str(d), "--vocab-size", "300"]) == 2
    assert "holds files fitgpt did not write (meta.json, train.bin)" in capsys.readouterr().err
    assert (d / "train.bin").read_bytes() == b"precious" and json.loads((d / "meta.json").read_text()) == {"owner": "someone"}


def test_prepare_refuses_a_run_directory_and_a_data_dir_shared_with_the_run(make_cfg, corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    train(make_cfg(run, max_steps=3))
    tok = (run / "tokenizer.json").read_bytes()
    assert main(["prepare", "--inputs", str(corpus_dir), "--dir", str(run), "--vocab-size", "300"]) == 2
    assert "holds files fitgpt did not write" in capsys.readouterr().err and (run / "tokenizer.json").read_bytes() == tok
    with pytest.raises(UserError, match="is a prepared data directory"):
        train(make_cfg(tmp_path / "both", data={"dir": str(tmp_path / "both"), "inputs": [str(corpus_dir)], "vocab_size": 300}))


def test_prepare_rewrites_its_own_folder(corpus_dir, tmp_path):
    d = tmp_path / "data"
    prepare(DataConfig(dir=str(d), inputs=(str(corpus_dir),), vocab_size=300), progress=False)
    meta = prepare(DataConfig(dir=str(d), inputs=(str(corpus_dir / "glob.py"),), vocab_size=300), progress=False)
    assert json.loads((d / "meta.json").read_text())["train_tokens"] == meta["train_tokens"]
    assert not list(d.glob("*.tmp"))


# ---- 4. text without whitespace ---------------------------------------------------------------------

def test_pre_tokens_are_capped_so_bpe_training_is_linear():
    tok = train_bpe(["ACGT" * 10, "hello world"], 300)
    pieces = tok._tok.pre_tokenizer.pre_tokenize_str("A" * 1000 + " " * 300 + "x")
    assert max(len(p) for p, _ in pieces) <= MAX_PIECE + 1  # a leading space may join a capped run


@pytest.mark.timeout(120)
def test_prepare_of_half_a_megabyte_without_whitespace_finishes(tmp_path):
    rng = random.Random(0)
    (tmp_path / "dna.txt").write_text("".join(rng.choice("ACGT") for _ in range(500_000)))
    meta = prepare(DataConfig(dir=str(tmp_path / "d"), inputs=(str(tmp_path / "dna.txt"),), vocab_size=512), progress=False)
    assert meta["train_tokens"] > 0  # took more than 150 s before the cap


def test_long_documents_encode_in_pieces_to_the_same_tokens(corpus_dir):
    rng = random.Random(1)
    text = (corpus_dir / "textwrap.py").read_text() + "".join(rng.choice("ACGT \n") for _ in range(20_000)) + "Z" * 500
    tok = train_bpe([text], 400)
    pieces = tok.split_long(text, size=997)
    assert len(pieces) > 20 and "".join(pieces) == text
    assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text)


# ---- 5. changed inputs are noticed -------------------------------------------------------------------

def test_changed_inputs_are_refused_and_a_touch_is_not_a_change(corpus_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(corpus_dir, src)
    cfg = DataConfig(inputs=(str(src),), vocab_size=300, dir=str(tmp_path / "d"))
    ensure_prepared(cfg, progress=False)
    ensure_prepared(cfg, progress=False)
    os.utime(src / "glob.py")  # touched, same contents
    ensure_prepared(cfg, progress=False)
    (src / "glob.py").write_text((src / "glob.py").read_text().replace("def ", "def  "))
    with pytest.raises(UserError, match=r"inputs changed since .*glob.py \(changed\).*fitgpt prepare --dir"):
        ensure_prepared(cfg, progress=False)
    prepare(cfg, progress=False)
    (src / "new.py").write_text("x = 1\n")
    (src / "heapq.py").unlink()
    with pytest.raises(UserError, match=r"new.py \(new\).*heapq.py \(removed\)|heapq.py \(removed\).*new.py \(new\)"):
        ensure_prepared(cfg, progress=False)


# ---- 6. a BPE that learns fewer tokens than asked ------------------------------------------------------

def test_a_small_corpus_trains_twice_and_resumes(cli_train_args, corpus_dir, tmp_path):
    small = tmp_path / "small.py"
    small.write_text((corpus_dir / "keyword.py").read_text() + (corpus_dir / "colorsys.py").read_text())
    args = ["train", "--data.inputs", str(small), "--data.dir", str(tmp_path / "d"), "--data.vocab-size", "2048",
            "--model.context-length", "8", "--model.n-embed", "32", "--model.n-blocks", "1", "--batch-size", "2",
            "--max-steps", "2", "--eval-batches", "1", "--no-progress", "--no-tensorboard"]
    assert main([*args, "--out-dir", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["vocab_size"] < 2048
    assert main([*args, "--out-dir", str(tmp_path / "b")]) == 0
    assert main([*args, "--out-dir", str(tmp_path / "b"), "--resume", "latest", "--max-steps", "3"]) == 0


# ---- 7. a really full disk ---------------------------------------------------------------------------

def test_prepare_on_a_full_disk_is_a_clear_error_and_leaves_no_temp(corpus_dir, tmpfs, capsys):
    fs = tmpfs("64k")
    assert main(["prepare", "--inputs", str(corpus_dir), "--dir", str(fs / "d"), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert "could not write the prepared data" in err and "No space left on device" in err and "Traceback" not in err
    assert not list((fs / "d").glob("*.tmp")) and not (fs / "d" / "meta.json").exists()


# ---- 8. read-only folders and unusable generate input ----------------------------------------------

def test_read_only_out_dir_and_data_dir_are_one_line_errors(cli_train_args, corpus_dir, tmpfs, capsys):
    ro = tmpfs("1m", ro=True)
    assert main(cli_train_args(ro / "run", steps=2)) == 2
    err = capsys.readouterr().err
    assert "cannot write to" in err and "--out-dir" in err and "Traceback" not in err
    assert main(["prepare", "--inputs", str(corpus_dir), "--dir", str(ro / "d")]) == 2
    err = capsys.readouterr().err
    assert "cannot write to" in err and "--dir" in err


def test_generate_refuses_prompts_and_parameters_it_cannot_use(make_cfg, tmp_path, capsys):
    run = tmp_path / "run"
    train(make_cfg(run, max_steps=3))
    assert cli(["generate", "--run", str(run), "--prompt", "caf\udcc3", "--max-new-tokens", "2"]) == 2
    assert "--prompt is not valid UTF-8" in "".join(capsys.readouterr())
    assert cli(["generate", "--run", str(run), "--temperature", "inf", "--max-new-tokens", "2"]) == 2
    assert "set --temperature" in "".join(capsys.readouterr())
    assert main(["generate", "--run", str(run), "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "--checkpoint" in capsys.readouterr().err


# ---- weak spots ------------------------------------------------------------------------------------

def test_resume_with_changed_settings_says_which(make_cfg, tmp_path, caplog):
    run = tmp_path / "run"
    train(make_cfg(run))
    caplog.clear()
    train(make_cfg(run, resume="latest", max_steps=9, batch_size=8, optim={"lr": 1e-3}))
    assert "resuming with changed settings (batch_size 4 -> 8, max_steps 6 -> 9, optim.lr 0.003 -> 0.001)" in caplog.text
    caplog.clear()
    train(make_cfg(run, resume="latest", max_steps=12, batch_size=8, optim={"lr": 1e-3}))
    assert "changed settings (max_steps 9 -> 12)" in caplog.text


def test_max_steps_at_the_checkpoint_is_nothing_to_do_and_changes_nothing(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_train_args(run, steps=4)) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main([*cli_train_args(run, steps=4), "--resume", "latest"]) == 2
    assert "nothing to train; raise --max-steps" in capsys.readouterr().err
    assert snapshot(run) == before


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_ctrl_c_during_prepare_exits_130_in_one_line_and_leaves_nothing_half_written(corpus_dir, tmp_path):
    d = tmp_path / "d"
    slow = textwrap.dedent("""
        import signal, sys, time
        # Ctrl-C as in a terminal, even when the suite runs in the background (where a shell starts children
        # with SIGINT ignored, and Python then installs no KeyboardInterrupt handler).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from fitgpt.data import tokenizer
        real = tokenizer.Tokenizer.encode_batch
        def slow(self, texts):
            print("encoding", flush=True)
            time.sleep(2)  # long enough that the signal lands during it, however late the test sends it
            return real(self, texts)
        tokenizer.Tokenizer.encode_batch = slow
        from fitgpt.cli import main
    """) + f"sys.exit(main(['prepare', '--inputs', {str(corpus_dir)!r}, '--dir', {str(d)!r}, '--vocab-size', '300']))"
    p = subprocess.Popen([sys.executable, "-c", slow], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "encoding"
    time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=guard(60))
    assert p.returncode == 130, err
    assert "fitgpt prepare: interrupted" in err and "--resume` continues it" in err and "Traceback" not in err
    assert not list(d.glob("*.tmp")) and not (d / "meta.json").exists()
    assert main(["prepare", "--inputs", str(corpus_dir), "--dir", str(d), "--vocab-size", "300", "--resume"]) == 0
    assert (d / "meta.json").is_file() and not (d / ".partial").exists()
