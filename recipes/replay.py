"""Replay a repro bundle exactly: `python -m recipes.replay bundle=<run_dir>/repro/step_<N>`.

Restores the bundle's checkpoint, runs the train step over its stored batches
and compares the last step (the one that kept failing) with what the run
recorded. Exit status 0 when it reproduced bitwise, 1 when it did not.
"""

from __future__ import annotations

import json
import sys

from lib.errors import run_cli
from lib.guard import REASONS
from lib.repro import inputs_from_bundle, parse_key_values, run_steps, same_outcome


def replay(bundle: str) -> dict:
    inputs, training = inputs_from_bundle(bundle)
    _, rows = run_steps(inputs, training, len(inputs.batches))
    for row in rows:
        print(f"step {row['step']}: loss {row['loss']:.6g} grad_norm {row['grad_norm']:.6g} "
              f"{'SKIPPED (' + REASONS[int(row.get('skip_reason', 0))] + ')' if row.get('skipped') else ''}")
    last, recorded = rows[-1], inputs.recorded or {}
    result = {"step": inputs.target_step, "recorded": recorded, "replayed": {k: last[k] for k in recorded}, "reproduced": bool(same_outcome(recorded, last))}
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    status = {"ok": False}

    def body():
        args = parse_key_values(sys.argv[1:] if argv is None else argv, required=("bundle",))
        status["ok"] = replay(args["bundle"])["reproduced"]

    code = run_cli(body)
    return code or (0 if status["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
