"""Repro bundles, and re-running recorded steps exactly (recipes.replay, recipes.debug_step).

When one step keeps failing (skipped `guard.repro_after` times, across
rollbacks), the run writes `<run_dir>/repro/step_<N>/`:

    bundle.json     the step, why it failed, its loss and grad norm, the checkpoint it starts from
    batches.npz     token ids, masks and sample identities of every batch from that checkpoint to step N
                    (as the device saw them, faults included); the last one is step N's
    checkpoint/<C>/ a copy of the checkpoint (state, data position, meta)
    config.yaml     the run's resolved config (config.json: the same, machine-readable)
    README.txt      what this is and the command that replays it:
                    python -m recipes.replay bundle=<folder>

Replaying restores the checkpoint and runs the train step over the stored
batches; on the same hardware step N's loss, gradient norm and skip decision
come out bitwise equal to the recorded ones.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from lib import checkpoint as ckpt
from lib.config import Config, from_dict, to_dict, to_yaml
from lib.data import resolve_corpora, sample_stream, train_batches
from lib.faults import HostFaults
from lib.guard import REASONS, StepGuard
from lib.metrics import read_metrics
from lib.model import Llama
from lib.optim import lr_schedule, make_optimizer
from lib.quarantine import read_quarantine
from lib.train_state import TrainState, init_train_state, make_train_step

BUNDLE_FILE = "bundle.json"
HOST_ONLY_KEYS = ("source", "index")


@dataclass
class Training:
    """A fresh state (the restore target) and the train step, built from a config as pretrain builds them."""

    state: TrainState
    train_step: Callable
    faults: HostFaults


def build_training(cfg: Config, stream=None) -> Training:
    model = Llama(cfg.model, jax.random.PRNGKey(cfg.trainer.seed))
    optimizer = make_optimizer(cfg.optim, model, cfg.trainer.steps)
    step_guard = StepGuard(cfg.guard) if cfg.guard.enabled else None
    state = init_train_state(model, optimizer, cfg.trainer.seed, step_guard)
    train_step = make_train_step(optimizer, lr_schedule(cfg.optim, cfg.trainer.steps), cfg.optim.accum_steps, cfg.optim.z_loss, step_guard)
    return Training(state, train_step, HostFaults(cfg.guard.fault, stream, cfg.trainer.batch_size, cfg.model.vocab_size))


def device_batch(batch: dict) -> dict:
    return {k: jax.device_put(v) for k, v in batch.items() if k not in HOST_ONLY_KEYS}


def read_item_json(directory: str | Path, step: int, item: str) -> dict:
    return json.loads((Path(directory) / str(step) / item / "metadata").read_text())


@dataclass
class ReplayInputs:
    cfg: Config
    start_step: int  # the checkpoint's step (0: the freshly initialised state)
    state: TrainState  # the state after start_step
    batches: list[dict]  # the host batches of steps start_step+1 ... target
    rollbacks: int  # rollbacks before this stretch (host faults depend on it)
    recorded: dict | None = None  # what the run saw at the target step, if known

    @property
    def target_step(self) -> int:
        return self.start_step + len(self.batches)


def run_steps(inputs: ReplayInputs, training: Training, count: int):
    """Run the first `count` stored steps; returns (state, [metrics per step])."""
    state, rows = inputs.state, []
    for i in range(count):
        step = inputs.start_step + i + 1
        state, metrics = training.train_step(state, device_batch(inputs.batches[i]))
        rows.append({"step": step, **{k: float(v) for k, v in metrics.items()}})
        if training.faults.poison_due(step, inputs.rollbacks):
            state = training.faults.poison(state, step)
    return state, rows


def same_outcome(recorded: dict, replayed: dict) -> bool:
    """Bitwise-equal loss and grad norm (NaN equals NaN here) and the same skip decision."""
    def same(a, b):
        return np.float32(a).tobytes() == np.float32(b).tobytes() or (np.isnan(a) and np.isnan(b))

    return same(recorded["loss"], replayed["loss"]) and same(recorded["grad_norm"], replayed["grad_norm"]) and recorded.get("skip_reason", 0) == replayed.get("skip_reason", 0)


# ---- writing a bundle ---------------------------------------------------------------------------


def write_bundle(
    run_dir: str | Path,
    cfg: Config,
    manager,
    step: int,
    metrics: dict,
    open_batches: Callable[[frozenset, dict | None], object],
    quarantined: frozenset,
    faults: HostFaults,
    rollbacks: int,
    failures: int,
) -> Path:
    """Write `<run_dir>/repro/step_<step>/` (see the module docstring); returns the folder.

    Call it on process 0 after `manager.wait_until_finished()` (collective, so on every process).
    `quarantined` is what the run's data iterator leaves out now: it has read every batch since the
    newest checkpoint before `step` with it (the iterator is only reopened at a resume or a rollback,
    and both restart from a checkpoint at or before that one).
    """
    start = max((s for s in manager.all_steps() if s < step), default=0)
    data_state = read_item_json(manager.directory, start, "data") if start else None
    it = open_batches(quarantined, data_state)
    batches = [faults.corrupt_batch(next(it)) for _ in range(step - start)]

    final = Path(run_dir) / "repro" / f"step_{step:08d}"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))  # renamed when complete
    tmp.chmod(0o755)  # mkdtemp makes it private; a bundle is for sharing
    np.savez_compressed(tmp / "batches.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    if start:
        shutil.copytree(Path(manager.directory) / str(start), tmp / "checkpoint" / str(start))
    (tmp / "config.yaml").write_text(to_yaml(cfg))
    (tmp / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    command = f"python -m recipes.replay bundle={final.absolute()}"
    info = {
        "step": step, "start_step": start, "reason": REASONS[int(metrics.get("skip_reason", 0))],
        "recorded": {k: metrics[k] for k in ("loss", "grad_norm", "skip_reason") if k in metrics},
        "failures": failures, "rollbacks": rollbacks, "sources": [s.name for s in cfg.data.sources], "command": command,
    }
    (tmp / BUNDLE_FILE).write_text(json.dumps(info, indent=1))
    (tmp / "README.txt").write_text(
        f"Step {step} failed {failures} times ({info['reason']}). This folder replays it exactly:\n\n    {command}\n\n"
        f"It starts from {f'checkpoint/{start}' if start else 'a fresh initialisation (no checkpoint before this step)'}, "
        f"then runs the {step - start} stored batches of batches.npz (tokens, mask, source, index; the last is step {step}'s).\n"
        f"To see the first layer with a non-finite value: python -m recipes.debug_step bundle={final.absolute()}\n"
    )
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


# ---- reading replay inputs ----------------------------------------------------------------------


def _restore_or_fresh(training: Training, directory: Path, start: int, cfg: Config) -> tuple[TrainState, dict]:
    if not start:
        return training.state, {}
    manager = ckpt.open_manager(directory, keep_last=0, async_save=False)
    state, _, meta = ckpt.restore(manager, start, training.state, to_dict(cfg)["model"])
    manager.close()
    return state, meta


def inputs_from_bundle(bundle: str | Path) -> tuple[ReplayInputs, Training]:
    bundle = Path(bundle)
    if not (bundle / BUNDLE_FILE).is_file():
        raise ckpt.CheckpointError(f"{bundle} is not a repro bundle (no {BUNDLE_FILE}); pass the repro/step_<N> folder a run wrote")
    info = json.loads((bundle / BUNDLE_FILE).read_text())
    cfg = from_dict(json.loads((bundle / "config.json").read_text()))
    training = build_training(cfg)
    state, _ = _restore_or_fresh(training, bundle / "checkpoint", info["start_step"], cfg)
    stored = np.load(bundle / "batches.npz")
    batches = [{k: stored[k][i] for k in stored.files} for i in range(len(stored["tokens"]))]
    return ReplayInputs(cfg, info["start_step"], state, batches, info["rollbacks"], info["recorded"]), training


def run_after(run_dir: Path, start: int, step: int, guard_meta: dict) -> tuple[int, int]:
    """(quarantine entries left out, rollbacks so far) of the run's last pass from checkpoint `start` to `step`.

    Normally what the checkpoint says; but when the run rolled back to `start`, it went on from there
    with everything quarantined by then and one more rollback (the rollback row records both).
    """
    rows = [r for r in read_metrics(run_dir) if r.get("event") == "rollback" and r["to_step"] < step]
    if rows and rows[-1]["to_step"] > start:
        raise ckpt.CheckpointError(
            f"step {step} was last run after a rollback to step {rows[-1]['to_step']}, whose checkpoint is no longer "
            f"kept (newest before {step}: {start or 'none'}); use the run's repro bundle, or keep more checkpoints (trainer.keep_last)"
        )
    if rows and rows[-1]["to_step"] == start:
        return rows[-1]["quarantine_in_effect"], rows[-1]["rollbacks"]
    return guard_meta.get("quarantine_in_effect", 0), guard_meta.get("monitor", {}).get("rollbacks", 0)


def inputs_from_run(run_dir: str | Path, step: int) -> tuple[ReplayInputs, Training]:
    """The run's newest checkpoint before `step` and the batches from there to `step`, as the run read them."""
    run_dir = Path(run_dir)
    directory = run_dir / "checkpoints"
    manager = ckpt.open_manager(directory, keep_last=0, async_save=False)
    start = max((s for s in manager.all_steps() if s < step), default=0)
    manager.close()
    if start:
        meta = ckpt.read_meta(ckpt.open_manager(directory, keep_last=0, async_save=False), start)
        cfg, guard_meta = from_dict(meta["config"]), meta.get("guard", {})
    else:
        from omegaconf import OmegaConf

        if not (run_dir / "config.yaml").is_file():
            raise ckpt.CheckpointError(f"{run_dir} has no checkpoint before step {step} and no config.yaml; give the run_dir of a pretrain run")
        cfg, guard_meta = from_dict(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))), {}
    corpora = resolve_corpora(cfg.data, cfg.model.vocab_size)
    weights = [s.weight for s in cfg.data.sources]
    training = build_training(cfg, sample_stream(corpora, cfg.data, weights))
    state, _ = _restore_or_fresh(training, directory, start, cfg)
    in_effect, rollbacks = run_after(run_dir, start, step, guard_meta)
    entries = read_quarantine(run_dir / "quarantine.jsonl")[:in_effect]
    quarantined = frozenset((s["source_id"], s["index"]) for e in entries for s in e["samples"])
    it = iter(train_batches(corpora, cfg.data, global_batch=cfg.trainer.batch_size, vocab_size=cfg.model.vocab_size, weights=weights, quarantined=quarantined))
    if start:
        it.set_state(read_item_json(directory, start, "data"))
    batches = [training.faults.corrupt_batch(next(it)) for _ in range(step - start)]
    return ReplayInputs(cfg, start, state, batches, rollbacks), training


def parse_key_values(argv: list[str], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """`key=value` command-line arguments of the small guard recipes (replay, debug_step)."""
    from lib.config import ConfigError

    args = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in required + optional:
            raise ConfigError(f"unexpected argument {arg!r}; expected {' '.join(k + '=...' for k in required + optional)}")
        args[key] = value
    missing = [k for k in required if k not in args]
    if missing:
        raise ConfigError(f"missing argument {missing[0]}=...; expected {' '.join(k + '=...' for k in required + optional)}")
    return args
