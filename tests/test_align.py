"""recipes.align end to end on a tiny model and corpus: aligned setups pass, planted faults are named."""

from __future__ import annotations

import json

import pytest

from lib.align import PROFILES, Row, relative_error
from lib.config import ConfigError, load_config
from lib.hf import save_llama
from lib.model import Llama
from lib.train_state import model_loss_sum
from recipes.align import first_batches, main, split_args
from tests.conftest import smoke_overrides
from tests.fast_init import random_module


@pytest.fixture
def corpus(tiny_corpus):
    return tiny_corpus


def on_tiny_corpus(corpus, tmp_path, *extra: str) -> list[str]:
    """The smoke experiment reading the session's tiny prepared corpus."""
    return smoke_overrides(tmp_path / "run", f"data.sources=[{{name:tiny,path:{corpus},weight:1.0}}]", *extra)


def run_align(corpus, tmp_path, *args):
    report = tmp_path / "report.json"
    code = main([*on_tiny_corpus(corpus, tmp_path), "align.steps=2", f"align.report={report}", *args])
    return code, (json.loads(report.read_text()) if report.exists() else None)


def test_identical_setups_align_exactly(corpus, tmp_path, capsys):
    code, report = run_align(corpus, tmp_path)
    assert code == 0 and report["ok"] and report["first_divergence"] is None
    assert all(r["error"] == 0.0 for r in report["rows"])  # same code, same device: bit-identical
    stages = [r["stage"] for r in report["rows"]]
    assert stages == sorted(stages, key=["forward", "loss", "grads", "update", "curve"].index)
    assert sum(s == "curve" for s in stages) == 2
    assert "aligned: every row within tolerance" in capsys.readouterr().out


def test_accumulation_aligns_within_fp32_tolerance(corpus, tmp_path):
    """A single-device setup with a different config: same maths in another summation order."""
    code, report = run_align(corpus, tmp_path, "b.optim.accum_steps=2")
    assert code == 0, report["first_divergence"]
    assert report["profile"].startswith("float32")
    assert "accum=2" in report["setups"]["b"]["description"]
    assert 0 < max(r["error"] for r in report["rows"] if r["stage"] == "grads")  # really a different computation


def test_injected_layer_fault_is_named(corpus, tmp_path, capsys):
    code, report = run_align(corpus, tmp_path, "align.fault=layer_scale:1:1.001")
    assert code == 1 and not report["ok"]
    first = report["first_divergence"]
    assert (first["stage"], first["name"]) == ("forward", "layer 1")
    forward = {r["name"]: r for r in report["rows"] if r["stage"] == "forward"}
    assert forward["layer 0"]["error"] == 0.0 and forward["embed"]["ok"]
    assert "FIRST DIVERGENCE: forward layer 1" in capsys.readouterr().out


def test_bf16_policy_shows_the_expected_gap(corpus, tmp_path):
    """bf16 vs fp32 passes the bf16 profile, but the gap is real: fp32 tolerances would reject it at the embedding."""
    code, report = run_align(corpus, tmp_path, "b.model.compute_dtype=bfloat16")
    assert code == 0, report["first_divergence"]
    assert report["profile"].startswith("bfloat16")
    fp32 = PROFILES["float32"]
    forward = [r for r in report["rows"] if r["stage"] == "forward"]
    assert forward[0]["name"] == "embed" and forward[0]["error"] > fp32.forward  # the first rounding to bf16
    assert 1e-3 < max(r["error"] for r in forward) < PROFILES["bfloat16"].forward


def test_against_transformers_reference_from_imported_weights(corpus, tmp_path):
    """b=hf, both sides starting from an HF folder (align.init_from) with the smoke model's architecture."""
    pytest.importorskip("transformers")
    cfg = load_config(on_tiny_corpus(corpus, tmp_path))
    source = random_module(Llama, cfg.model, seed=3, std=0.1, norm_noise=0.2)
    save_llama(source, cfg.model, tmp_path / "hf")
    code, report = run_align(corpus, tmp_path, "b=hf", f"align.init_from={tmp_path / 'hf'}")
    assert code == 0, report["first_divergence"]
    rows = {(r["stage"], r["name"]): r for r in report["rows"]}
    assert rows[("forward", "logits")]["max_abs"] <= 1e-4
    assert rows[("update", "all leaves")]["skipped"]  # transformers has no optax-identical optimizer
    total, count = model_loss_sum(source, first_batches(cfg, 1)[0], 0.0)
    assert rows[("loss", "loss")]["values"][0] == pytest.approx(float(total / count), rel=1e-6)  # really those weights


def test_bad_arguments_are_user_errors(corpus, tmp_path, capsys):
    assert run_align(corpus, tmp_path, "align.nonsense=1")[0] == 2
    assert run_align(corpus, tmp_path, "b=hf", "b.model.remat=layer")[0] == 2
    assert run_align(corpus, tmp_path, "b.trainer.batch_size=8")[0] == 2
    assert run_align(corpus, tmp_path, "b.model.n_layers=3")[0] == 2
    assert run_align(corpus, tmp_path, "align.fault=layer_scale:7:2")[0] == 2
    assert run_align(corpus, tmp_path, "b.parallel.name=tensor")[0] == 2  # a layout with no builder
    assert run_align(corpus, tmp_path, "align.fault=shift_labels:2")[0] == 2
    assert run_align(corpus, tmp_path, "align.fault=grad_scale:blocks.mlp.nope:0:2")[0] == 2
    assert run_align(corpus, tmp_path, "align.fault=grad_scale:embed:0:2")[0] == 2  # embed has no layers
    err = capsys.readouterr().err
    assert "SETUP_BUILDERS" in err and "known faults" in err and "no array leaf 'blocks.mlp.nope'" in err
    assert "unknown option align.nonsense" in err and "identical batches" in err and "architecture" in err
    assert all(line.startswith("error: ") for line in err.splitlines() if "error" in line)


def test_split_args():
    both, a, b, hf, opts = split_args(["+exp=smoke", "a.model.remat=layer", "+b.foo=1", "b=hf", "align.steps=2"])
    assert both == ["+exp=smoke"] and a == ["model.remat=layer"] and b == ["+foo=1"] and hf and opts == {"steps": "2"}
    with pytest.raises(ConfigError):
        split_args(["model.remat"])


def test_relative_error_and_rows():
    assert relative_error([1.0, 2.0], [1.0, 2.0]) == (0.0, 0.0)
    err, max_abs = relative_error([3.0, 4.0], [3.0, 4.5])
    assert err == pytest.approx(0.1) and max_abs == pytest.approx(0.5)
    assert not Row("forward", "x", float("nan"), 0.0, 1.0).ok  # a NaN never passes
    assert relative_error([1.0], [float("inf")])[0] == float("inf")
