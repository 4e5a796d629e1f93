"""Plot training curves of one run, or overlay several:

    python -m recipes.plot run_dir=runs/quickstart                 # -> runs/quickstart/plot.png
    python -m recipes.plot run_dir=runs/a run_dir=runs/b out=compare.png

Also works on a run that is still training (it reads what metrics.jsonl holds so far).
"""

from __future__ import annotations

import sys

from lib.config import ConfigError
from lib.errors import run_cli
from lib.plot import plot_runs


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


def main(argv: list[str] | None = None) -> int:
    def body():
        run_dirs, out = parse(sys.argv[1:] if argv is None else argv)
        print(f"wrote {plot_runs(run_dirs, out)}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
