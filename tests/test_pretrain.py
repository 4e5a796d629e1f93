"""End to end: the pretrain recipe on the tiny smoke experiment."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lib.config import load_config
from lib.metrics import read_metrics
from recipes import pretrain
from tests.conftest import ROOT, smoke_overrides


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "smoke"
    cwd = os.getcwd()
    os.chdir(run_dir.parent)  # Hydra must not scatter outputs/ folders into the working directory
    try:
        last = pretrain.train(load_config(smoke_overrides(run_dir, "logger.wandb=offline")))
    finally:
        os.chdir(cwd)
    return run_dir, last


def test_run_writes_metrics_checkpoints_config_and_wandb(finished_run):
    run_dir, last = finished_run
    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 11))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "valid_tokens", "tokens_per_update", "step_time", "mfu"):
        assert key in train_rows[0], key
    assert train_rows[0]["tokens_per_update"] == 4 * 32
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val_rows] == [5, 10]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["10", "5"]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "wandb").is_dir()
    assert not (run_dir.parent / "outputs").exists()
    assert last["step"] == 10


def test_loss_falls_on_the_smoke_run(finished_run):
    run_dir, _ = finished_run
    val = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    assert val[-1] < val[0]


def test_resume_after_losing_the_last_checkpoint_is_bitwise_exact(finished_run, tmp_path):
    run_dir, _ = finished_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "10")  # as if killed between step 5 and 10
    pretrain.train(load_config(smoke_overrides(copy)))
    assert losses(copy) == losses(run_dir)  # steps 6..10 recomputed bit for bit, each logged once


def test_resume_may_change_execution_choices_but_not_the_architecture(finished_run, tmp_path):
    """A run started on one machine resumes on another with its own remat, chunking and attention."""
    run_dir, _ = finished_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "10")
    pretrain.train(load_config(smoke_overrides(copy, "model.attention_block=4", "model.logits_chunk=0", "model.remat=layer",
                                               "model.attention_impl=xla", "model.scan_unroll=2")))
    resumed, original = losses(copy), losses(run_dir)
    assert resumed.keys() == original.keys()
    np.testing.assert_allclose([resumed[k] for k in sorted(resumed)], [original[k] for k in sorted(original)], rtol=1e-5)


def test_profile_window_is_traced_and_named(tmp_path, capsys):
    run_dir = tmp_path / "r"
    pretrain.train(load_config(smoke_overrides(run_dir, "trainer.steps=4", "trainer.profile_start=2", "trainer.profile_steps=1")))
    traces = list((run_dir / "profile" / "process-0").rglob("perfetto_trace.json.gz"))
    assert len(traces) == 1 and f"profile of steps 3-3: {traces[0]}" in capsys.readouterr().err


def test_train_step_compiles_once(monkeypatch, tmp_path):
    steps = []
    real = pretrain.make_train_step

    def spy(*args, **kwargs):
        steps.append(real(*args, **kwargs))
        return steps[-1]

    monkeypatch.setattr(pretrain, "make_train_step", spy)
    kept = []
    monkeypatch.setattr(pretrain, "keep_freed_memory", lambda: kept.append(True))
    pretrain.train(load_config(smoke_overrides(tmp_path / "r", "trainer.steps=4")))
    assert steps[0]._cache_size() == 1
    assert kept == [True]  # trainer.keep_host_memory defaults to on (tests/test_host_memory.py: what it does)


def test_keep_host_memory_false_leaves_malloc_alone(monkeypatch, tmp_path):
    kept = []
    monkeypatch.setattr(pretrain, "keep_freed_memory", lambda: kept.append(True))
    pretrain.train(load_config(smoke_overrides(tmp_path / "r", "trainer.steps=1", "trainer.keep_host_memory=false")))
    assert kept == []


def test_checkpoint_of_another_model_shape_stops_cleanly(finished_run, capsys):
    run_dir, _ = finished_run
    before = {p: p.stat().st_mtime for p in (run_dir / "checkpoints").rglob("*")}
    code = pretrain.main(smoke_overrides(run_dir, "model.d_model=128"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: checkpoint") and "different model shape" in err[-1]
    assert {p: p.stat().st_mtime for p in (run_dir / "checkpoints").rglob("*")} == before


def test_corpus_with_tokens_beyond_the_vocabulary_stops_cleanly(tiny_corpus, tmp_path, capsys):
    source = f"data.sources=[{{name: tiny, path: {tiny_corpus}}}]"
    code = pretrain.main(smoke_overrides(tmp_path / "r", source, "model.vocab_size=64"))
    assert code == 2 and "set model.vocab_size>=" in capsys.readouterr().err


def test_missing_corpus_stops_cleanly(tmp_path, capsys):
    code = pretrain.main(smoke_overrides(tmp_path / "r", f"data.sources=[{{name: x, path: {tmp_path / 'none'}}}]"))
    assert code == 2 and "no prepared corpus" in capsys.readouterr().err


def test_cli_typo_is_one_line_and_nonzero(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.pretrain", "+exp=smoke", "trainer.stepz=3", f"run_dir={tmp_path / 'r'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "stepz" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_without_a_progress_bar_a_line_is_printed_every_log_every_steps(tmp_path, capsys):
    pretrain.train(load_config(smoke_overrides(tmp_path / "r", "trainer.steps=4", "trainer.log_every=2", "trainer.eval_every=100")))
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("step ") and "tokens/s" in l]
    assert [l.split(":")[0] for l in lines] == ["step 2", "step 4"]
