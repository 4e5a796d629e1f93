"""Find the first bad point of one step: per-layer forward/backward statistics.

    python -m recipes.debug_step run_dir=runs/NAME step=N   # from the run's newest checkpoint before N
    python -m recipes.debug_step bundle=runs/NAME/repro/step_000000N

Re-runs the steps from the checkpoint up to N-1 exactly as the run did, then
reports, for step N, min/max/mean/rms/all-finite of every layer's forward
output, of the loss gradient with respect to each layer's output, and of each
layer's parameter gradients, and names the first layer (forward, then
backward) where a non-finite value appears. Writes the table as JSON to
`out=` (default: debug_step_<N>.json next to the run or bundle).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

from lib.config import ConfigError
from lib.errors import run_cli
from lib.guard import REASONS, StepGuard
from lib.layer_stats import first_nonfinite, layer_report
from lib.repro import device_batch, inputs_from_bundle, inputs_from_run, parse_key_values, run_steps
from lib.train_state import accumulated_grads


def debug_step(args: dict) -> dict:
    if "bundle" in args:
        inputs, training = inputs_from_bundle(args["bundle"])
        default_out = Path(args["bundle"]) / f"debug_step_{inputs.target_step}.json"
    else:
        if "run_dir" not in args or "step" not in args:
            raise ConfigError("give bundle=<repro folder>, or run_dir=<run> and step=<N>")
        try:
            step = int(args["step"])
        except ValueError as exc:
            raise ConfigError(f"step={args['step']!r} is not a step number; give step=N with N >= 1") from exc
        if step < 1:
            raise ConfigError(f"step={step}: steps count from 1")
        inputs, training = inputs_from_run(args["run_dir"], step)
        default_out = Path(args["run_dir"]) / f"debug_step_{step}.json"
    cfg, n = inputs.cfg, inputs.target_step

    state, _ = run_steps(inputs, training, len(inputs.batches) - 1)  # the state going into step N
    batch = device_batch(inputs.batches[-1])
    (loss, grads), _ = jax.jit(accumulated_grads, static_argnums=(2, 3))(state.model, batch, cfg.optim.accum_steps, cfg.optim.z_loss)
    if cfg.guard.enabled:  # the injected gradient faults, as the train step applies them
        loss, grads = StepGuard(cfg.guard).inject_faults(state.guard, loss, grads)
    rows = layer_report(state.model, batch, cfg.optim.z_loss, param_grads=grads)
    _, outcome = training.train_step(state, batch)
    outcome = {k: float(v) for k, v in outcome.items()}

    print(f"step {n} from checkpoint {inputs.start_step}: loss {outcome['loss']:.6g}, grad norm {outcome['grad_norm']:.6g}"
          + (f", skipped ({REASONS[int(outcome['skip_reason'])]})" if outcome.get("skipped") else ""))
    print(f"{'where':<10} {'layer':<32} {'min':>11} {'max':>11} {'mean':>11} {'rms':>11}  finite")
    for r in rows:
        print(f"{r['direction']:<10} {r['name']:<32} {r['min']:>11.4g} {r['max']:>11.4g} {r['mean']:>11.4g} {r['rms']:>11.4g}  "
              f"{'yes' if r['finite'] else 'NO (%d)' % r['nonfinite_count']}")
    bad = first_nonfinite(rows)
    verdict = f"first non-finite value: {bad['direction']} {bad['name']}" if bad else "every layer is finite in forward and backward"
    print(verdict)
    result = {"step": n, "start_step": inputs.start_step, "outcome": outcome, "rows": rows, "first_nonfinite": bad, "verdict": verdict}
    out = Path(args.get("out") or default_out)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: debug_step(parse_key_values(sys.argv[1:] if argv is None else argv, (), ("run_dir", "step", "bundle", "out"))))


if __name__ == "__main__":
    sys.exit(main())
