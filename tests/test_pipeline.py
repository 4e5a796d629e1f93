"""Pipeline parallelism: schedules, bad input, and (on 8 simulated devices, in a subprocess)
equality with the un-pipelined model: per-step losses, gradients, memory, checkpoints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from lib.config import ConfigError, ParallelConfig, load_config
from lib.pipeline import Schedule, make_schedule, resolve_mesh_shape
from recipes import pretrain
from tests.conftest import ROOT, smoke_overrides

LOSS_RTOL = 1e-5  # fp32: the pipeline computes the same sums, micro-batch by micro-batch


# ---- the schedule, in plain Python -------------------------------------------------------------


def busy_ticks(schedule: Schedule) -> dict[tuple[int, int, int], int]:
    """(stage, micro-batch, repeat) -> the tick at which the stage runs that work."""
    out = {}
    for s, row in enumerate(schedule.table()):
        for t, cell in enumerate(row):
            if cell != ".":
                micro, repeat = schedule.work(s, t)
                assert (s, micro, repeat) not in out, "work done twice"
                out[(s, micro, repeat)] = t
    return out


@pytest.mark.parametrize("stages, micro, repeats", [(4, 4, 1), (4, 8, 1), (4, 4, 2), (4, 6, 3), (8, 8, 2), (2, 5, 2)])
def test_schedule_runs_every_chunk_once_in_dependency_order(stages, micro, repeats):
    sched = Schedule("circular" if repeats > 1 else "gpipe", stages, micro, repeats, 1)
    when = busy_ticks(sched)
    assert len(when) == stages * micro * repeats  # every stage runs every micro-batch in every repeat
    assert len(sched.table()[0]) == repeats * micro + stages - 1
    for (s, m, r), t in when.items():
        if s > 0:  # the previous stage handed this micro-batch over exactly one tick before
            assert when[(s - 1, m, r)] == t - 1
        elif r > 0:  # stage 0 starts a repeat only after the last stage finished the previous one
            assert when[(stages - 1, m, r - 1)] < t
    for row in sched.table():  # each stage idles exactly S-1 ticks: the bubble
        assert row.count(".") == stages - 1


def test_bubble_fraction_formulas():
    assert Schedule("gpipe", 4, 8, 1, 2).bubble_fraction == pytest.approx(3 / 11)  # (S-1)/(M+S-1)
    assert Schedule("circular", 4, 8, 2, 1).bubble_fraction == pytest.approx(3 / 19)  # (S-1)/(R*M+S-1)
    assert "bubble (S-1)/(R*M+S-1) = 15.8%" in Schedule("circular", 4, 8, 2, 1).describe()


# ---- bad input: one line naming the fix ------------------------------------------------------------


def pcfg(**kw) -> ParallelConfig:
    base = dict(name="pipeline", stages=4, microbatches=4, fsdp=-1)
    return ParallelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "kw, layers, batch, message",
    [
        ({}, 6, 8, "model.n_layers=6 does not split into parallel.stages=4 x parallel.repeats=1"),
        ({"schedule": "circular", "repeats": 2}, 4, 8, "pick n_layers a multiple of 8"),
        ({"microbatches": 2}, 8, 8, "parallel.microbatches=2 is fewer than parallel.stages=4"),
        ({"microbatches": 4}, 8, 6, "does not split into parallel.microbatches=4"),
        ({"microbatches": 4}, 8, 4, "each micro-batch has 1 rows but a stage splits rows over data x fsdp = 2"),
        ({"schedule": "gpipe", "repeats": 2}, 8, 8, "set parallel.schedule=circular"),
        ({"schedule": "zigzag"}, 8, 8, "choose gpipe or circular"),
    ],
)
def test_bad_pipeline_shapes_are_one_line_errors(kw, layers, batch, message):
    p = pcfg(**kw)
    shape = resolve_mesh_shape(p, 8)
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        make_schedule(p, layers, batch, 1, shape[1] * shape[2])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kw, devices, message",
    [
        ({"stages": 3}, 8, "parallel.stages=3 does not fit the 8 visible devices"),
        ({"stages": 16}, 8, "parallel.stages=16 does not fit"),
        ({"fsdp": 4}, 8, "stages=4 x data=1 x fsdp=4 = 16 devices, but 8 are visible"),
        ({"data": -1, "fsdp": 3}, 8, "2 devices per stage (8 / parallel.stages=4) do not split by 3"),
    ],
)
def test_stage_axis_that_does_not_fit_the_devices(kw, devices, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_mesh_shape(pcfg(**kw), devices)


def test_mesh_fills_the_devices_left_after_the_stages():
    assert resolve_mesh_shape(pcfg(stages=4), 8) == (4, 1, 2)
    assert resolve_mesh_shape(pcfg(stages=8), 8) == (8, 1, 1)
    assert resolve_mesh_shape(pcfg(stages=2, data=-1, fsdp=2), 8) == (2, 2, 2)


def test_recipe_stops_before_writing_anything(tmp_path, capsys):
    """3 stages fit no power-of-two device count; the run directory is left as it was."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep me")
    code = pretrain.main(smoke_overrides(run_dir, "parallel=pipeline", "parallel.stages=3", "model.n_layers=6"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: parallel.stages=3 does not fit the")
    assert [p.name for p in run_dir.iterdir()] == ["notes.txt"]


def test_pipeline_config_group_composes():
    cfg = load_config(["+exp=smoke", "parallel=pipeline", "parallel.schedule=circular", "parallel.repeats=2"])
    p = cfg.parallel
    assert (p.name, p.stages, p.fsdp, p.schedule, p.repeats, p.stage_remat) == ("pipeline", 4, -1, "circular", 2, False)


def test_one_stage_pipeline_with_accumulation_matches_the_plain_train_step():
    """On this process's device: the pipelined loss inside the accumulating train step
    (2 accumulation steps x 2 micro-batches) gives the plain step's loss, norm and update."""
    import equinox as eqx
    import jax
    import numpy as np

    from lib.model import Llama
    from lib.optim import lr_schedule, make_optimizer
    from lib.pipeline import Pipeline
    from lib.train_state import init_train_state, make_train_step

    cfg = load_config(["+exp=smoke", "parallel=pipeline", "parallel.stages=1", "parallel.microbatches=2",
                       "parallel.stage_remat=true", "optim.accum_steps=2", "trainer.batch_size=8"])
    pipe = Pipeline(cfg, devices=jax.devices()[:1])
    model = Llama(cfg.model, jax.random.PRNGKey(0))
    optimizer = make_optimizer(cfg.optim, model, 10)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.model.vocab_size, (8, cfg.data.seq_len)).astype(np.int32),
             "mask": np.ones((8, cfg.data.seq_len), bool)}
    batch["mask"][:3, -7:] = False  # padding in some rows only: the count must be the whole batch's
    results = []
    for loss_sum, put in ((None, jax.device_put), (pipe.loss_sum, pipe.batch)):
        kwargs = {} if loss_sum is None else {"loss_sum": loss_sum}
        step = make_train_step(optimizer, lr_schedule(cfg.optim, 10), 2, 0.0, **kwargs)
        fresh = Llama(cfg.model, jax.random.PRNGKey(0))  # the step donates its input state
        state, metrics = step(init_train_state(fresh, optimizer, 0), put(batch))
        results.append((metrics, jax.tree.leaves(eqx.filter(state.model, eqx.is_array))))
    (plain, plain_params), (piped, piped_params) = results
    assert rel(float(piped["loss"]), float(plain["loss"])) <= LOSS_RTOL
    assert rel(float(piped["grad_norm"]), float(plain["grad_norm"])) <= LOSS_RTOL
    for a, b in zip(piped_params, plain_params):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


# ---- 8 simulated devices, one subprocess --------------------------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory, private_corpus_cache):
    out = tmp_path_factory.mktemp("pipeline8")
    # Codegen optimisation off: both sides of every comparison compile alike, and compiles are the cost here.
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAXPRETRAIN_CACHE": str(private_corpus_cache),
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "pipeline_on_8_devices.py"), str(out)],
                          env=env, cwd=out, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", ["gpipe_4x2", "circular_4x2", "gpipe_8x1", "circular_8x1"])
def test_pipelined_losses_equal_single_device_for_20_steps(report, name):
    assert report["devices"] == 8
    single, piped = report["runs"]["single"]["loss"], report["runs"][name]["loss"]
    steps = [str(s) for s in range(1, 21)]
    assert all(s in piped for s in steps)
    worst = max(rel(piped[s], single[s]) for s in steps)
    assert worst <= LOSS_RTOL, f"{name}: worst relative loss difference {worst:.2e}"
    assert single["20"] < single["1"]  # it trains: the comparison is not between two constants


def test_pipelined_evaluation_equals_single_device(report):
    single, piped = report["runs"]["single"]["val_loss"], report["runs"]["gpipe_4x2"]["val_loss"]
    assert len(piped) == 1 and rel(piped[0], single[0]) <= LOSS_RTOL


@pytest.mark.parametrize("name, schedule, stages, micro, repeats, bubble", [
    ("gpipe_4x2", "gpipe", 4, 4, 1, 3 / 7), ("circular_8x1", "circular", 8, 8, 2, 7 / 23)])
def test_recipe_prints_and_logs_the_schedule(report, name, schedule, stages, micro, repeats, bubble):
    run = report["runs"][name]
    assert f"pipeline schedule {schedule}: {stages} stages x {repeats} repeat(s), {micro} micro-batches" in run["stderr"]
    assert "bubble" in run["stderr"] and f"{bubble:.1%}" in run["stderr"]
    [row] = run["log"]
    assert row["pipeline_schedule"] == schedule and row["pipeline_bubble"] == pytest.approx(bubble)
    assert (row["pipeline_stages"], row["pipeline_microbatches"], row["pipeline_repeats"]) == (stages, micro, repeats)


def test_pipelined_gradients_equal_single_device_leaf_by_leaf(report):
    """Circular schedule, 4 stages x 2 fsdp, 2 repeats, stage remat on, padded batch."""
    check = report["grads"]["circular_4x2"]
    assert rel(check["loss"], check["ref_loss"]) <= LOSS_RTOL
    assert len(check["grad_rel_diff"]) == 12  # embed, 9 block leaves, final norm, head: every leaf compared
    bad = {path: d for path, d in check["grad_rel_diff"].items() if d > 1e-5}
    assert not bad, bad


@pytest.mark.parametrize("name, stages, fsdp", [("gpipe_8x1", 8, 1), ("gpipe_4x2", 4, 2)])
def test_each_device_holds_its_stage_of_the_layer_stack(report, name, stages, fsdp):
    for what in ("params", "opt_state"):
        held = report["bytes"][name][what]
        # 1/S of the stack per device; fsdp splits the matrices further (norm scales stay whole).
        assert held["max_per_device"] <= held["total"] / stages
        assert held["min_per_device"] >= held["total"] / (stages * fsdp)
        if fsdp == 1:
            assert held["max_per_device"] == held["total"] / stages


def test_checkpoints_restore_across_layouts_bitwise(report):
    for run in ("single", "gpipe_4x2"):
        got = report["restore"][run]
        assert got["bitwise_equal"], run  # the same arrays whichever layout reads them
        assert got["pipe_spec"] == "P('stage', None, 'fsdp')" and got["single_devices"] == 1


def test_training_resumes_across_layouts(report):
    """Step 21 after a pipelined step-20 checkpoint on one device, and after a single-device one
    pipelined, both equal the uninterrupted single-device step 21."""
    reference = report["runs"]["single"]["loss"]["21"]
    for name, loss in report["resume"].items():
        assert rel(loss, reference) <= LOSS_RTOL, name
