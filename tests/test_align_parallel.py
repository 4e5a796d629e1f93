"""recipes.align across layouts on 8 simulated devices (one subprocess, tests/align_on_8_devices.py):
single vs fsdp and single vs a 4-stage pipeline align within fp32 tolerances, and faults planted
under those layouts are named at the right row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, smoke_overrides
from tests.multidevice import subprocess_env


@pytest.fixture(scope="module")
def cases(tmp_path_factory, private_corpus_cache, tiny_corpus):
    out = tmp_path_factory.mktemp("align8")
    # Codegen optimisation off: compiles are the cost here, and both sides compile alike.
    env = subprocess_env(devices=8, JAXPRETRAIN_CACHE=str(private_corpus_cache),
                         XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    base = smoke_overrides(out / "run", f"data.sources=[{{name:tiny,path:{tiny_corpus},weight:1.0}}]")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "align_on_8_devices.py"), str(out), *base],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "cases.json").read_text())


def first(case: dict) -> tuple[str, str] | None:
    row = case["report"]["first_divergence"]
    return row and (row["stage"], row["name"])


@pytest.mark.parametrize("layout, placement", [("fsdp", "mesh data=1 x fsdp=8"),
                                               ("pipeline", "mesh stage=4 x data=1 x fsdp=2")])
def test_layouts_align_with_single_device(cases, layout, placement):
    assert cases["devices"] == 8
    case = cases[layout]
    assert case["code"] == 0 and first(case) is None, case["table"]
    assert placement in case["report"]["setups"]["b"]["description"]
    rows = case["report"]["rows"]
    assert [r["stage"] for r in rows].count("curve") == 2 and "aligned: every row within tolerance" in case["table"]
    # Really another computation (sharded reductions, a pipeline schedule), yet within fp32 tolerances.
    assert max(r["error"] for r in rows if r["stage"] == "grads") > 0


def test_layer_fault_under_fsdp_names_the_layer(cases):
    case = cases["fsdp_layer_fault"]
    assert case["code"] == 1 and first(case) == ("forward", "layer 2")
    assert "FIRST DIVERGENCE: forward layer 2" in case["table"]
    errors = {r["name"]: r["error"] for r in case["report"]["rows"] if r["stage"] == "forward"}
    assert errors["layer 1"] <= 1e-5  # the layers before it still agree across layouts


def test_shifted_labels_under_fsdp_are_caught_at_the_loss(cases):
    case = cases["fsdp_label_fault"]
    assert case["code"] == 1 and first(case) == ("loss", "loss")
    assert all(r["ok"] for r in case["report"]["rows"] if r["stage"] == "forward")  # logits are untouched


def test_gradient_fault_under_pipeline_names_the_leaf_and_layer(cases):
    case = cases["pipeline_grad_fault"]
    assert case["code"] == 1 and first(case) == ("grads", "blocks.mlp.w_up[3]")
    grads = {r["name"]: r for r in case["report"]["rows"] if r["stage"] == "grads"}
    assert grads["blocks.mlp.w_up[3]"]["error"] == pytest.approx(0.01, rel=1e-3)  # exactly the planted 1%
    assert all(r["ok"] for n, r in grads.items() if n != "blocks.mlp.w_up[3]")
