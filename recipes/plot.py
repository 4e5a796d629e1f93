"""Plot training curves of one run, or overlay several:

    python -m recipes.plot run_dir=runs/quickstart                 # -> runs/quickstart/plot.png
    python -m recipes.plot run_dir=runs/a run_dir=runs/b out=compare.png

With several runs it also prints how far each one's loss sits from the first run's,
step by step (meaningful when the runs saw the same batches: same seed and data).

Also works on a run that is still training (it reads what metrics.jsonl holds so far).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lib.config import ConfigError
from lib.errors import run_cli
from lib.plot import RunCurves, loss_gap, plot_curves


def parse(argv: list[str]) -> tuple[list[str], str]:
    run_dirs, out = [], None
    for item in argv:
        key, sep, value = item.partition("=")
        if sep and key == "run_dir":
            run_dirs.append(value)
        elif sep and key == "out":
            out = value
        else:
            raise ConfigError(f"unknown argument '{item}'; use run_dir=PATH (repeat it to overlay runs) and out=FILE.png")
    if not run_dirs:
        raise ConfigError("give at least one run: run_dir=runs/NAME")
    return run_dirs, out or f"{run_dirs[0]}/plot.png"


def print_loss_gaps(runs: list[RunCurves]) -> None:
    base = runs[0]
    print(f"loss gap to {base.name} (run - {base.name}, over the steps both logged):")
    for run in runs[1:]:
        gap = loss_gap(base, run)
        if gap is None:
            print(f"  {run.name}: no step in common")
            continue
        line = (f"  {run.name}: train |gap| mean {gap['train_mean_abs']:.4f} ({gap['train_mean_rel']:.2%}), "
                f"signed mean {gap['train_mean']:+.4f}, max {gap['train_max_abs']:.4f} at step {gap['train_max_step']}, "
                f"over {gap['steps']} steps")
        if "val_step" in gap:
            line += f"; val loss at step {gap['val_step']}: {gap['val_other']:.4f} vs {gap['val_base']:.4f} ({gap['val_other'] - gap['val_base']:+.4f})"
        print(line)


def main(argv: list[str] | None = None) -> int:
    def body():
        run_dirs, out = parse(sys.argv[1:] if argv is None else argv)
        runs = [RunCurves(Path(d)) for d in run_dirs]
        print(f"wrote {plot_curves(runs, out)}")
        if len(runs) > 1:
            print_loss_gaps(runs)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
