"""MFU of a ~1B LLaMA in bf16 on one accelerator: run this whenever an H100/H200/TPU is at hand.

    python -m recipes.bench_gpu                  # ~1.1B params, seq 2048, bf16 matmuls, selective remat
    python -m recipes.bench_gpu --batch 8 --remat layer --json runs/gpu.json
    python -m recipes.bench_gpu --tiny           # the same script on a toy shape (CPU smoke check)
    python -m recipes.bench_gpu --attention blocked   # only the portable attention (default on a GPU: cudnn, then blocked)

It times the project's real train step (`lib/train_state.py`, AdamW, fp32 master
weights, bf16 compute, chunked LM head + loss), median of repeats after warm-up,
and prints tokens/s, model FLOP/s and MFU against the peak-FLOPs table in
`lib/metrics.py` (or `--peak-flops`), once per attention implementation
(`model.attention_impl`: cuDNN's flash attention and the portable blocked one);
one failing does not stop the others. Target on one H100/H200: >= 50% MFU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import equinox as eqx
import jax

from lib.config import ATTENTION_IMPLS, ModelConfig
from lib.metrics import flops_per_token, lookup_peak_flops, measure_matmul_peak
from lib.model import Llama, count_params
from recipes.bench import bench_jax, count_at_least, prepare_output_folder

# logits_chunk / attention_block: 512 positions per LM-head chunk ([8, 512, 32000] fp32 logits = 0.5 GB) and
# 4 causal query blocks over 2048 positions (the CPU default of 128 would make 16 small ones).
ONE_B = ModelConfig(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, d_ff=5632, vocab_size=32000,
                    compute_dtype="bfloat16", remat="selective", logits_chunk=512, attention_block=512)
TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                   compute_dtype="bfloat16", remat="selective", logits_chunk=16, attention_block=16)


def attention_impls(spec: str | None) -> list[str]:
    """--attention: the implementations to time, each compiled and measured on its own."""
    if spec is None:  # on a GPU, cuDNN's flash attention first, then the portable blocked attention
        return ["cudnn", "blocked"] if jax.default_backend() == "gpu" else ["blocked"]
    impls = [s for s in spec.split(",") if s]
    if not impls or not set(impls) <= set(ATTENTION_IMPLS):
        raise SystemExit(f"error: --attention {spec!r}: give a comma-separated list of {', '.join(ATTENTION_IMPLS)}")
    return impls


def measure(cfg: ModelConfig, seq_len: int, batch: int, warmup: int, repeats: int, peak: float) -> dict:
    """The project's real train step for this config: compiled once, median of repeats."""
    run = bench_jax(cfg, seq_len, batch, warmup, repeats)
    tokens_per_s = batch * seq_len / run["step_s"]
    flops = flops_per_token(cfg, seq_len) * tokens_per_s
    return {"attention_impl": cfg.attention_impl, "compile_s": run["compile_s"], "step_s": run["step_s"],
            "tokens_per_s": tokens_per_s, "model_flops_per_s": flops, "mfu": flops / peak,
            "temp_bytes": run["temp_bytes"], "argument_bytes": run["argument_bytes"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m recipes.bench_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shape, for checking the script itself")
    p.add_argument("--seq-len", type=count_at_least(2), default=None)
    p.add_argument("--batch", type=count_at_least(1), default=None, help="sequences per step")
    p.add_argument("--remat", choices=["none", "layer", "selective"], default=None)
    p.add_argument("--attention", default=None,
                   help="attention implementations to time, e.g. cudnn,blocked (default: cudnn,blocked on a GPU, else blocked)")
    p.add_argument("--repeats", type=count_at_least(1), default=10)
    p.add_argument("--warmup", type=count_at_least(0), default=3)
    p.add_argument("--peak-flops", type=float, default=0.0, help="override the table (FLOP/s of one device)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    prepare_output_folder(args.json)
    impls = attention_impls(args.attention)

    cfg = TINY if args.tiny else ONE_B
    if args.remat:
        cfg = dataclasses.replace(cfg, remat=args.remat)
    seq_len = args.seq_len or (32 if args.tiny else 2048)
    batch = args.batch or (4 if args.tiny else 8)
    kind = jax.devices()[0].device_kind
    peak = args.peak_flops or lookup_peak_flops(kind) or measure_matmul_peak()
    params = count_params(eqx.filter_eval_shape(Llama, cfg, jax.random.PRNGKey(0)))
    print(f"{kind}: {params / 1e9:.2f}B params, batch {batch} x {seq_len}, bf16, remat={cfg.remat}, "
          f"peak {peak / 1e12:.0f} TFLOP/s; attention: {', '.join(impls)}")

    runs = []
    for impl in impls:
        print(f"  attention={impl}: compiling, {args.warmup} warm-up and {args.repeats} timed steps ...", file=sys.stderr)
        try:  # one implementation failing (cuDNN missing, out of memory) must not cost the others' figures
            run = measure(dataclasses.replace(cfg, attention_impl=impl), seq_len, batch, args.warmup, args.repeats, peak)
        except Exception as exc:  # noqa: BLE001 - reported, then the next implementation runs
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            runs.append({"attention_impl": impl, "error": f"{type(exc).__name__}: {reason}"})
            print(f"  attention={impl:<8} failed: {runs[-1]['error']}")
            continue
        runs.append(run)
        print(f"  attention={impl:<8} {run['step_s'] * 1e3:.0f} ms/step, {run['tokens_per_s']:,.0f} tokens/s, "
              f"{run['model_flops_per_s'] / 1e12:.1f} TFLOP/s, MFU {run['mfu']:.1%} (compile {run['compile_s']:.0f} s)")
    measured = [r for r in runs if "error" not in r]
    if not measured:
        raise SystemExit("error: no attention implementation could be measured (see the lines above)")
    best = max(measured, key=lambda r: r["mfu"])
    result = {"device": kind, "params": params, "seq_len": seq_len, "batch": batch, "remat": cfg.remat,
              "peak_flops": peak, "runs": runs} | best
    print(f"best: attention={best['attention_impl']}, MFU {best['mfu']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
