"""The pipeline checks that need 8 devices, run in their own process by tests/test_pipeline.py.

    JAX_NUM_CPU_DEVICES=8 python tests/pipeline_on_8_devices.py OUT_DIR

(the test adds XLA_FLAGS that turn codegen optimisation off: compiles are most of the cost).

JAX fixes its device count when it starts, so these cannot run inside the
pytest process. One process runs everything (compiles dominate the cost) and
writes OUT_DIR/report.json; the tests assert on it. Nothing here decides
pass or fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lib import checkpoint as ckpt  # noqa: E402
from lib.config import load_config  # noqa: E402
from lib.metrics import read_metrics  # noqa: E402
from lib.model import Llama  # noqa: E402
from lib.optim import make_optimizer  # noqa: E402
from lib.pipeline import Pipeline  # noqa: E402
from lib.guard import StepGuard  # noqa: E402
from lib.train_state import init_train_state, model_loss_sum  # noqa: E402
from recipes import pretrain  # noqa: E402

# The smoke experiment, deep enough for 8 stages x 2 repeats, with one validation batch at step 20,
# and the fused LM head in two chunks of the 32 positions.
# Warmup lasts 20 steps, so the learning rate of steps 1-21 does not depend on trainer.steps (20 or 21).
BASE = [
    "+exp=smoke", "trainer.progress=false", "logger.wandb=disabled", "model.n_layers=16",
    "trainer.batch_size=8", "trainer.steps=20", "trainer.eval_every=20", "trainer.eval_batches=1", "trainer.ckpt_every=20",
    "optim.warmup_steps=20", "model.logits_chunk=16",
]
PIPELINES = {  # name -> overrides; stages x fsdp on 8 devices
    "gpipe_4x2": ["parallel=pipeline", "parallel.stages=4", "parallel.microbatches=4"],
    "circular_4x2": ["parallel=pipeline", "parallel.stages=4", "parallel.microbatches=4", "parallel.schedule=circular", "parallel.repeats=2"],
    "gpipe_8x1": ["parallel=pipeline", "parallel.stages=8", "parallel.microbatches=8"],
    "circular_8x1": ["parallel=pipeline", "parallel.stages=8", "parallel.microbatches=8", "parallel.schedule=circular", "parallel.repeats=2"],
}


def run_recipe(out: Path, name: str, overrides: list[str]) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        pretrain.train(load_config(BASE + [f"run_dir={out / name}", *overrides]))
    rows = read_metrics(out / name)
    return {
        "loss": {r["step"]: r["loss"] for r in rows if "loss" in r},
        "val_loss": [r["val_loss"] for r in rows if "val_loss" in r],
        "log": [r for r in rows if "pipeline_bubble" in r],
        "stderr": err.getvalue(),
    }


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def gradient_check(name: str) -> dict:
    """Un-pipelined vs pipelined gradients of the same weights and batch, leaf by leaf."""
    cfg = load_config(BASE + PIPELINES[name] + ["parallel.stage_remat=true"])
    pipe = Pipeline(cfg)
    model = Llama(cfg.model, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, cfg.data.seq_len), 0, cfg.model.vocab_size)
    # Padding, and two documents per row split at a different place in every row, so each
    # micro-batch has its own attention mask (a stage that used another's would be caught).
    cuts = jax.random.randint(jax.random.PRNGKey(2), (8, 1), 1, cfg.data.seq_len)
    segments = (jnp.arange(cfg.data.seq_len)[None, :] >= cuts).astype(jnp.int32)
    batch = {"tokens": tokens, "mask": jnp.ones(tokens.shape, bool).at[:, -5:].set(False), "segment_ids": segments}

    def mean_loss(loss_sum):
        def f(m, b):
            total, count = loss_sum(m, b, 0.0)
            return total / count
        return eqx.filter_jit(eqx.filter_value_and_grad(f))

    ref_loss, ref_grads = mean_loss(model_loss_sum)(model, batch)
    placed = jax.device_put(model, pipe.state_shardings(model))
    loss, grads = mean_loss(pipe.loss_sum)(placed, pipe.batch(batch))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))]
    rel = [float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)) for a, b in zip(leaves(grads), leaves(ref_grads))]
    return {"loss": float(loss), "ref_loss": float(ref_loss), "grad_rel_diff": dict(zip(paths, rel))}


def initial_states(name: str):
    """The step-0 train state of config `name` on one device, and placed by the pipeline."""
    cfg = load_config(BASE + PIPELINES[name])
    pipe = Pipeline(cfg)
    optimizer = make_optimizer(cfg.optim, Llama(cfg.model, jax.random.PRNGKey(0)), cfg.trainer.steps)
    guard = StepGuard(cfg.guard) if cfg.guard.enabled else None  # the recipe's checkpoints hold the guard's state
    single = init_train_state(Llama(cfg.model, jax.random.PRNGKey(0)), optimizer, 0, guard)
    placed = pipe.init_state(lambda: init_train_state(Llama(cfg.model, jax.random.PRNGKey(0)), optimizer, 0, guard))
    return single, placed


def stack_bytes(state) -> dict:
    """Bytes of the layer stack (parameters and Adam moments) on each device vs in total."""
    moments = [s.blocks for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "blocks")) if hasattr(s, "blocks")]
    stacks = {"params": state.model.blocks, "opt_state": moments}
    report = {}
    for what, tree in stacks.items():
        arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")]
        total = sum(x.nbytes for x in arrays)
        per_device = {}
        for x in arrays:
            for shard in x.addressable_shards:
                per_device[str(shard.device)] = per_device.get(str(shard.device), 0) + shard.data.nbytes
        report[what] = {"total": total, "max_per_device": max(per_device.values()), "min_per_device": min(per_device.values())}
    return report


def cross_restore(out: Path, single_like, pipe_like) -> dict:
    """Checkpoints of the single and the pipelined run, each read into both layouts."""
    model_cfg = {"n_layers": 16}
    report = {}
    for run in ("single", "gpipe_4x2"):
        manager = ckpt.open_manager(out / run / "checkpoints", keep_last=2, async_save=False)
        as_single, _, _ = ckpt.restore(manager, 20, single_like, model_cfg)
        as_pipe, _, _ = ckpt.restore(manager, 20, pipe_like, model_cfg)
        manager.close()
        report[run] = {
            "bitwise_equal": all(np.array_equal(a, b) for a, b in zip(leaves(as_single), leaves(as_pipe))),
            "pipe_spec": str(as_pipe.model.blocks.mlp.w_up.sharding.spec),
            "single_devices": len(as_single.model.blocks.mlp.w_up.sharding.device_set),
        }
    return report


def cross_resume(out: Path) -> dict:
    """Step 21 after restoring the other layout's step-20 checkpoint, each way. The resumed runs
    repeat the configs of the single and circular_8x1 runs (21 steps), so their compiles hit the cache."""
    losses = {}
    for src, name, overrides in (("gpipe_4x2", "single_from_pipeline", []), ("single", "pipeline_from_single", PIPELINES["circular_8x1"])):
        shutil.copytree(out / src, out / name)
        shutil.rmtree(out / name / "checkpoints" / "21", ignore_errors=True)  # resume from step 20
        losses[name] = run_recipe(out, name, [*overrides, "trainer.steps=21", "trainer.eval_batches=0"])["loss"][21]
    return losses


def main(out: Path) -> None:
    os.chdir(out)  # Hydra must not scatter outputs/ folders elsewhere
    # Identical programs compiled again (the resumed runs) are read back from disk, not recompiled.
    jax.config.update("jax_compilation_cache_dir", str(out / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    report = {"devices": jax.device_count(), "seconds": {}}
    clock = (time.perf_counter(), time.process_time())

    def lap(what: str) -> None:  # wall and CPU seconds per part (the test machine is often shared)
        nonlocal clock
        now = (time.perf_counter(), time.process_time())
        report["seconds"][what] = [round(now[0] - clock[0], 1), round(now[1] - clock[1], 1)]
        clock = now

    report["runs"] = {"single": run_recipe(out, "single", ["trainer.steps=21"])}
    lap("single")
    for name, overrides in PIPELINES.items():
        steps = ["trainer.steps=21"] if name == "circular_8x1" else []
        no_eval = [] if name == "gpipe_4x2" else ["trainer.eval_batches=0"]  # one pipelined evaluation is enough
        report["runs"][name] = run_recipe(out, name, overrides + steps + no_eval)
        lap(name)
    report["grads"] = {name: gradient_check(name) for name in ("circular_4x2",)}
    lap("grads")
    report["bytes"] = {}
    for name in ("gpipe_8x1", "gpipe_4x2"):
        single, placed = initial_states(name)
        report["bytes"][name] = stack_bytes(placed)
    lap("bytes")
    report["restore"] = cross_restore(out, single, placed)
    lap("restore")
    report["resume"] = cross_resume(out)
    lap("resume")
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
