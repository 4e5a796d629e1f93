"""Benchmark the real train step against PyTorch on the same model, in one run.

    python -m recipes.bench                        # all shapes, JAX vs PyTorch eager vs torch.compile
    python -m recipes.bench --shapes issue --repeats 10 --no-compile
    python -m recipes.bench --json runs/bench.json

For each shape it prints tokens/s, model FLOP/s (6 x matmul weights + attention,
per token), MFU against the measured fp32 matmul peak of this machine, compile
time, and the JAX / PyTorch ratios. It then times the data loader alone and the
stall an async checkpoint save puts on the loop. Step times are medians of
repeats after warm-up, each closed by `block_until_ready` (JAX) or a host copy
of the loss (PyTorch). Needs the `torch` extra for the PyTorch columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from lib.config import DataConfig, ModelConfig, OptimConfig
from lib.metrics import flops_per_token, measure_matmul_peak
from lib.model import Llama
from lib.optim import lr_schedule, make_optimizer
from lib.train_state import init_train_state, make_train_step

SHAPES = {
    # The shape of the performance issue: d256, 4 layers, 4 heads, SwiGLU 768, vocab 8192, seq 256, batch 8.
    "issue": (ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=768, vocab_size=8192), 256, 8),
    "quickstart": (ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, vocab_size=4096), 256, 8),
    "wide": (ModelConfig(d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=1536, vocab_size=8192), 256, 4),
}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_batch(cfg: ModelConfig, seq_len: int, batch: int, seed: int = 0):
    tokens = np.random.default_rng(seed).integers(2, cfg.vocab_size, (batch, seq_len), dtype=np.int32)
    return tokens, np.ones_like(tokens, dtype=bool)


def jax_step_setup(cfg: ModelConfig, seq_len: int, batch: int):
    """The project's real train step (AdamW, default optimizer settings), a fresh state and a random batch."""
    model = Llama(cfg, jax.random.PRNGKey(0))
    ocfg = OptimConfig()
    optimizer = make_optimizer(ocfg, model, 1000)
    tokens, mask = random_batch(cfg, seq_len, batch)
    device_batch = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}
    return init_train_state(model, optimizer, 0), device_batch, make_train_step(optimizer, lr_schedule(ocfg, 1000))


def bench_jax(cfg: ModelConfig, seq_len: int, batch: int, warmup: int, repeats: int) -> dict:
    state, device_batch, step = jax_step_setup(cfg, seq_len, batch)
    t0 = time.perf_counter()
    compiled = step.lower(state, device_batch).compile()
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def one():
        holder["state"], metrics = compiled(holder["state"], device_batch)
        jax.block_until_ready(metrics["loss"])

    for _ in range(warmup):
        one()
    memory = compiled.memory_analysis()
    return {"step_s": median_time(one, repeats), "compile_s": compile_s,
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None), "argument_bytes": getattr(memory, "argument_size_in_bytes", None)}


def bench_torch(cfg: ModelConfig, seq_len: int, batch: int, warmup: int, repeats: int, compile: bool) -> dict:
    import torch

    from recipes.torch_llama import make_torch_step

    torch.manual_seed(0)
    step = make_torch_step(cfg, compile=compile)
    tokens, mask = random_batch(cfg, seq_len, batch)
    t, m = torch.from_numpy(tokens).long(), torch.from_numpy(mask).float()
    t0 = time.perf_counter()
    step(t, m).item()  # the first call compiles under torch.compile
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        step(t, m).item()
    return {"step_s": median_time(lambda: step(t, m).item(), repeats), "compile_s": compile_s}


def torch_matmul_peak(n: int = 1024, repeats: int = 20) -> float:
    import torch

    a = torch.ones(n, n)
    a @ a
    best = min(median_time(lambda: a @ a, 1) for _ in range(repeats))
    return 2 * n**3 / best


def bench_data(seq_len: int, batch: int, n_batches: int = 200) -> float:
    from lib.data import resolve_corpora, train_batches

    cfg = DataConfig(seq_len=seq_len)
    corpora = resolve_corpora(cfg, 4096)
    it = iter(train_batches(corpora, cfg, global_batch=batch, vocab_size=4096))
    next(it)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        next(it)
    return n_batches * batch * seq_len / (time.perf_counter() - t0)


def bench_checkpoint_stall(cfg: ModelConfig, seq_len: int, batch: int, repeats: int) -> dict:
    """How long an async save holds up the loop, against the median step time."""
    from lib import checkpoint as ckpt

    state, device_batch, step = jax_step_setup(cfg, seq_len, batch)
    with tempfile.TemporaryDirectory() as tmp:
        manager = ckpt.open_manager(tmp, keep_last=2)
        state, _ = step(state, device_batch)
        step_times, save_times = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            state, metrics = step(state, device_batch)
            jax.block_until_ready(metrics["loss"])
            step_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ckpt.save(manager, i + 1, state, {"step": i + 1}, {"model": {}})
            save_times.append(time.perf_counter() - t0)
        manager.wait_until_finished()
        manager.close()
    # Each save happens between steps; the loop stalls for the save call (the rest runs in the background).
    return {"save_call_s": statistics.median(save_times), "step_s": statistics.median(step_times)}


def compiled_memory(cfg: ModelConfig, seq_len: int, batch: int) -> dict:
    """XLA's memory analysis of the compiled train step (nothing runs): temporaries = activations + workspace."""
    shapes = jax.eval_shape(lambda: init_train_state(Llama(cfg, jax.random.PRNGKey(0)), make_optimizer(OptimConfig(), Llama(cfg, jax.random.PRNGKey(0)), 10), 0))
    batch_shapes = {"tokens": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32), "mask": jax.ShapeDtypeStruct((batch, seq_len), jnp.bool_)}
    optimizer = make_optimizer(OptimConfig(), shapes.model, 10)
    memory = make_train_step(optimizer, lr_schedule(OptimConfig(), 10)).lower(shapes, batch_shapes).compile().memory_analysis()
    return {"temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes)}


def bench_memory(cfg: ModelConfig, seq_len: int, batch: int) -> dict:
    """Temporaries of the step for each remat policy, with and without the chunked LM head + loss."""
    rows = {}
    print(f"compiled memory of one train step (batch {batch} x {seq_len}, vocab {cfg.vocab_size}):")
    for remat in ("none", "layer", "selective"):
        for chunk in (0, 1024):
            mem = compiled_memory(dataclasses.replace(cfg, remat=remat, logits_chunk=chunk), seq_len, batch)
            rows[f"remat={remat},logits_chunk={chunk}"] = mem
            base = rows["remat=none,logits_chunk=0"]["temp_bytes"]
            print(f"  remat={remat:<9} logits_chunk={chunk:<5} temporaries {mem['temp_bytes'] / 2**20:8.1f} MiB "
                  f"({mem['temp_bytes'] / base - 1:+.0%} vs none/unchunked)")
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m recipes.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch columns")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to compile on CPU)")
    p.add_argument("--no-memory", action="store_true", help="skip the remat / chunked-loss memory table")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    peaks = {"jax": measure_matmul_peak()}
    if not args.no_torch:
        peaks["torch"] = torch_matmul_peak()
    peak = max(peaks.values())
    print(f"device: {jax.devices()[0].device_kind}; measured fp32 1024^3 matmul peak: "
          + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items()))
    results = {"peak_flops": peak, "peaks": peaks, "shapes": {}}
    header = f"{'shape':<11} {'impl':<14} {'tokens/s':>9} {'GFLOP/s':>8} {'MFU':>6} {'compile s':>9} {'vs eager':>8}"
    print(header + "\n" + "-" * len(header))
    for name in args.shapes:
        cfg, seq_len, batch = SHAPES[name]
        runs = {"jax": bench_jax(cfg, seq_len, batch, args.warmup, args.repeats)}
        if not args.no_torch:
            runs["torch eager"] = bench_torch(cfg, seq_len, batch, args.warmup, args.repeats, compile=False)
            if not args.no_compile:
                runs["torch.compile"] = bench_torch(cfg, seq_len, batch, args.warmup, args.repeats, compile=True)
        fpt = flops_per_token(cfg, seq_len)
        eager = runs.get("torch eager", {}).get("step_s")
        for impl, r in runs.items():
            r["tokens_per_s"] = batch * seq_len / r["step_s"]
            r["model_flops_per_s"] = fpt * r["tokens_per_s"]
            r["mfu"] = r["model_flops_per_s"] / peak
            ratio = f"{eager / r['step_s']:.2f}x" if eager else "-"
            print(f"{name:<11} {impl:<14} {r['tokens_per_s']:>9.0f} {r['model_flops_per_s'] / 1e9:>8.1f} "
                  f"{r['mfu']:>6.1%} {r['compile_s']:>9.1f} {ratio:>8}")
        results["shapes"][name] = {"config": dataclasses.asdict(cfg), "seq_len": seq_len, "batch": batch, "runs": runs}

    cfg, seq_len, batch = SHAPES[args.shapes[0]]
    results["data_tokens_per_s"] = bench_data(seq_len, batch)
    print(f"data loader alone (Grain, stdlib corpus, batch {batch} x {seq_len}): {results['data_tokens_per_s']:,.0f} tokens/s")
    stall = bench_checkpoint_stall(cfg, seq_len, batch, repeats=4)
    results["checkpoint"] = stall
    print(f"async checkpoint save: the loop waits {stall['save_call_s'] * 1e3:.1f} ms per save "
          f"= {stall['save_call_s'] / stall['step_s']:.1%} of a {stall['step_s'] * 1e3:.0f} ms step ({args.shapes[0]})")
    if not args.no_memory:
        results["memory"] = bench_memory(cfg, seq_len, 4 * batch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
