"""Training curves from metrics.jsonl as one PNG: loss, learning rate and gradient norm, by step and by tokens.

Train loss is a solid line, validation loss dashed with dots (and dotted per
source for a mixture). Steps the guard skipped are red crosses along the
bottom of each panel; rollbacks are vertical dashed lines. Several runs are
overlaid in different colours, with a fourth panel showing each one's loss minus
the first run's, step by step. Uses matplotlib's object API with the Agg
canvas, so it never needs a display and never changes a global backend.
"""

from __future__ import annotations

import math
from pathlib import Path

from lib.config import ConfigError
from lib.metrics import read_jsonl

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm (pre-clip)"))
AXES = (("step", "optimizer step"), ("tokens", "tokens"))


def read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows; a half-written last line (a run still writing) is ignored."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"no metrics.jsonl in {run_dir}; give a run_dir that recipes.pretrain wrote to")
    return read_jsonl(path)


def last_per_step(rows: list[dict], key: str) -> list[dict]:
    """Rows holding `key`, one per step (after a rollback the replayed step wins), in step order."""
    by_step = {r["step"]: r for r in rows if key in r and "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class RunCurves:
    """What one run contributes to the figure."""

    def __init__(self, run_dir: Path):
        rows = read_rows(run_dir)
        self.path, self.name = run_dir, run_dir.name
        self.train = last_per_step(rows, "loss")
        per_update = next((r["tokens_per_update"] for r in rows if "tokens_per_update" in r), 0)
        self._tokens = {r["step"]: r.get("tokens", r["step"] * per_update) for r in self.train}
        self._per_update = per_update
        self.val = last_per_step(rows, "val_loss")
        sources = sorted({k for r in rows for k in r if k.startswith("val_loss/")})
        self.val_sources = {k.split("/", 1)[1]: last_per_step(rows, k) for k in sources}
        self.skipped = [r for r in rows if r.get("skipped", 0) and "step" in r]
        self.rollbacks = [r for r in rows if r.get("event") == "rollback" and "step" in r]

    def x(self, rows: list[dict], axis: str) -> list[float]:
        if axis == "step":
            return [r["step"] for r in rows]
        return [self._tokens.get(r["step"], r["step"] * self._per_update) for r in rows]


def _series(ax, curves: RunCurves, rows: list[dict], key: str, axis: str, **style) -> None:
    pts = [(x, r[key]) for x, r in zip(curves.x(rows, axis), rows) if _finite(r.get(key))]
    if pts:
        ax.plot(*zip(*pts), **style)


def _paired(base_rows: list[dict], other_rows: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(step, base value, other value) for every step both runs logged a finite `key` at."""
    other = {r["step"]: r[key] for r in other_rows if _finite(r.get(key))}
    return [(r["step"], r[key], other[r["step"]]) for r in base_rows if _finite(r.get(key)) and r["step"] in other]


def loss_gap(base: RunCurves, other: RunCurves) -> dict | None:
    """How far `other`'s loss curves sit from `base`'s (other - base), over the steps both logged.

    Meant for runs that saw the same batches (same seed and data), differing in one setting such as
    the compute dtype: then the per-step difference is that setting's effect, not sampling noise."""
    train = _paired(base.train, other.train, "loss")
    if not train:
        return None
    diffs = [o - b for _, b, o in train]
    worst = max(range(len(train)), key=lambda i: abs(diffs[i]))
    gap = {"steps": len(train), "train_mean_abs": sum(map(abs, diffs)) / len(diffs), "train_mean": sum(diffs) / len(diffs),
           "train_max_abs": abs(diffs[worst]), "train_max_step": train[worst][0],
           "train_mean_rel": sum(abs(d) / abs(b) for d, (_, b, _) in zip(diffs, train) if b) / len(train)}
    val = _paired(base.val, other.val, "val_loss")
    if val:
        step, b, o = val[-1]
        gap |= {"val_step": step, "val_base": b, "val_other": o}
    return gap


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write the PNG of one or several runs to `out`; returns its path."""
    return plot_curves([RunCurves(Path(d)) for d in run_dirs], out)


def plot_curves(runs: list[RunCurves], out: str | Path) -> Path:
    """`plot_runs` for curves already read."""
    if not any(r.train for r in runs):
        raise ConfigError(f"no training steps logged yet in {', '.join(str(r.path) for r in runs)}; plot after the first steps")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    build_figure(runs).savefig(out, dpi=100)
    return out


def _gap_panel(ax, runs: list[RunCurves], colors: list[str], axis: str) -> None:
    """Each later run's loss minus the first run's, step by step: train thin, validation dashed with dots."""
    base = runs[0]
    ax.axhline(0, color=colors[0], lw=1)
    for run, color in zip(runs[1:], colors[1:]):
        for rows_key, key, style in (("train", "loss", dict(lw=1, alpha=0.7)), ("val", "val_loss", dict(ls="--", lw=2, marker="o", ms=5))):
            pairs = _paired(getattr(base, rows_key), getattr(run, rows_key), key)
            if pairs:
                steps = [{"step": s} for s, _, _ in pairs]
                ax.plot(run.x(steps, axis), [o - b for _, b, o in pairs], color=color, label=f"{run.name} {rows_key}", **style)


def _runs_panel(ax, runs: list[RunCurves], colors: list[str], key: str, axis: str) -> None:
    """One logged quantity of every run; the loss panel adds validation, and every panel the guard's events."""
    for run, color in zip(runs, colors):
        prefix = f"{run.name} " if len(runs) > 1 else ""
        _series(ax, run, run.train, key, axis, color=color, lw=1, alpha=0.6 if key == "loss" else 1, label=f"{prefix}train")
        if key == "loss":
            _series(ax, run, run.val, "val_loss", axis, color=color, ls="--", lw=2, marker="o", ms=5, zorder=3, label=f"{prefix}val")
            for i, (source, rows) in enumerate(run.val_sources.items()):
                _series(ax, run, rows, f"val_loss/{source}", axis, color=color, ls=":", marker="s^vD"[i % 4], ms=3,
                        label=f"{prefix}val {source}")
        if run.skipped:  # along the bottom: a skipped step's loss may be inf or nan
            ax.plot(run.x(run.skipped, axis), [0.02] * len(run.skipped), "x", color="red", ms=6,
                    transform=ax.get_xaxis_transform(), label="skipped step" if key == "loss" else None)
        for j, rb in enumerate(run.rollbacks):
            ax.axvline(run.x([rb], axis)[0], color=color, ls="-.", lw=1,
                       label="rollback" if key == "loss" and j == 0 else None)
    low, high = ax.dataLim.intervaly
    if key == "grad_norm" and ax.has_data() and low > 0 and high / low > 20:  # spikes would flatten the rest
        ax.set_yscale("log")


def build_figure(runs: list[RunCurves]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = PANELS + (("gap", f"loss - {runs[0].name} loss"),) if len(runs) > 1 else PANELS
    fig = Figure(figsize=(5 * len(panels), 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(AXES), len(panels), squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for row, (axis, axis_label) in enumerate(AXES):
        for col, (key, title) in enumerate(panels):
            ax = axes[row][col]
            if key == "gap":
                _gap_panel(ax, runs, colors, axis)
            else:
                _runs_panel(ax, runs, colors, key, axis)
            ax.set_title(title if row == 0 else f"{title} vs tokens")
            ax.set_xlabel(axis_label)
            ax.grid(alpha=0.3)
            if key in ("loss", "gap") and ax.has_data():
                ax.legend(fontsize=7)
    fig.suptitle(", ".join(r.name for r in runs))
    return fig
