"""The training guard: skip bad steps bitwise, quarantine their data, roll back, repro bundles, debug_step.

Unit tests first (the jitted step, the statistics, the data replacement, the
monitor's rules, a rollback's restore), then end-to-end runs of the pretrain
recipe with injected faults compared against a clean run with the same settings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib import checkpoint as ckpt
from lib.config import ConfigError, GuardConfig, load_config, to_dict
from lib.data import open_corpus, train_batches
from lib.guard import REASONS, StepGuard, rolling_mean_std
from lib.guard_host import HostGuard
from lib.health import HealthMonitor
from lib.metrics import read_metrics
from lib.model import Llama
from lib.optim import lr_schedule, make_optimizer
from lib.quarantine import read_quarantine
from lib.rollback import GuardMonitor, TrainingDiverged
from lib.train_state import init_train_state, make_train_step
from recipes import debug_step, pretrain, replay
from tests.conftest import ROOT, smoke_overrides

# Short statistics window so spike detection is live after 10 steps; a spike must be 3x the mean, so the
# tiny model's natural grad-norm jitter never trips it (the injected faults are 100x).
GUARD = ["guard.window=10", "guard.warmup=10", "guard.loss_min_rel_jump=2.0", "guard.grad_norm_min_rel_jump=2.0", "guard.rollback_window=5"]
RUN = ["trainer.steps=40", "trainer.ckpt_every=5", "trainer.eval_every=20", "trainer.peak_flops=1e12", *GUARD]


def run(run_dir, *extra):
    last = pretrain.train(load_config(smoke_overrides(run_dir, *RUN, *extra)))
    return last, read_metrics(run_dir)


def step_rows(rows):
    return [r for r in rows if "loss" in r]


def final_loss(rows):
    return step_rows(rows)[-1]["loss"]


# ---- the jitted step ------------------------------------------------------------------------------


def tiny_setup(overrides=(), accum_steps=1):
    cfg = load_config(["+exp=smoke", "guard.window=4", "guard.warmup=2", *overrides])
    model = Llama(cfg.model, jax.random.PRNGKey(0))
    optimizer = make_optimizer(cfg.optim, model, 10)
    guard = StepGuard(cfg.guard)
    step = make_train_step(optimizer, lr_schedule(cfg.optim, 10), accum_steps, 0.0, guard)
    return cfg, init_train_state(model, optimizer, 0, guard), step


def fields(state):
    """Every field the guard must keep on a skip, as host arrays, by name."""
    named = {"step": state.step, "rng": state.rng}
    for prefix, tree in (("model", state.model), ("opt_state", state.opt_state)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            named[prefix + jax.tree_util.keystr(path)] = leaf
    return {k: np.array(v) for k, v in named.items()}


def test_a_skipped_step_keeps_params_adam_moments_count_step_and_rng_bitwise():
    # Step 2: NaN gradient; step 4: a 100x loss spike; step 5: a corrupt sample in the 2nd micro-batch.
    _, state, step = tiny_setup(["guard.fault.nan_grad_steps=[2]", "guard.fault.spike_steps=[4]"], accum_steps=2)
    tokens = (np.arange(4 * 32).reshape(4, 32) % 50 + 2).astype(np.int32)
    good = {"tokens": jnp.asarray(tokens), "mask": jnp.ones((4, 32), bool)}
    corrupt = tokens.copy()
    corrupt[3] = 10_000  # out of the vocabulary: the embedding lookup gives NaN
    bad = {"tokens": jnp.asarray(corrupt), "mask": jnp.ones((4, 32), bool)}
    expected = {1: 0, 2: REASONS.index("nonfinite_grad"), 3: 0, 4: REASONS.index("loss_spike"), 5: REASONS.index("nonfinite_loss"), 6: 0}
    for n, reason in expected.items():
        before = fields(state)
        state, metrics = step(state, bad if n == 5 else good)
        after = fields(state)
        assert int(metrics["skip_reason"]) == reason, n
        assert int(metrics["skipped"]) == (reason > 0)
        changed = [k for k in before if not np.array_equal(before[k], after[k])]
        if reason:
            assert changed == [], f"step {n} skipped but changed {changed}"
        else:
            assert "step" in changed and "rng" in changed and any(k.startswith("model") for k in changed)
            assert any("mu" in k for k in changed) and any("nu" in k for k in changed) and any("count" in k for k in changed)
    assert int(state.guard.seen) == 6 and int(state.guard.skipped) == 3 and int(state.guard.accepted) == 3
    assert int(state.step) == 3  # applied updates only: the LR schedule did not move on skips


def test_rolling_statistics_and_the_spike_rule():
    values = jnp.array([1.0, 2.0, 3.0, 0.0, 0.0])
    mean, std = rolling_mean_std(values, jnp.array(3))
    assert np.isclose(mean, 2.0) and np.isclose(std, np.std([1.0, 2.0, 3.0]))
    mean, _ = rolling_mean_std(jnp.array([5.0, 1.0, 1.0]), jnp.array(7))  # ring full: every slot counts
    assert np.isclose(mean, 7 / 3)

    guard = StepGuard(GuardConfig(window=4, warmup=3, sigma=3.0, loss_min_rel_jump=0.1, grad_norm_min_rel_jump=0.1))
    stats = guard.init_stats()
    stats = stats.__class__(jnp.array([2.0, 2.1, 1.9, 0.0]), jnp.array([1.0, 1.0, 1.0, 0.0]), jnp.array(3), jnp.array(3), jnp.array(0))
    reason = lambda loss, gn: REASONS[int(guard.reason(stats, jnp.float32(loss), jnp.float32(gn)))]  # noqa: E731
    assert reason(2.1, 1.0) == "ok"
    assert reason(2.5, 1.0) == "loss_spike"
    assert reason(2.0, 1.5) == "grad_norm_spike"
    assert reason(np.nan, np.nan) == "nonfinite_loss"
    assert reason(2.0, np.inf) == "nonfinite_grad"
    cold = stats.__class__(stats.losses, stats.grad_norms, jnp.array(2), jnp.array(2), jnp.array(0))
    assert REASONS[int(guard.reason(cold, jnp.float32(50.0), jnp.float32(1.0)))] == "ok"  # warm-up not full yet


# ---- the data --------------------------------------------------------------------------------------


def test_quarantined_samples_are_replaced_and_every_other_sample_stays(tiny_corpus):
    from lib.config import DataConfig

    corpus, cfg = open_corpus("tiny", tiny_corpus), DataConfig(seq_len=32, read_threads=1, prefetch=1)

    def batches(quarantined=frozenset(), n=6):
        it = iter(train_batches([corpus], cfg, global_batch=4, vocab_size=300, quarantined=quarantined))
        return [next(it) for _ in range(n)]

    plain = batches()
    bad = {(0, int(plain[1]["index"][2])), (0, int(plain[4]["index"][0]))}
    once, twice = batches(frozenset(bad)), batches(frozenset(bad))
    for step, (p, a, b) in enumerate(zip(plain, once, twice)):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])  # a pure function of (step, quarantine)
        for row in range(4):
            if (0, int(p["index"][row])) in bad:
                assert (0, int(a["index"][row])) not in bad
            else:
                assert a["index"][row] == p["index"][row]
    assert sum(int(a["index"][r] != p["index"][r]) for a, p in zip(once, plain) for r in range(4)) == 2


# ---- the monitor's rules ---------------------------------------------------------------------------


def ok(loss=2.0, **kw):
    return {"loss": loss, "grad_norm": 1.0, "skipped": 0, "skip_reason": 0, "params_finite": 1, "stats_ready": 1, "loss_mean": 2.0, **kw}


def skip(reason="loss_spike"):
    return ok(loss=50.0, skipped=1, skip_reason=REASONS.index(reason))


def test_monitor_rolls_back_on_repeated_skips_nonfinite_weights_and_a_lasting_loss_rise():
    cfg = GuardConfig(rollback_skips=3, rollback_window=5, diverge_ratio=0.5, diverge_patience=3)
    m = GuardMonitor(cfg)
    m.observe(1, ok())
    assert m.good and m.observe(2, skip()).rollback is None and not m.good
    assert m.observe(5, skip()).rollback is None
    assert m.observe(8, skip()).rollback is None  # step 2 fell out of the 5-step window
    assert m.observe(9, skip()).rollback == "repeated_skips"

    m = GuardMonitor(cfg)
    m.observe(1, ok())
    m.observe(2, skip())
    for s in range(3, 8):
        m.observe(s, ok())
    assert m.good  # 5 clean steps close the anomaly: checkpoints are good again

    assert GuardMonitor(cfg).observe(3, ok(params_finite=0)).rollback == "nonfinite_params"

    m = GuardMonitor(cfg)
    m.observe(1, ok())
    assert [m.observe(s, ok(loss=3.5)).rollback for s in (2, 3, 4)] == [None, None, "loss_diverged"]
    assert m.anomaly_start == 2


def test_rollback_target_is_the_newest_good_checkpoint_before_the_anomaly_then_older_and_bounded():
    m = GuardMonitor(GuardConfig(max_rollbacks=2))
    m.observe(1, ok())
    m.observe(12, skip())
    assert m.choose_target([5, 10, 15], [5, 10]) == 10
    m.start_rollback("repeated_skips", 14)
    m.finish_rollback(10, None)
    m.observe(12, skip())  # going back to 10 did not help: go further back
    assert m.choose_target([5, 10], [5, 10]) == 5
    m.start_rollback("repeated_skips", 14)
    with pytest.raises(TrainingDiverged, match="max_rollbacks=2"):
        m.start_rollback("repeated_skips", 14)
    with pytest.raises(TrainingDiverged, match="no good checkpoint"):
        m.choose_target([5], [])


def test_rollback_restores_the_whole_state_field_by_field(tmp_path):
    cfg = load_config(["+exp=smoke", f"run_dir={tmp_path}"])
    _, good_state, step = tiny_setup()
    manager = ckpt.open_manager(tmp_path / "checkpoints", keep_last=5, keep_good=2, async_save=False)
    model_meta = to_dict(cfg)["model"]
    rows = []
    guard = HostGuard(cfg, tmp_path, None, rows.append)
    guard.monitor.observe(3, ok())
    saved_monitor = guard.monitor.state_dict()
    expected = fields(good_state)
    ckpt.save(manager, 5, good_state, {"next_index": 5}, {"step": 5, "model": model_meta, "good": True, "guard": guard.checkpoint_meta()})

    batch = {"tokens": jnp.ones((4, 32), jnp.int32) * 3, "mask": jnp.ones((4, 32), bool)}
    state, _ = step(good_state, batch)  # donated: good_state's buffers are gone, `expected` holds the values
    state, _ = step(state, batch)
    ckpt.save(manager, 7, state, {"next_index": 7}, {"step": 7, "model": model_meta, "good": False, "guard": {}})
    guard.monitor.observe(6, skip())
    guard.quarantine.record(6, "loss_spike", 50.0, 1.0, [(0, 11), (0, 12)])

    restored, data_state, target = guard.roll_back("repeated_skips", 7, manager, state, model_meta)
    assert target == 5 and data_state == {"next_index": 5}
    got = fields(restored)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    for name in ("losses", "grad_norms", "accepted", "seen", "skipped"):
        np.testing.assert_array_equal(getattr(restored.guard, name), 0, err_msg=name)  # saved fresh
    assert list(manager.all_steps()) == [5]  # the abandoned timeline is gone: a resume cannot continue it
    assert guard.monitor.anomaly_start is None and guard.monitor.reference_loss == saved_monitor["reference_loss"]
    assert guard.monitor.rollbacks == 1 and guard.monitor.failures == {"6": 1}  # run-wide counts carry on
    assert guard.quarantined() == {(0, 11), (0, 12)}  # and the quarantine now applies to the data
    assert rows[-1]["event"] == "rollback" and rows[-1]["to_step"] == 5


def test_health_warns_on_overfitting_and_a_growing_grad_norm():
    h = HealthMonitor(GuardConfig(overfit_evals=2, grad_trend_window=20, grad_trend_ratio=3.0))
    assert h.observe_eval(10, 3.0, 4.0) == [] and h.observe_eval(20, 3.1, 3.8) == []
    (w,) = h.observe_eval(30, 3.2, 3.6)
    assert w["warning"] == "overfitting" and "overfitting" in w["message"]
    assert h.observe_eval(40, 3.1, 3.5) == []  # val fell again: no warning
    flat = [h.observe_step(s, ok(grad_norm=1.0 + 0.01 * (s % 3))) for s in range(20)]
    assert not any(flat)
    growing = [w for s in range(20, 40) for w in h.observe_step(s, {**ok(), "grad_norm": float(np.exp(s / 10))})]
    assert [w["warning"] for w in growing] == ["grad_norm_growing"]


def test_bad_guard_settings_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="guard.window"):
        load_config(["+exp=smoke", "guard.warmup=500"])
    with pytest.raises(ConfigError, match="guard.fault.nan_steps"):
        load_config(["+exp=smoke", "+guard.fault.nan_steps=[3]"])


# ---- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("guard") / "clean"
    return run(run_dir)[1]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("guard") / "faulty"
    faults = ["guard.fault.nan_grad_steps=[12]", "guard.fault.spike_steps=[22]", "guard.fault.corrupt_sample_steps=[32]"]
    return run_dir, run(run_dir, *faults)[1]


def test_on_by_default_and_bitwise_neutral_when_nothing_goes_wrong(clean_run, tmp_path):
    assert load_config(["+exp=smoke"]).guard.enabled
    rows = run(tmp_path / "unguarded", "guard.enabled=false")[1]
    assert [r["loss"] for r in step_rows(rows)] == [r["loss"] for r in step_rows(clean_run)]
    assert "skipped" not in step_rows(rows)[0] and step_rows(clean_run)[0]["skipped"] == 0


def test_nan_spike_and_corrupt_sample_are_skipped_quarantined_and_the_run_ends_like_a_clean_one(clean_run, faulty_run):
    run_dir, rows = faulty_run
    assert sum(r["skipped"] for r in step_rows(clean_run)) == 0
    skipped = {r["step"]: REASONS[int(r["skip_reason"])] for r in step_rows(rows) if r["skipped"]}
    assert skipped == {12: "nonfinite_grad", 22: "loss_spike", 32: "nonfinite_loss"}
    assert not any("event" in r for r in rows)  # isolated skips: no rollback needed
    assert [r["step"] for r in step_rows(rows)] == list(range(1, 41))
    # Before the first fault the runs are the same run. The fault hooks make it a different XLA program,
    # which may sum the fused loss in another order: the logged loss can differ in its last bit.
    np.testing.assert_allclose([r["loss"] for r in step_rows(rows)[:12]], [r["loss"] for r in step_rows(clean_run)[:12]], rtol=1e-6)
    entries = read_quarantine(run_dir / "quarantine.jsonl")
    assert [(e["step"], e["reason"]) for e in entries] == sorted(skipped.items())
    by_step = {r["step"]: r for r in step_rows(rows)}
    for e in entries:
        assert len(e["samples"]) == 4 and {s["source"] for s in e["samples"]} == {"stdlib"}
        assert np.float32(e["grad_norm"]).tobytes() == np.float32(by_step[e["step"]]["grad_norm"]).tobytes()
    assert step_rows(rows)[-1]["skips_total"] == 3
    assert abs(final_loss(rows) - final_loss(clean_run)) / final_loss(clean_run) < 0.02


def test_debug_step_names_the_first_layer_with_a_nonfinite_value(faulty_run, capsys):
    run_dir, _ = faulty_run
    result = debug_step.debug_step({"run_dir": str(run_dir), "step": "32"})  # the corrupt sample's step
    assert result["first_nonfinite"]["direction"] == "forward" and result["first_nonfinite"]["name"] == "embed"
    assert result["outcome"]["skipped"] == 1
    names = [(r["direction"], r["name"]) for r in result["rows"]]
    assert ("forward", "block_1") in names and ("backward", "d loss / d block_0 output") in names
    assert ("param_grad", "block_0") in names
    assert "first non-finite value: forward embed" in capsys.readouterr().out
    assert json.loads((run_dir / "debug_step_32.json").read_text())["step"] == 32
    clean = debug_step.debug_step({"run_dir": str(run_dir), "step": "31"})
    assert clean["first_nonfinite"] is None and all(r["finite"] for r in clean["rows"])


def test_resuming_with_another_guard_setting_is_a_one_line_error(faulty_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(faulty_run[0], copy)
    before = {p: p.stat().st_mtime for p in (copy / "checkpoints").rglob("*")}
    assert pretrain.main(smoke_overrides(copy, *RUN, "guard.enabled=false")) == 2
    assert "written with guard.enabled=True" in capsys.readouterr().err
    assert {p: p.stat().st_mtime for p in (copy / "checkpoints").rglob("*")} == before


def test_a_bad_update_that_got_through_is_rolled_back_with_the_whole_state(clean_run, tmp_path):
    # After step 27's update the weights are poisoned: steps 28-30 spike and are skipped -> roll back to 25.
    rows = run(tmp_path / "poisoned", "guard.fault.poison_steps=[27]", "trainer.keep_last=10")[1]
    events = [r for r in rows if r.get("event") == "rollback"]
    assert [(e["step"], e["to_step"], e["reason"]) for e in events] == [(30, 25, "repeated_skips")]
    after = step_rows(rows[rows.index(events[0]):])
    clean = {r["step"]: r for r in step_rows(clean_run)}
    # Params, Adam moments, schedule step, RNG, guard statistics and data position all came back:
    # the replayed steps 26 and 27 equal the clean run's bit for bit (step 28 on reads replaced samples).
    assert [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in after[:2]] == [(s, clean[s]["loss"], clean[s]["grad_norm"], clean[s]["lr"]) for s in (26, 27)]
    assert after[-1]["step"] == 40 and after[-1]["params_finite"] == 1
    assert abs(final_loss(rows) - final_loss(clean_run)) / final_loss(clean_run) < 0.02
    # debug_step replays the timeline the run kept (from 25, quarantine in effect, no second poisoning).
    replayed = debug_step.debug_step({"run_dir": str(tmp_path / "poisoned"), "step": "29"})
    assert replayed["start_step"] == 25 and replayed["outcome"]["loss"] == after[3]["loss"] and after[3]["step"] == 29
    shutil.rmtree(tmp_path / "poisoned" / "checkpoints" / "25")
    with pytest.raises(ckpt.CheckpointError, match="rollback to step 25"):
        debug_step.debug_step({"run_dir": str(tmp_path / "poisoned"), "step": "29"})


def test_a_step_that_keeps_failing_gets_a_repro_bundle_that_replays_exactly(tmp_path, capsys):
    run_dir = tmp_path / "recurring"
    code = pretrain.main(smoke_overrides(run_dir, *RUN, "trainer.steps=20", "guard.fault.nan_grad_steps=[12,13,14]", "guard.max_rollbacks=1"))
    err = capsys.readouterr().err
    # Rollback to 10, the same steps fail again: bundles, then a clear stop after the one allowed rollback.
    assert code == 2 and "error: training diverged" in err and "max_rollbacks=1" in err and len(err.strip().splitlines()[-1]) < 400
    rows = read_metrics(run_dir)
    assert [r["event"] for r in rows if "event" in r] == ["rollback", "repro_bundle", "repro_bundle", "repro_bundle", "stopped"]
    bundle = run_dir / "repro" / "step_00000014"
    info = json.loads((bundle / "bundle.json").read_text())
    assert info["start_step"] == 10 and info["failures"] == 2 and info["reason"] == "nonfinite_grad"
    assert (bundle / "checkpoint" / "10").is_dir() and (bundle / "config.yaml").is_file()
    assert np.load(bundle / "batches.npz")["tokens"].shape == (4, 4, 32)
    assert replay.main([f"bundle={bundle}"]) == 0
    assert '"reproduced": true' in capsys.readouterr().out
    result = debug_step.debug_step({"bundle": str(bundle)})
    # The injected NaN enters at the parameter gradients: activations and their gradients are finite.
    assert result["first_nonfinite"]["direction"] == "param_grad"
    assert all(r["finite"] for r in result["rows"] if r["direction"] != "param_grad")


SHARDED = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from lib.config import load_config
    from lib.model import Llama
    from lib.optim import lr_schedule, make_optimizer
    from lib.guard import StepGuard
    from lib.train_state import init_train_state, make_train_step

    cfg = load_config(["+exp=smoke"])
    model = Llama(cfg.model, jax.random.PRNGKey(0))
    opt = make_optimizer(cfg.optim, model, 10)
    guard = StepGuard(cfg.guard)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    # FSDP-like layout: every leaf whose first axis divides by 8 is split over the devices.
    def place(x):
        spec = P("data") if x.ndim and x.shape[0] % 8 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))
    state = jax.tree.map(place, init_train_state(model, opt, 0, guard))
    step = make_train_step(opt, lr_schedule(cfg.optim, 10), guard=guard)
    rows = NamedSharding(mesh, P("data"))
    tokens = (np.arange(16 * 32).reshape(16, 32) % 500 + 2).astype(np.int32)
    corrupt = tokens.copy(); corrupt[13] = 9999  # one sample, held by device 6 only
    kept = lambda s: (s.step, s.model, s.opt_state, s.rng)  # what a skip must leave alone (not the guard's counters)
    shards = lambda s: [np.array(sh.data) for leaf in jax.tree.leaves(kept(s)) for sh in leaf.addressable_shards]
    for toks, want in ((tokens, 0), (corrupt, 1)):
        batch = {"tokens": jax.device_put(toks, rows), "mask": jax.device_put(np.ones_like(toks, bool), rows)}
        before = shards(state)
        state, m = step(state, batch)
        after = shards(state)
        assert int(m["skipped"]) == want, m
        same = [np.array_equal(a, b) for a, b in zip(before, after)]
        n_sharded = sum(len(leaf.addressable_shards) > 1 and not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state))
        assert n_sharded > 0
        if want:
            assert all(same), "some device applied the update"
        else:
            assert not all(same)
    print("ALL DEVICES SKIPPED TOGETHER")
""")


def test_every_device_skips_together_on_8_simulated_devices():
    out = subprocess.run([sys.executable, "-c", SHARDED], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ALL DEVICES SKIPPED TOGETHER" in out.stdout


# ---- the real recipe under parallel=fsdp (and one pipeline) on 8 simulated devices, one subprocess ----


@pytest.fixture(scope="module")
def sharded_report(tmp_path_factory, private_corpus_cache):
    """tests/guard_on_8_devices.py: clean, NaN+spike, poisoned (rollback) fsdp runs and a NaN pipeline run."""
    out = tmp_path_factory.mktemp("guard8")
    # Codegen optimisation off, as tests/test_pipeline.py: compiles are most of the cost here.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "JAXPRETRAIN_CACHE": str(private_corpus_cache),
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "guard_on_8_devices.py"), str(out)],
                          env=env, cwd=out, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["device_count"] == 8
    return report


def skipped_steps(result: dict) -> list[int]:
    return [r["step"] for r in result["steps"] if r["skipped"]]


def last_loss(result: dict) -> float:
    return result["steps"][-1]["loss"]


def assert_sharded_run(result: dict):
    assert [r["step"] for r in result["steps"]][-1] == 30  # finished
    assert result["sharded_leaves"] > 0  # the state really is split over the mesh
    assert all(c["devices"] == 8 and c["layout_kept"] for c in result["calls"])  # every step, every device, same layout


def assert_skips(result: dict, want: dict[int, str]):
    """Exactly these steps skipped, each leaving every device's shards bitwise unchanged, and quarantined."""
    assert skipped_steps(result) == sorted(want)
    unchanged = [i + 1 for i, c in enumerate(result["calls"][:30]) if c["unchanged"]]
    assert unchanged == sorted(want)  # params, both moments, count, step, rng: on all 8 devices
    assert [(q["step"], q["reason"]) for q in result["quarantine"]] == sorted(want.items())
    for q in result["quarantine"]:
        assert len(q["samples"]) == 8 and all(s["source"] == "stdlib" for s in q["samples"])  # the whole global batch
    assert all(result["identities_match"])  # and they name exactly the token rows the step saw


def test_fsdp_nan_and_spike_steps_are_skipped_together_bitwise_and_the_run_ends_like_a_clean_one(sharded_report):
    clean, faulty = sharded_report["fsdp_clean"], sharded_report["fsdp_skip"]
    assert "fsdp=8" in faulty["placement"]
    assert_sharded_run(clean)
    assert_sharded_run(faulty)
    assert skipped_steps(clean) == [] and clean["quarantine"] == []
    assert_skips(faulty, {12: "nonfinite_grad", 22: "loss_spike"})
    assert abs(last_loss(faulty) - last_loss(clean)) / last_loss(clean) < 0.02


def test_fsdp_rollback_restores_the_whole_sharded_state_and_ends_like_a_clean_one(sharded_report):
    clean, rolled = sharded_report["fsdp_clean"], sharded_report["fsdp_rollback"]
    assert_sharded_run(rolled)  # includes the restored state: laid out exactly as the mesh had it
    assert_skips(rolled, {18: "loss_spike", 19: "loss_spike", 20: "loss_spike"})
    assert [(e["event"], e["reason"], e["to_step"]) for e in rolled["events"]] == [("rollback", "repeated_skips", 15)]
    calls = rolled["calls"]
    assert len(calls) == 30 + 5  # steps 16-20 ran twice
    assert calls[17]["before"] != calls[16]["after"]  # the poison landed between steps 17 and 18
    # The step after the rollback starts from exactly the state step 15 produced (and checkpoint 15 holds), every shard.
    assert calls[20]["before"] == calls[14]["after"]
    assert abs(last_loss(rolled) - last_loss(clean)) / last_loss(clean) < 0.02


def test_pipeline_nan_step_is_skipped_together_bitwise(sharded_report):
    clean, piped = sharded_report["fsdp_clean"], sharded_report["pipeline_skip"]
    assert_sharded_run(piped)
    assert_skips(piped, {12: "nonfinite_grad"})
    # Pipelined losses equal one device's (tests/test_pipeline.py), so the clean fsdp run is the reference.
    assert abs(last_loss(piped) - last_loss(clean)) / last_loss(clean) < 0.02
