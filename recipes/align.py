"""Align two setups: same weights, same batches, compare forward -> loss -> grads -> update -> curve.

    python -m recipes.align [KEY=VALUE ...] [a.KEY=VALUE ...] [b.KEY=VALUE ...] [b=hf] [align.KEY=VALUE ...]

    KEY=VALUE         config override for BOTH setups (Hydra syntax: +exp=smoke, model.d_model=64, ...)
    a.KEY=VALUE       override for setup a only (+a.KEY=VALUE for a new key)
    b.KEY=VALUE       override for setup b only, e.g. b.model.compute_dtype=bfloat16, b.parallel=fsdp
    b=hf              setup b is transformers' LlamaForCausalLM on the same weights (needs the torch extra)
    align.steps=N     training steps in the loss-curve comparison (default 5)
    align.report=P    where the JSON report goes (default runs/align/report.json)
    align.init_from=P weights for both (HF folder, weights folder or run_dir); default: random init from trainer.seed
    align.tolerance=  auto | float32 | bfloat16 (auto: the lower precision of the two setups)
    align.rtol_scale= multiply every tolerance
    align.fault=      self-test: plant a known difference in setup b (lib/align_faults.py):
                      layer_scale:L:F     scale block L's output projections by F  -> forward "layer L"
                      shift_labels        score each position against the token two ahead -> "loss"
                      grad_scale:LEAF[:L]:F  scale the gradient of LEAF (layer L) by F -> grads "LEAF[L]"

Examples:
    python -m recipes.align +exp=smoke b.model.compute_dtype=bfloat16
    python -m recipes.align +exp=smoke b.optim.accum_steps=2 b.model.remat=layer
    python -m recipes.align +exp=smoke b=hf
    python -m recipes.align +exp=smoke align.fault=layer_scale:1:1.01      # must report layer 1
    JAX_NUM_CPU_DEVICES=8 python -m recipes.align +exp=smoke trainer.batch_size=8 b.parallel=fsdp
    JAX_NUM_CPU_DEVICES=8 python -m recipes.align +exp=smoke trainer.batch_size=8 model.n_layers=4 \
        b.parallel=pipeline b.parallel.stages=4 b.parallel.microbatches=4

Exit status: 0 aligned, 1 diverged (the table names the first divergence), 2 bad input.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np

from lib.align import (AlignConfig, HFReferenceSetup, PROFILES, Report, build_setup, compare, same_weights, tolerance_profile,
                       write_report)
from lib.align_faults import parse_fault
from lib.config import Config, ConfigError, load_config
from lib.data import resolve_corpora, train_batches
from lib.errors import run_cli
from lib.model import Llama
from lib.weights import load_model, read_architecture, with_architecture

HOST_ONLY_KEYS = ("source", "index")


def split_args(argv: list[str]) -> tuple[list[str], list[str], list[str], bool, dict[str, str]]:
    """-> (overrides for both, for a, for b, b is the HF reference, align.* options)."""
    both, only_a, only_b, opts = [], [], [], {}
    hf = False
    for arg in argv:
        if arg == "b=hf":
            hf = True
            continue
        prefix = arg[: len(arg) - len(arg.lstrip("+~"))]
        rest = arg[len(prefix):]
        if "=" not in rest and not prefix.startswith("~"):
            raise ConfigError(f"argument {arg!r} is not KEY=VALUE; see python -m recipes.align --help")
        if rest.startswith("align."):
            key, _, value = rest[len("align."):].partition("=")
            opts[key] = value
        elif rest.startswith(("a.", "b.")):
            (only_a if rest[0] == "a" else only_b).append(prefix + rest[2:])
        else:
            both.append(arg)
    return both, only_a, only_b, hf, opts


def parse_align_options(opts: dict[str, str]) -> AlignConfig:
    fields = {f.name: f for f in dataclasses.fields(AlignConfig)}
    values = {}
    for key, raw in opts.items():
        if key not in fields:
            raise ConfigError(f"unknown option align.{key}; valid: {', '.join('align.' + k for k in fields)}")
        kind = {"int": int, "float": float}.get(str(fields[key].type), str)
        try:
            values[key] = kind(raw)
        except ValueError as exc:
            raise ConfigError(f"align.{key}={raw!r} is not a valid {kind.__name__}") from exc
    return AlignConfig(**values)


def check_same_batches(cfg_a: Config, cfg_b: Config) -> None:
    diff = ["data.*"] if cfg_a.data != cfg_b.data else []
    if cfg_a.trainer.batch_size != cfg_b.trainer.batch_size:
        diff.append("trainer.batch_size")
    if diff:
        raise ConfigError(f"the setups must read identical batches but differ in {diff}; give those overrides to both sides")


def first_batches(cfg: Config, n: int) -> list[dict]:
    """Train batches 0..n-1 exactly as recipes.pretrain sees them (a pure function of the step)."""
    corpora = resolve_corpora(cfg.data, cfg.model.vocab_size)
    it = iter(train_batches(corpora, cfg.data, global_batch=cfg.trainer.batch_size, vocab_size=cfg.model.vocab_size,
                            weights=[s.weight for s in cfg.data.sources]))
    return [{k: v for k, v in next(it).items() if k not in HOST_ONLY_KEYS} for _ in range(n)]


def run(argv: list[str]) -> bool:
    both, only_a, only_b, hf, opts = split_args(argv)
    options = parse_align_options(opts)
    if hf and only_b:
        raise ConfigError(f"b=hf is transformers itself; drop the b.* overrides {only_b}")
    cfg_a = load_config(both + only_a)
    cfg_b = None if hf else load_config(both + only_b)
    if options.init_from:
        source = read_architecture(options.init_from)
        cfg_a = dataclasses.replace(cfg_a, model=with_architecture(cfg_a.model, source))
        cfg_b = cfg_b and dataclasses.replace(cfg_b, model=with_architecture(cfg_b.model, source))
    if cfg_b is not None:
        check_same_batches(cfg_a, cfg_b)
    profile = tolerance_profile(cfg_a, cfg_b, options.tolerance)
    tol = PROFILES[profile].scaled(options.rtol_scale)

    weights = load_model(options.init_from, cfg_a.model) if options.init_from else Llama(cfg_a.model, jax.random.PRNGKey(cfg_a.trainer.seed))
    setup_a = build_setup("a", cfg_a, same_weights(weights, cfg_a))
    model_b = same_weights(weights, cfg_b or cfg_a)
    fault = parse_fault(options.fault, model_b)
    if hf and fault.kind not in ("", "layer_scale"):
        raise ConfigError(f"align.fault={options.fault!r} changes the jax training code; with b=hf only layer_scale applies")
    setup_b = HFReferenceSetup("b", cfg_a, fault.weights(model_b)) if hf else build_setup("b", cfg_b, model_b, fault)

    print(f"a: {setup_a.description}   [{' '.join(both + only_a)}]", file=sys.stderr)
    print(f"b: {setup_b.description}   [{' '.join(['b=hf'] if hf else both + only_b)}]"
          f"{'   fault ' + options.fault if options.fault else ''}", file=sys.stderr)
    batches = first_batches(cfg_a, max(options.steps, 1))
    report = Report(
        setups={
            "a": {"overrides": both + only_a, "description": setup_a.description},
            "b": {"overrides": ["b=hf"] if hf else both + only_b, "description": setup_b.description, "fault": options.fault},
        },
        profile=f"{profile} x{options.rtol_scale:g}",
        tolerances=tol,
        rows=compare(setup_a, setup_b, batches, tol),
    )
    tokens = int(np.prod(batches[0]["tokens"].shape))
    print(f"tolerance profile {report.profile}; {len(batches)} batch(es) of {tokens} tokens", file=sys.stderr)
    print(report.table())
    print(f"report: {write_report(report, options.report)}", file=sys.stderr)
    return report.ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    outcome = {}
    code = run_cli(lambda: outcome.setdefault("ok", run(argv)))
    return code or (0 if outcome["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
