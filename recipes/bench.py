"""Benchmark the real train step against PyTorch on the same model, in one run.

    python -m recipes.bench                        # all shapes, JAX vs PyTorch eager vs torch.compile
    python -m recipes.bench --shapes issue --repeats 10 --no-compile
    python -m recipes.bench --json runs/bench.json
    python -m recipes.bench --shapes issue --variants "" attention_block=0 logits_chunk=0   # what a setting buys
    python -m recipes.bench --shapes issue --default-malloc   # without trainer.keep_host_memory's malloc settings

For each shape it prints tokens/s, model FLOP/s (6 x matmul weights + attention,
per token), MFU against the measured fp32 1024^3 matmul peak of this machine
(timed in the same race, so that this VM's drift moves both alike), compile
time, and the JAX / PyTorch ratios; then the "matmul floor": the step's own
matmuls (read from its jaxpr), run back to back in the same race, i.e. the
tokens/s and MFU of a step that ran its matmuls and nothing else (a yardstick:
the real step can beat it). It then times the data loader alone and the
stall an async checkpoint save puts on the loop. Step times are medians of
repeats after warm-up, each closed by `block_until_ready` (JAX) or a host copy
of the loss (PyTorch). Needs the `torch` extra for the PyTorch columns.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from lib.config import DataConfig, ModelConfig, OptimConfig
from lib.host_memory import keep_freed_memory
from lib.jaxprs import equations
from lib.metrics import flops_per_token
from lib.model import Llama
from lib.optim import lr_schedule, make_optimizer
from lib.train_state import init_train_state, make_train_step

SHAPES = {
    # The shape of the performance issue: d256, 4 layers, 4 heads, SwiGLU 768, vocab 8192, seq 256, batch 8.
    "issue": (ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=768, vocab_size=8192, scan_unroll=4), 256, 8),
    "quickstart": (ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, vocab_size=4096, scan_unroll=4), 256, 8),
    "wide": (ModelConfig(d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=1536, vocab_size=8192, scan_unroll=4), 256, 4),
}
# Every other model setting is the default: fused chunked LM head + loss (logits_chunk=64), causal attention in
# blocks of 128, no remat, fp32. scan_unroll=4 is what conf/model/small.yaml sets for these 4-layer models.


def count_at_least(minimum: int):
    """An argparse type: an integer >= minimum, so that `--repeats 0` is a one-line usage error, not a traceback."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def prepare_output_folder(path: str | None) -> None:
    """Create the results' folder up front (`--json runs/bench.json` on a fresh clone), and fail before
    minutes of timing, not after, if it cannot be made."""
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror
            raise SystemExit(f"error: --json {path}: cannot create the folder {folder} ({why}); choose another path")


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def race(steps: dict[str, Callable[[], None]], warmup: int, repeats: int, label: str | None = None) -> dict[str, float]:
    """Median seconds per call of each step, the steps taking turns (a, b, c, a, b, c, ...) so that a
    machine that speeds up or slows down during the run (turbo, neighbours on a VM) shifts all of them alike.

    With a `label`, a progress bar on stderr counts the turns (ETA) and shows each step's median so far."""
    bar = tqdm(total=warmup + repeats, desc=label, unit="turn", leave=False, disable=label is None, file=sys.stderr)
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    bar.update(warmup)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        bar.set_postfix_str(", ".join(f"{name} {statistics.median(t) * 1e3:.0f} ms" for name, t in times.items()))
        bar.update(1)
    bar.close()
    return {name: statistics.median(t) for name, t in times.items()}


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


def jax_runner(cfg: ModelConfig, seq_len: int, batch: int) -> dict:
    """The compiled step as a callable that runs one step to completion, with compile time and memory."""
    state, device_batch, step = jax_step_setup(cfg, seq_len, batch)
    t0 = time.perf_counter()
    compiled = step.lower(state, device_batch).compile()
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def one():
        holder["state"], metrics = compiled(holder["state"], device_batch)
        jax.block_until_ready(metrics["loss"])

    memory = compiled.memory_analysis()
    return {"step": one, "compile_s": compile_s,
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None), "argument_bytes": getattr(memory, "argument_size_in_bytes", None)}


def bench_jax(cfg: ModelConfig, seq_len: int, batch: int, warmup: int, repeats: int) -> dict:
    """Median step time of the real train step alone (what recipes.bench_gpu reports)."""
    run = jax_runner(cfg, seq_len, batch)
    step = run.pop("step")
    return {"step_s": race({"jax": step}, warmup, repeats)["jax"], **run}


def torch_runner(cfg: ModelConfig, seq_len: int, batch: int, compile: bool) -> dict:
    import torch

    from recipes.torch_llama import make_torch_step

    torch.manual_seed(0)
    step = make_torch_step(cfg, compile=compile)
    tokens, mask = random_batch(cfg, seq_len, batch)
    t, m = torch.from_numpy(tokens).long(), torch.from_numpy(mask).float()
    t0 = time.perf_counter()
    step(t, m).item()  # the first call compiles under torch.compile
    return {"step": lambda: step(t, m).item(), "compile_s": time.perf_counter() - t0}


def peak_runner(with_torch: bool, n: int = 1024, calls: int = 3) -> dict:
    """The fp32 n^3 matmul peak as a racer: each turn runs the matmul `calls` times in JAX (and PyTorch)
    and keeps the best rate of the turn. Taking turns with the steps, the peak sees the same machine as
    they do: a peak measured once, at a fast or slow moment of this VM, would move every MFU with it."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x).lower(a).compile()
    runs = {"jax": lambda: mm(a).block_until_ready()}
    if with_torch:
        import torch

        b = torch.ones(n, n)
        runs["torch"] = lambda: b @ b
    rates: dict[str, list[float]] = {name: [] for name in runs}

    def one():
        for name, fn in runs.items():
            best_s = min(median_time(fn, 1) for _ in range(calls))  # each median_time(fn, 1) is one timed call
            rates[name].append(2 * n**3 / best_s)

    return {"step": one, "rates": rates}


def raced_peak(rates: dict[str, list[float]], warmup: int) -> dict[str, float]:
    """Median over the race's turns (warm-up turns left out) of each framework's best rate in a turn."""
    return {name: statistics.median(r[warmup:]) for name, r in rates.items()}


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


def bench_checkpoint_stall(cfg: ModelConfig, seq_len: int, batch: int, saves: int = 4, every: int = 3) -> dict:
    """What an async save costs the loop, done as recipes.pretrain does it: the step finishes, then `save`.

    `save_call_s` is the stall: the loop waits for the save call (the device-to-host copy and Orbax's
    set-up), the files are written in the background. On a small host that background writing competes
    with the next step for the CPU; `next_step_extra_s` is how much slower the step after a save runs."""
    from lib import checkpoint as ckpt

    state, device_batch, step = jax_step_setup(cfg, seq_len, batch)
    save_calls, after_save, plain = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        manager = ckpt.open_manager(tmp, keep_last=2)
        state, _ = step(state, device_batch)
        for i in range(saves * every + 1):
            t0 = time.perf_counter()
            state, metrics = step(state, device_batch)
            jax.block_until_ready(metrics["loss"])
            (after_save if i % every == 1 and i > 1 else plain).append(time.perf_counter() - t0)
            if i % every == 0 and i > 0:
                t0 = time.perf_counter()
                ckpt.save(manager, i, state, {"step": i}, {"model": {}})
                save_calls.append(time.perf_counter() - t0)
        manager.wait_until_finished()
        manager.close()
    step_s = statistics.median(plain)
    return {"save_call_s": statistics.median(save_calls), "step_s": step_s, "next_step_extra_s": statistics.median(after_save) - step_s}


def step_matmuls(cfg: ModelConfig, seq_len: int, batch: int) -> collections.Counter:
    """Every dot_general the train step runs: (lhs shape, rhs shape, dtype, dimension numbers) -> times per step.

    Read from the step's jaxpr (forward, backward, optimizer), counting a scan body once per iteration."""
    state, device_batch, step = jax_step_setup(cfg, seq_len, batch)
    found: collections.Counter = collections.Counter()
    for eqn, times in equations(jax.make_jaxpr(step)(state, device_batch)):
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            found[(lhs.shape, rhs.shape, str(lhs.dtype), eqn.params["dimension_numbers"])] += times
    return found


def matmul_runner(cfg: ModelConfig, seq_len: int, batch: int) -> dict:
    """The step's matmuls alone, as a callable that runs each one (jitted on its own) as often as the step does.

    It takes part in the race, so it sees the same machine as the step. A step that ran these back to back,
    each on all cores, and nothing else (no norms, softmax, RoPE, optimizer or copies) would take as long:
    a yardstick, not a bound, since in the step XLA may overlap independent matmuls (the fused head's dh and
    dW run side by side, a core each)."""
    calls, flops = [], 0.0
    for (lhs_shape, rhs_shape, dtype, dims), times in step_matmuls(cfg, seq_len, batch).items():
        lhs, rhs = jnp.ones(lhs_shape, dtype), jnp.ones(rhs_shape, dtype)
        matmul = jax.jit(lambda a, b, dims=dims: jax.lax.dot_general(a, b, dims)).lower(lhs, rhs).compile()
        (lhs_contract, _), _ = dims
        flops += times * 2 * int(np.prod(matmul.out_info.shape)) * int(np.prod([lhs_shape[d] for d in lhs_contract]))
        calls.append((matmul, lhs, rhs, times))

    def one():
        for matmul, lhs, rhs, times in calls:
            for _ in range(times):
                matmul(lhs, rhs).block_until_ready()

    return {"step": one, "matmul_flops": flops}


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
        for chunk in (0, 64):
            mem = compiled_memory(dataclasses.replace(cfg, remat=remat, logits_chunk=chunk), seq_len, batch)
            rows[f"remat={remat},logits_chunk={chunk}"] = mem
            base = rows["remat=none,logits_chunk=0"]["temp_bytes"]
            print(f"  remat={remat:<9} logits_chunk={chunk:<5} temporaries {mem['temp_bytes'] / 2**20:8.1f} MiB "
                  f"({mem['temp_bytes'] / base - 1:+.0%} vs none/unchunked)")
    return rows


def parse_variant(cfg: ModelConfig, spec: str) -> ModelConfig:
    """'attention_block=0,logits_chunk=32' -> cfg with those model fields replaced ('' = cfg itself)."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    changes = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"error: --variants: {key!r} is not a model setting; choose from {', '.join(fields)}")
        kind = type(getattr(cfg, key))
        try:
            changes[key] = value.lower() in ("1", "true") if kind is bool else kind(value)
        except ValueError:
            raise SystemExit(f"error: --variants: {key}={value!r} must be of type {kind.__name__}, e.g. {key}={getattr(cfg, key)}") from None
    return dataclasses.replace(cfg, **changes)


def bench_variants(name: str, specs: list[str], warmup: int, repeats: int) -> dict:
    """The real JAX step of one shape under several model settings, raced in turns: what a change buys."""
    cfg, seq_len, batch = SHAPES[name]
    runners = {spec or "(as is)": jax_runner(parse_variant(cfg, spec), seq_len, batch) for spec in specs}
    medians = race({spec: r["step"] for spec, r in runners.items()}, warmup, repeats, label=name)
    base = next(iter(medians.values()))
    for spec, step_s in medians.items():
        print(f"{name:<11} {spec:<40} {step_s * 1e3:8.1f} ms {batch * seq_len / step_s:9.0f} tokens/s {base / step_s:6.2f}x")
    return medians


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m recipes.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--warmup", type=count_at_least(0), default=2)
    p.add_argument("--repeats", type=count_at_least(1), default=8)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch columns")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to compile on CPU)")
    p.add_argument("--no-memory", action="store_true", help="skip the remat / chunked-loss memory table")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc as it is (the recipe keeps freed host memory: trainer.keep_host_memory)")
    p.add_argument("--variants", nargs="+", metavar="KEY=VALUE[,KEY=VALUE]",
                   help="instead: race the JAX step of the first shape under these model settings ('' = as is)")
    args = p.parse_args(argv)
    prepare_output_folder(args.json)
    if not args.no_torch and not args.variants and importlib.util.find_spec("torch") is None:
        raise SystemExit("error: the PyTorch columns need torch: pip install -e '.[torch]', or pass --no-torch")
    if not args.default_malloc:
        keep_freed_memory()  # as recipes.pretrain does, before JAX starts its threads
    if args.variants:
        return {"variants": bench_variants(args.shapes[0], args.variants, args.warmup, args.repeats)}

    print(f"device: {jax.devices()[0].device_kind}")
    results = {"shapes": {}}
    header = f"{'shape':<11} {'impl':<14} {'tokens/s':>9} {'GFLOP/s':>8} {'MFU':>6} {'compile s':>9} {'vs eager':>8}"
    print(header + "\n" + "-" * len(header))
    for name in args.shapes:
        cfg, seq_len, batch = SHAPES[name]
        print(f"{name}: compiling the steps, then {args.warmup} warm-up and {args.repeats} timed turns ...", file=sys.stderr)
        runs = {"jax": jax_runner(cfg, seq_len, batch)}
        if not args.no_torch:
            runs["torch eager"] = torch_runner(cfg, seq_len, batch, compile=False)
            if not args.no_compile:
                runs["torch.compile"] = torch_runner(cfg, seq_len, batch, compile=True)
        floor = matmul_runner(cfg, seq_len, batch)
        peak_run = peak_runner(with_torch=not args.no_torch)
        medians = race({**{impl: r.pop("step") for impl, r in runs.items()}, "(matmuls)": floor.pop("step"),
                        "(peak)": peak_run["step"]}, args.warmup, args.repeats, label=name)
        floor["floor_s"] = medians.pop("(matmuls)")
        medians.pop("(peak)")
        peaks = raced_peak(peak_run["rates"], args.warmup)
        peak = max(peaks.values())
        for impl, r in runs.items():
            r["step_s"] = medians[impl]
        fpt = flops_per_token(cfg, seq_len)
        eager = runs.get("torch eager", {}).get("step_s")
        for impl, r in runs.items():
            r["tokens_per_s"] = batch * seq_len / r["step_s"]
            r["model_flops_per_s"] = fpt * r["tokens_per_s"]
            r["mfu"] = r["model_flops_per_s"] / peak
            ratio = f"{eager / r['step_s']:.2f}x" if eager else "-"
            print(f"{name:<11} {impl:<14} {r['tokens_per_s']:>9.0f} {r['model_flops_per_s'] / 1e9:>8.1f} "
                  f"{r['mfu']:>6.1%} {r['compile_s']:>9.1f} {ratio:>8}")
        floor["mfu"] = fpt * batch * seq_len / floor["floor_s"] / peak
        print(f"{name:<11} {'(matmuls)':<14} {batch * seq_len / floor['floor_s']:>9.0f} {'':>8} {floor['mfu']:>6.1%}"
              f"   the step's {floor['matmul_flops'] / 1e9:.1f} GFLOP of matmuls alone, one after another")
        print(f"{name:<11} {'(1024^3 peak)':<14} {'':>9} {peak / 1e9:>8.1f} {'100%':>6}   fp32 1024^3 matmul, best of 3 per turn: "
              + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()) + " GFLOP/s")
        results["shapes"][name] = {"config": dataclasses.asdict(cfg), "seq_len": seq_len, "batch": batch, "runs": runs,
                                   "matmul_floor": floor, "peak_flops": peak, "peaks": peaks, "peak_turns": peak_run["rates"]}

    cfg, seq_len, batch = SHAPES[args.shapes[0]]
    results["data_tokens_per_s"] = bench_data(seq_len, batch)
    print(f"data loader alone (Grain, stdlib corpus, batch {batch} x {seq_len}): {results['data_tokens_per_s']:,.0f} tokens/s")
    stall = bench_checkpoint_stall(cfg, seq_len, batch)
    results["checkpoint"] = stall
    print(f"async checkpoint save: the loop waits {stall['save_call_s'] * 1e3:.1f} ms per save "
          f"= {stall['save_call_s'] / stall['step_s']:.1%} of a {stall['step_s'] * 1e3:.0f} ms step ({args.shapes[0]}); "
          f"the background write then slows the next step by {stall['next_step_extra_s'] * 1e3:.0f} ms")
    if not args.no_memory:
        results["memory"] = bench_memory(cfg, seq_len, 4 * batch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
