"""What the training loop does with the guard's per-step verdicts: one object, a few calls.

    guard.after_step(step, metrics, batch)   quarantine a skipped batch, health warnings,
                                             -> Verdict (rollback? repro bundle?)
    guard.after_eval(step, val_loss, train_loss)
    guard.roll_back(reason, step, manager, state, model_cfg) -> restored state, data state, step
    guard.checkpoint_meta() / guard.resume(meta)   the host-side guard state inside each checkpoint

Everything that decides lives in lib/guard.py (in the step), lib/rollback.py,
lib/health.py and lib/quarantine.py; this file only wires them to the run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import grain
import jax
import numpy as np

from lib import checkpoint as ckpt
from lib.config import Config
from lib.faults import HostFaults
from lib.health import HealthMonitor
from lib.quarantine import Identity, QuarantineLog, batch_identities
from lib.rollback import GuardMonitor, TrainingDiverged, Verdict, drop_checkpoints_after, good_steps


def global_batch_identities(batch: dict) -> list[Identity]:
    """(source, index) of every row of the global batch; processes other than 0 hold other rows."""
    local = np.array(batch_identities(batch), np.int64).reshape(-1, 2)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        local = np.asarray(multihost_utils.process_allgather(local, tiled=True))  # every process skips together
    return [(int(s), int(i)) for s, i in local]


def check_guard_matches(meta: dict, cfg: Config) -> None:
    """The guard's statistics are part of the state: a checkpoint resumes only with the same guard.enabled/window."""
    saved = meta.get("config", {}).get("guard", {})
    for key in ("enabled", "window"):
        if key in saved and saved[key] != getattr(cfg.guard, key):
            raise ckpt.CheckpointError(
                f"the checkpoints in {cfg.run_dir} were written with guard.{key}={saved[key]} but the config says "
                f"guard.{key}={getattr(cfg.guard, key)}; resume with guard.{key}={saved[key]} or use a new run_dir"
            )


class HostGuard:
    def __init__(self, cfg: Config, run_dir: str | Path, stream: grain.MapDataset | None, emit: Callable[[dict], Any], is_main: bool = True):
        self.cfg = cfg
        self.monitor = GuardMonitor(cfg.guard)
        self.health = HealthMonitor(cfg.guard)
        self.quarantine = QuarantineLog(run_dir, [s.name for s in cfg.data.sources], enabled=is_main)
        self.faults = HostFaults(cfg.guard.fault, stream, cfg.trainer.batch_size, cfg.model.vocab_size)
        self.emit = emit  # writes a metrics row (and prints its message)
        self.in_effect = 0  # how many quarantine entries the current data iterator leaves out

    def quarantined(self) -> frozenset[Identity]:
        return self.quarantine.identities(self.in_effect)

    @property
    def good(self) -> bool:
        return self.monitor.good

    def checkpoint_meta(self) -> dict:
        return {
            "monitor": self.monitor.state_dict(),
            "health": self.health.state_dict(),
            "quarantine_logged": len(self.quarantine.entries),
            "quarantine_in_effect": self.in_effect,
        }

    def resume(self, meta: dict | None) -> None:
        """Continue exactly as the run stood at the checkpoint (later quarantine lines are written again)."""
        meta = meta or {}
        self.monitor.load_state_dict(meta.get("monitor"))
        self.health.load_state_dict(meta.get("health"))
        self.quarantine.truncate(meta.get("quarantine_logged", 0))
        self.in_effect = min(meta.get("quarantine_in_effect", 0), len(self.quarantine.entries))

    def after_step(self, step: int, metrics: dict, batch: dict) -> Verdict:
        verdict = self.monitor.observe(step, metrics)
        if verdict.skip_reason:
            self.quarantine.record(step, verdict.skip_reason, metrics["loss"], metrics["grad_norm"], global_batch_identities(batch))
            print(f"guard: step {step} skipped ({verdict.skip_reason}: loss {metrics['loss']:.4g}, grad norm "
                  f"{metrics['grad_norm']:.4g}); batch quarantined", file=sys.stderr)
        for row in self.health.observe_step(step, metrics):
            self.emit(row)
        return verdict

    def after_eval(self, step: int, val_loss: float, train_loss: float) -> None:
        for row in self.health.observe_eval(step, val_loss, train_loss):
            self.emit(row)

    def roll_back(self, reason: str, step: int, manager, like_state, model_cfg: dict):
        """Restore the newest good checkpoint before the anomaly; returns (state, data_state, its step)."""
        manager.wait_until_finished()
        try:
            self.monitor.start_rollback(reason, step)  # raises TrainingDiverged past guard.max_rollbacks
            target = self.monitor.choose_target(list(manager.all_steps()), good_steps(manager))
        except TrainingDiverged as exc:
            self.emit({"step": step, "event": "stopped", "reason": reason, "message": str(exc)})
            raise
        drop_checkpoints_after(manager, target)
        state, data_state, meta = ckpt.restore(manager, target, like_state, model_cfg)
        restored = meta.get("guard", {})
        self.monitor.finish_rollback(target, restored.get("monitor"))
        self.health.load_state_dict(restored.get("health"))
        self.in_effect = len(self.quarantine.entries)  # from now on, everything quarantined so far is left out
        self.emit({
            "step": step, "event": "rollback", "reason": reason, "to_step": target, "rollbacks": self.monitor.rollbacks,
            "quarantined_samples": len(self.quarantined()), "quarantine_in_effect": self.in_effect,
            "message": f"rolled back from step {step} to good checkpoint {target} ({reason}); "
                       f"rollback {self.monitor.rollbacks}/{self.cfg.guard.max_rollbacks}",
        })
        return state, data_state, target
