"""The host half of the training guard: notice that bad updates got through, and roll back.

The jitted step (lib/guard.py) skips single bad steps. Some damage gets past
it: a spike just under the threshold, a bad update that poisons the weights so
that every later step is skipped, a slow divergence. `GuardMonitor` watches
the per-step metrics the loop already fetches (no extra device sync) and asks
for a rollback when, after updates have landed,

- the weights are non-finite,
- `rollback_skips` steps were skipped within `rollback_window` steps, or
- the loss stayed above (1 + diverge_ratio) x its pre-anomaly rolling mean
  for `diverge_patience` steps in a row.

An anomaly is *open* from its first bad step until `rollback_window` clean
steps in a row; a checkpoint saved while one is open is not "good". A rollback
restores the newest good checkpoint from before the anomaly (an older one if
the run already went back there and failed again), with its whole state:
parameters, optimizer state, schedule step, RNG, guard statistics and data
position. The quarantine, the rollback count and the failure counts carry on.
After `max_rollbacks` the run stops with `TrainingDiverged`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orbax.checkpoint as ocp

from lib.checkpoint import is_good
from lib.config import GuardConfig
from lib.guard import REASONS


class TrainingDiverged(RuntimeError):
    """Training kept failing and the guard gave up; the message says what happened and where to look."""


@dataclass
class Verdict:
    rollback: str | None = None  # why the run must roll back now, or None
    bundle: bool = False  # this step has failed `repro_after` times: write a repro bundle
    skip_reason: str | None = None  # why this step was skipped, or None


@dataclass
class GuardMonitor:
    cfg: GuardConfig
    anomaly_start: int | None = None
    clean_streak: int = 0
    elevated_streak: int = 0
    reference_loss: float | None = None  # rolling mean loss at the last step with no anomaly open
    recent_skips: list[int] = field(default_factory=list)
    # Carried across rollbacks (they describe the whole run, not one timeline):
    failures: dict[str, int] = field(default_factory=dict)  # step -> times it was skipped
    rollbacks: int = 0
    rollback_targets: list[int] = field(default_factory=list)
    bundles: list[int] = field(default_factory=list)

    CARRIED = ("failures", "rollbacks", "rollback_targets", "bundles")
    TIMELINE = ("anomaly_start", "clean_streak", "elevated_streak", "reference_loss", "recent_skips")

    @property
    def good(self) -> bool:
        """Whether a checkpoint saved now may be a rollback target."""
        return self.anomaly_start is None

    def _open(self, step: int) -> None:
        self.clean_streak = 0
        if self.anomaly_start is None:
            self.anomaly_start = step

    def observe(self, step: int, m: dict) -> Verdict:
        cfg = self.cfg
        verdict = Verdict()
        if m.get("params_finite", 1) == 0:
            self._open(step)
            verdict.rollback = "nonfinite_params"
            return verdict
        if m.get("skipped", 0):
            self._open(step)
            verdict.skip_reason = REASONS[int(m["skip_reason"])]
            self.recent_skips = [s for s in self.recent_skips if s > step - cfg.rollback_window] + [step]
            self.failures[str(step)] = self.failures.get(str(step), 0) + 1
            verdict.bundle = self.failures[str(step)] >= cfg.repro_after and step not in self.bundles
            if len(self.recent_skips) >= cfg.rollback_skips:
                verdict.rollback = "repeated_skips"
            return verdict
        elevated = self.reference_loss is not None and m["loss"] > self.reference_loss * (1 + cfg.diverge_ratio)
        if elevated:
            self._open(step)
            self.elevated_streak += 1
            if self.elevated_streak >= cfg.diverge_patience:
                verdict.rollback = "loss_diverged"
            return verdict
        self.elevated_streak = 0
        self.clean_streak += 1
        if self.anomaly_start is not None and self.clean_streak >= cfg.rollback_window:
            self.anomaly_start, self.recent_skips = None, []
        if self.anomaly_start is None and m.get("stats_ready", 0):
            self.reference_loss = m["loss_mean"]
        return verdict

    def choose_target(self, checkpoints: list[int], good: list[int]) -> int:
        """The newest good checkpoint before the anomaly; older than any target that already failed."""
        limit = self.anomaly_start if self.anomaly_start is not None else max(checkpoints, default=0) + 1
        if self.rollback_targets:
            limit = min(limit, min(self.rollback_targets))  # going back there did not help: go further
        candidates = [s for s in good if s < limit]
        if not candidates:
            raise TrainingDiverged(self.report(f"no good checkpoint before step {limit} to roll back to (kept: {sorted(checkpoints)})"))
        return max(candidates)

    def start_rollback(self, reason: str, step: int) -> None:
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingDiverged(self.report(f"{reason} at step {step} after {self.rollbacks} rollback(s) (guard.max_rollbacks={self.cfg.max_rollbacks})"))
        self.rollbacks += 1

    def finish_rollback(self, target: int, restored: dict | None) -> None:
        """Take the restored checkpoint's timeline fields; keep the run-wide ones."""
        fresh = GuardMonitor(self.cfg)
        for name in self.TIMELINE:
            setattr(self, name, (restored or {}).get(name, getattr(fresh, name)))
        self.rollback_targets.append(target)

    def report(self, what: str) -> str:
        worst = sorted(self.failures.items(), key=lambda kv: (-kv[1], int(kv[0])))[:5]
        failing = ", ".join(f"step {s} x{n}" for s, n in worst) or "none"
        return (
            f"training diverged: {what}; skipped steps: {failing}; repro bundles: {self.bundles or 'none'}. "
            "Inspect quarantine.jsonl and repro/ in the run_dir (docs/guard.md), then lower optim.lr or fix the data"
        )

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.TIMELINE + self.CARRIED}

    def load_state_dict(self, d: dict | None) -> None:
        for name, value in (d or {}).items():
            if name in self.TIMELINE + self.CARRIED:
                setattr(self, name, value)


def good_steps(manager: ocp.CheckpointManager) -> list[int]:
    return [s for s in manager.all_steps() if is_good(manager.directory, s)]


def drop_checkpoints_after(manager: ocp.CheckpointManager, step: int) -> None:
    """Delete the abandoned timeline's checkpoints, newest first, so a resume never continues it."""
    manager.wait_until_finished()
    for s in sorted(manager.all_steps(), reverse=True):
        if s > step:
            manager.delete(s)
