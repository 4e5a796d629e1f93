"""Health warnings: trends that do not break a step but deserve a human's look.

- Overfitting: the validation loss rose on `overfit_evals` evaluations in a
  row while the training loss (its rolling mean) fell over the same span.
- A growing gradient norm: the least-squares fit of log(grad norm) over the
  last `grad_trend_window` accepted steps grows by `grad_trend_ratio` x or more
  across the window. Checked once per window, so it warns at most once each.

Warnings go to the console and to metrics.jsonl as `warning` rows; the state
is checkpointed with the guard's, so a resumed run warns exactly as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lib.config import GuardConfig


@dataclass
class HealthMonitor:
    cfg: GuardConfig
    evals: list[list[float]] = field(default_factory=list)  # [val_loss, train_loss_mean] per evaluation
    grad_norms: list[list[float]] = field(default_factory=list)  # [step, grad_norm] of accepted steps

    def observe_step(self, step: int, m: dict) -> list[dict]:
        if m.get("skipped", 0) or not math.isfinite(m["grad_norm"]) or m["grad_norm"] <= 0:
            return []
        self.grad_norms.append([step, m["grad_norm"]])
        if len(self.grad_norms) < self.cfg.grad_trend_window:
            return []
        steps, norms = np.array(self.grad_norms).T
        self.grad_norms = []
        slope = np.polyfit(steps - steps[0], np.log(norms), 1)[0]
        growth = float(np.exp(slope * (steps[-1] - steps[0])))
        if growth < self.cfg.grad_trend_ratio:
            return []
        return [{
            "step": step, "warning": "grad_norm_growing", "growth": growth,
            "message": f"gradient norm grew {growth:.1f}x over the last {len(steps)} steps (fitted trend): "
                       "the run may be heading for a divergence; consider a lower optim.lr or more warmup",
        }]

    def observe_eval(self, step: int, val_loss: float, train_loss_mean: float) -> list[dict]:
        self.evals = (self.evals + [[val_loss, train_loss_mean]])[-(self.cfg.overfit_evals + 1):]
        if len(self.evals) <= self.cfg.overfit_evals:
            return []
        val, train = np.array(self.evals).T
        if not (np.all(np.diff(val) > 0) and np.all(np.diff(train) < 0)):
            return []
        return [{
            "step": step, "warning": "overfitting", "val_loss": val_loss,
            "message": f"validation loss rose on {self.cfg.overfit_evals} evaluations in a row ({val[0]:.4f} -> {val[-1]:.4f}) "
                       f"while training loss fell ({train[0]:.4f} -> {train[-1]:.4f}): the model is overfitting; "
                       "more data, fewer steps or more weight decay",
        }]

    def state_dict(self) -> dict:
        return {"evals": self.evals, "grad_norms": self.grad_norms}

    def load_state_dict(self, d: dict | None) -> None:
        d = d or {}
        self.evals, self.grad_norms = d.get("evals", []), d.get("grad_norms", [])
