"""Score a trained checkpoint on held-out data: loss, perplexity and bits per byte, per source.

    python -m recipes.evaluate run_dir=runs/quickstart
    python -m recipes.evaluate run_dir=runs/quickstart step=200 batches=10 batch_size=8
    python -m recipes.evaluate run_dir=runs/quickstart 'data.sources=[{name: mine, path: data/mine}]'

`step` picks a checkpoint (default: the newest), `batches` caps the batches per
source (default 0: the whole validation split), `batch_size` is the rows per
batch. Every other `key=value` overrides the run's own config (as stored in the
checkpoint), e.g. other data. The report is printed and written to
`<run_dir>/eval-step<N>.json`.
"""

from __future__ import annotations

import json
import sys

import jax

from lib.config import ConfigError
from lib.corpus import DataError
from lib.data import PackedSequences, resolve_corpora
from lib.errors import run_cli
from lib.evaluation import combine, padded_batches, score, summarize, token_byte_lengths
from lib.train_state import make_eval_step
from lib.trained_run import open_run

RECIPE_KEYS = {"run_dir": None, "step": None, "batches": "0", "batch_size": "8"}


def split_args(argv: list[str], recipe_keys: dict) -> tuple[dict, list[str]]:
    """Recipe arguments (`run_dir=...`, ...) apart from config overrides (everything else)."""
    args, overrides = dict(recipe_keys), []
    for item in argv:
        key, sep, value = item.partition("=")
        if sep and key in recipe_keys:
            args[key] = value
        else:
            overrides.append(item)
    if not args.get("run_dir"):
        raise ConfigError("give the run to use: run_dir=runs/NAME (the folder recipes.pretrain wrote)")
    return args, overrides


def as_int(args: dict, key: str) -> int | None:
    if args[key] is None:
        return None
    try:
        return int(args[key])
    except ValueError:
        raise ConfigError(f"{key}={args[key]!r} is not a whole number; write for example {key}=8") from None


def to_device(batch: dict) -> dict:
    return {k: jax.device_put(v) for k, v in batch.items() if k not in ("source", "index")}


def evaluate(argv: list[str]) -> dict:
    args, overrides = split_args(argv, RECIPE_KEYS)
    batch_size, max_batches = as_int(args, "batch_size"), as_int(args, "batches")
    if batch_size < 1 or max_batches < 0:
        raise ConfigError("batch_size must be >= 1 and batches >= 0 (0 = the whole validation split)")
    run = open_run(args["run_dir"], as_int(args, "step"), overrides)
    cfg = run.cfg
    corpora = resolve_corpora(cfg.data, cfg.model.vocab_size)
    byte_lengths = token_byte_lengths(corpora[0].tokenizer())
    eval_step = make_eval_step()

    per_source = {}
    for corpus in corpora:
        split = PackedSequences(corpus, "val")
        n = len(split) if max_batches == 0 else min(len(split), max_batches * batch_size)
        if n == 0:
            print(f"skipping '{corpus.name}': its validation split is empty", file=sys.stderr)
            continue
        batches = padded_batches([split[i] for i in range(n)], batch_size, cfg.model.vocab_size, cfg.data.document_mask)
        per_source[corpus.name] = score(eval_step, run.model, batches, to_device, byte_lengths)
    if not per_source:
        raise DataError("no data source has a validation split to score; prepare data with --val-percent above 0")

    report = {"run_dir": str(run.run_dir), "step": run.step, "sources": {k: summarize(v) for k, v in per_source.items()}}
    report["all"] = summarize(combine(per_source))
    print(f"{run.run_dir} step {run.step}")
    print(f"{'source':<16}{'tokens':>10}{'loss':>10}{'ppl':>10}{'bits/byte':>11}")
    rows = list(report["sources"].items()) + ([("all", report["all"])] if len(per_source) > 1 else [])
    for name, s in rows:
        bpb = f"{s['bits_per_byte']:>11.4f}" if "bits_per_byte" in s else f"{'-':>11}"
        print(f"{name:<16}{s['tokens']:>10}{s['loss']:>10.4f}{s['ppl']:>10.2f}{bpb}")
    (run.run_dir / f"eval-step{run.step}.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: evaluate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
