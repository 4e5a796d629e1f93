"""The guard through the real recipe on 8 simulated devices, run in its own process by tests/test_guard.py.

    JAX_NUM_CPU_DEVICES=8 python tests/guard_on_8_devices.py OUT_DIR

JAX fixes its device count when it starts, so this cannot run inside the
pytest process; one process runs every scenario (compiles dominate the cost)
and writes OUT_DIR/report.json. Nothing here decides pass or fail.

`recipes.pretrain.train` runs unchanged; only its train step is observed: each
call records a digest of every device's shard of the state going in and
coming out (the step donates its input, so the digest is taken before the
call), and the shardings. A skipped step must leave every shard on every
device bitwise as it was; a rollback must hand the next step exactly the state
that the target checkpoint's step produced, laid out as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from lib.config import load_config  # noqa: E402
from lib.data import PackedSequences, resolve_corpora  # noqa: E402
from lib.metrics import read_metrics  # noqa: E402
from lib.quarantine import read_quarantine  # noqa: E402
from recipes import pretrain  # noqa: E402

STEPS = 30
# As tests/test_guard.py: a short statistics window, spikes must be 3x the mean (the injected ones are 100x).
GUARD = ["guard.window=10", "guard.warmup=10", "guard.loss_min_rel_jump=2.0", "guard.grad_norm_min_rel_jump=2.0",
         "guard.rollback_window=5"]
BASE = ["+exp=smoke", "trainer.progress=false", "logger.wandb=disabled", f"trainer.steps={STEPS}", "trainer.batch_size=8",
        "trainer.ckpt_every=5", "trainer.keep_last=10", "trainer.eval_every=100", "trainer.eval_batches=0",
        "trainer.peak_flops=1e12", *GUARD]
FSDP = ["parallel=fsdp", "parallel.min_shard_bytes=0"]  # the tiny model's weights are small: split them all anyway
PIPELINE = ["parallel=pipeline", "parallel.stages=2", "parallel.microbatches=2", "parallel.min_shard_bytes=0"]
SCENARIOS = {
    "fsdp_clean": FSDP,
    "fsdp_skip": [*FSDP, "guard.fault.nan_grad_steps=[12]", "guard.fault.spike_steps=[22]"],
    # After step 17's update the weights are poisoned: 18-20 are skipped -> roll back to the checkpoint at 15.
    "fsdp_rollback": [*FSDP, "guard.fault.poison_steps=[17]"],
    "pipeline_skip": [*PIPELINE, "guard.fault.nan_grad_steps=[12]"],
}


def shard_digests(state) -> dict:
    """One digest per device over that device's shards of every leaf, and the leaves' shardings.

    The guard's own statistics are left out: a skip counts itself there (seen, skipped); everything
    else (parameters, both Adam moments, the optimizer count, state.step, the RNG key) must not move.
    """
    per_device: dict[str, hashlib._Hash] = {}
    for leaf in jax.tree.leaves((state.step, state.model, state.opt_state, state.rng)):
        for shard in leaf.addressable_shards:
            per_device.setdefault(str(shard.device), hashlib.sha256()).update(np.asarray(shard.data).tobytes())
    return {"devices": {d: h.hexdigest() for d, h in sorted(per_device.items())},
            "shardings": [str(leaf.sharding.spec) for leaf in jax.tree.leaves(state)],
            "guard_skipped": int(state.guard.skipped)}


def same_layout(state, reference) -> bool:
    """Every leaf of `state` laid out on the same devices, split the same way, as in `reference`."""
    return all(a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.sharding == b.sharding
               for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference)))


def observed(placement, calls: list):
    """`placement` with its train step wrapped to record the state before and after every call."""
    make_step = placement.train_step

    def train_step(step, state):
        jitted = make_step(step, state)
        first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

        def call(state, batch):
            before = shard_digests(state)  # before the call: it donates `state`
            layout_in = same_layout(state, first)  # e.g. the state a rollback restored
            new_state, metrics = jitted(state, batch)
            calls.append({"before": before, "after": shard_digests(new_state), "layout_kept": layout_in and same_layout(new_state, first),
                          "tokens": np.asarray(batch["tokens"])})
            return new_state, metrics

        return call

    placement.train_step = train_step
    return placement


def run(out: Path, name: str, overrides: list[str]) -> dict:
    calls: list = []
    placed: list = []
    make_placement = pretrain.make_placement
    pretrain.make_placement = lambda cfg: placed.append(observed(make_placement(cfg), calls)) or placed[-1]
    err = io.StringIO()
    cfg = load_config(BASE + [f"run_dir={out / name}", *overrides])
    try:
        with contextlib.redirect_stderr(err):
            pretrain.train(cfg)
    finally:
        pretrain.make_placement = make_placement
    rows = read_metrics(out / name)
    steps = [r for r in rows if "loss" in r]
    quarantine = read_quarantine(out / name / "quarantine.jsonl")
    # The identities logged for a skipped step name exactly the token rows that step's batch held
    # (each step ran once in the runs whose quarantine this checks: call i is step i + 1).
    corpora = resolve_corpora(cfg.data, cfg.model.vocab_size)
    on_disk = [[PackedSequences(corpora[s["source_id"]], "train", s["source_id"])[s["index"]]["tokens"] for s in q["samples"]]
               for q in quarantine]
    identities_match = [bool(np.array_equal(np.stack(rows_), calls[q["step"] - 1]["tokens"])) for q, rows_ in zip(quarantine, on_disk)]
    return {
        "steps": [{k: r[k] for k in ("step", "loss", "skipped", "skip_reason")} for r in steps],
        "events": [r for r in rows if "event" in r],
        "placement": str(placed[0]),
        "quarantine": quarantine,
        "identities_match": identities_match,
        "calls": [{"unchanged": c["before"]["devices"] == c["after"]["devices"],
                   "skips_counted": c["after"]["guard_skipped"] - c["before"]["guard_skipped"],
                   "layout_kept": c["layout_kept"], "devices": len(c["after"]["devices"]),
                   "before": c["before"]["devices"], "after": c["after"]["devices"]} for c in calls],
        "sharded_leaves": sum("fsdp" in s for s in calls[0]["before"]["shardings"]),
        "leaves": len(calls[0]["before"]["shardings"]),
        "stderr": err.getvalue()[-4000:],
    }


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {"device_count": jax.device_count()}
    for name, overrides in SCENARIOS.items():
        report[name] = run(out, name, overrides)
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
