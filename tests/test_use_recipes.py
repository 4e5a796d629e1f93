"""End to end on a tiny mixture run: per-source logging, then recipes.evaluate and recipes.generate on its checkpoints."""

import json
import os

import pytest

from lib.config import load_config
from lib.corpus import prepare_corpus, read_documents, split_train_val
from lib.data import resolve_corpora
from lib.metrics import read_metrics
from recipes import evaluate, generate, pretrain
from tests.conftest import smoke_overrides, write_text_files


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """10 smoke steps on stdlib (weight 3) + synthetic text (weight 1) prepared with the stdlib tokenizer."""
    stdlib = resolve_corpora(load_config(["+exp=smoke"]).data, 512)[0]
    src = write_text_files(tmp_path_factory.mktemp("mine-text"), n=8, words=200)
    train, val = split_train_val(list(read_documents([str(src / "*.txt")])), 25)
    mine = tmp_path_factory.mktemp("data") / "mine"
    prepare_corpus(train, val, mine, seq_len=32, vocab_size=512, tokenizer_path=stdlib.tokenizer_path)
    run_dir = tmp_path_factory.mktemp("runs") / "mixed"
    sources = f"data.sources=[{{name: stdlib, path: stdlib, weight: 3}}, {{name: mine, path: {mine}, weight: 1}}]"
    cwd = os.getcwd()
    os.chdir(run_dir.parent)  # keep Hydra's outputs/ out of the repository
    try:
        pretrain.train(load_config(smoke_overrides(run_dir, sources)))
    finally:
        os.chdir(cwd)
    return run_dir, mine


def test_mixture_logs_proportions_per_source_losses_plot_and_tokenizer(mixed_run):
    run_dir, _ = mixed_run
    rows = read_metrics(run_dir)
    last_train = [r for r in rows if "loss" in r][-1]
    assert last_train["mix/stdlib"] == pytest.approx(0.75) and last_train["mix/mine"] == pytest.approx(0.25)
    per_source = [r for r in rows if "val_loss/mine" in r]
    assert [r["step"] for r in per_source] == [5, 10] and all("val_loss/stdlib" in r for r in per_source)
    assert (run_dir / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert (run_dir / "tokenizer.json").is_file()


def test_evaluate_reproduces_the_logged_validation_loss(mixed_run, capsys):
    run_dir, _ = mixed_run
    assert evaluate.main([f"run_dir={run_dir}", "batches=2", "batch_size=4"]) == 0  # = trainer.eval_batches x batch_size
    report = json.loads((run_dir / "eval-step10.json").read_text())
    logged = [r for r in read_metrics(run_dir) if "val_loss/mine" in r and r["step"] == 10][0]
    for name in ("stdlib", "mine"):
        assert report["sources"][name]["loss"] == pytest.approx(logged[f"val_loss/{name}"], rel=1e-5)
        assert 0 < report["sources"][name]["bits_per_byte"] < 10
    assert report["all"]["tokens"] == report["sources"]["stdlib"]["tokens"] + report["sources"]["mine"]["tokens"]
    out = capsys.readouterr().out
    assert "bits/byte" in out and "mine" in out and "all" in out


def test_evaluate_a_chosen_step_on_other_data(mixed_run):
    run_dir, mine = mixed_run
    report = evaluate.evaluate([f"run_dir={run_dir}", "step=5", f"data.sources=[{{name: only, path: {mine}}}]"])
    assert report["step"] == 5 and list(report["sources"]) == ["only"]


def test_evaluate_errors_are_one_line(mixed_run, tmp_path, capsys):
    run_dir, _ = mixed_run
    for argv, message in (
        ([f"run_dir={run_dir}", "step=7"], "no checkpoint of step 7"),
        ([f"run_dir={tmp_path}"], "has no checkpoints/"),
        ([f"run_dir={run_dir}", "model.d_model=128"], "different model shape"),
        ([f"run_dir={run_dir}", "data.seq_lenn=3"], "unknown config key"),
        ([f"run_dir={run_dir}", "data=nosuch"], "no config 'nosuch' in group 'data'"),
        ([f"run_dir={run_dir}", "+exp=smoke"], "keeps its own config"),
    ):
        assert evaluate.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err


def test_generate_streams_greedy_text_reproducibly(mixed_run, capsys):
    run_dir, _ = mixed_run
    argv = [f"run_dir={run_dir}", "prompt=def main():", "max_tokens=12"]
    assert generate.main(argv) == 0
    first = capsys.readouterr().out
    assert generate.main(argv) == 0
    assert capsys.readouterr().out == first and first.startswith("def main():") and len(first) > len("def main():\n")
    assert generate.main(argv[:2] + ["temperature=0.9", "top_k=40", "top_p=0.9", "seed=3", "step=5"]) == 0
    assert generate.main([f"run_dir={run_dir}", "temperature=hot"]) == 2
    assert "is not a float" in capsys.readouterr().err
