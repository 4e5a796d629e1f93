"""Plan before you pay: compile the train step for N devices without running it, and say whether it fits.

    python -m recipes.plan +exp=llama3_8b_v5p                      # the exp sets plan.devices / plan.accelerator
    python -m recipes.plan +exp=smoke parallel=fsdp plan.devices=8 plan.accelerator=v5e

The state is abstract (shapes from `eqx.filter_eval_shape`: a 70B model is never
materialised); the mesh is made of `plan.devices` simulated CPU devices, so this
runs on a laptop. XLA compiles the real SPMD program ahead of time and reports,
per device, its arguments, outputs and temporaries (activations, gathered
weights, gradients). Those figures come from XLA's CPU compiler: a TPU or GPU
compiler fuses and lays out differently, so read them as an estimate with a
margin, not a guarantee.
"""

from __future__ import annotations

import math
import os
import sys
import time

# Simulated devices must be set before JAX starts its CPU backend, i.e. before anything imports jax.
if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp

from lib import sharding
from lib.config import Config, ConfigError
from lib.errors import run_cli
from lib.metrics import flops_per_token
from lib.model import Llama
from lib.optim import lr_schedule, make_optimizer
from lib.train_state import init_train_state, make_train_step

GiB = 1024**3
# Memory per chip, GiB.
ACCELERATOR_MEMORY_GIB = {"v5p": 95, "v4": 32, "v5e": 16, "v6e": 32, "h100": 80, "h200": 141, "a100": 80}


def abstract_state(cfg: Config, optimizer):
    key = jax.random.PRNGKey(cfg.trainer.seed)
    return eqx.filter_eval_shape(lambda: init_train_state(Llama(cfg.model, key), optimizer, cfg.trainer.seed))


def abstract_batch(cfg: Config, batch_sharding) -> dict:
    shape = (cfg.trainer.batch_size, cfg.data.seq_len)
    batch = {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding),
        "mask": jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=batch_sharding),
    }
    if cfg.data.document_mask:
        batch["segment_ids"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
    return batch


def with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def per_device_bytes(tree, shardings) -> int:
    return sum(r[4] for r in sharding.plan_rows(tree, shardings))


def plan(cfg: Config) -> dict:
    """Compile the train step for the configured mesh; return the per-device budget and the verdict."""
    n = cfg.plan.devices
    if jax.device_count() != n:
        raise ConfigError(
            f"plan.devices={n} but this process has {jax.device_count()} devices; "
            "run `python -m recipes.plan` in a fresh process (it sets up the simulated devices itself)"
        )
    accelerator = cfg.plan.accelerator.lower()
    if accelerator and accelerator not in ACCELERATOR_MEMORY_GIB:
        raise ConfigError(f"plan.accelerator={cfg.plan.accelerator!r}: choose one of {', '.join(ACCELERATOR_MEMORY_GIB)} (or leave it empty)")
    if cfg.parallel.name != "fsdp" and n > 1:
        raise ConfigError(f"plan.devices={n} needs parallel=fsdp (parallel={cfg.parallel.name} uses one device)")
    parallel = cfg.parallel if cfg.parallel.name == "fsdp" else type(cfg.parallel)(data=1, fsdp=1)
    mesh = sharding.make_mesh(parallel)
    sharding.check_batch_divisible(cfg.trainer.batch_size, cfg.optim.accum_steps, mesh)

    shapes_only = eqx.filter_eval_shape(Llama, cfg.model, jax.random.PRNGKey(cfg.trainer.seed))
    optimizer = make_optimizer(cfg.optim, shapes_only, cfg.trainer.steps)
    state = abstract_state(cfg, optimizer)
    shardings = sharding.state_shardings(state, mesh, parallel.min_shard_bytes)
    state = with_shardings(state, shardings)
    if cfg.parallel.print_plan:
        print(sharding.format_plan(sharding.plan_rows(state, shardings)), file=sys.stderr)

    schedule = lr_schedule(cfg.optim, cfg.trainer.steps)
    step = make_train_step(optimizer, schedule, cfg.optim.accum_steps, cfg.optim.z_loss, model_view=sharding.fsdp_model_view(mesh))
    t0 = time.perf_counter()
    compiled = sharding.keep_state_sharding(step, state, mesh).lower(state, abstract_batch(cfg, sharding.batch_sharding(mesh))).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost

    tokens = cfg.trainer.batch_size * cfg.data.seq_len
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.model))
    # Donated state buffers are reused for the new state: count them once.
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes
    report = {
        "devices": n,
        "mesh": dict(mesh.shape),
        "params": params,
        "tokens_per_step": tokens,
        "params_bytes_per_device": per_device_bytes(state.model, shardings.model),
        "opt_state_bytes_per_device": per_device_bytes(state.opt_state, shardings.opt_state),
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "peak_bytes_per_device": peak,
        "xla_flops_per_device": float(cost.get("flops", 0.0)) if cost else 0.0,
        "model_flops_per_step": flops_per_token(cfg.model, cfg.data.seq_len) * tokens,
        "compile_s": compile_s,
        "accelerator": accelerator,
    }
    if accelerator:
        report["accelerator_bytes"] = ACCELERATOR_MEMORY_GIB[accelerator] * GiB
        report["fits"] = peak <= report["accelerator_bytes"]
    return report


def format_report(cfg: Config, r: dict) -> str:
    fb = sharding.format_bytes
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"plan for {cfg.exp_name}: {r['params'] / 1e9:.3g}B params on {r['devices']} devices ({mesh}), compiled in {r['compile_s']:.1f}s",
        f"  tokens/step            {r['tokens_per_step']:,} ({cfg.trainer.batch_size} x {cfg.data.seq_len}, {cfg.optim.accum_steps} micro-batch(es))",
        f"  FLOPs/step (6N + attn) {r['model_flops_per_step']:.3e}   (XLA's cost analysis: {r['xla_flops_per_device']:.3e} per device, counting the layer loop once)",
        "  per device:",
        f"    parameters           {fb(r['params_bytes_per_device'])}",
        f"    optimizer state      {fb(r['opt_state_bytes_per_device'])}",
        f"    XLA arguments        {fb(r['argument_bytes'])}   (state + batch)",
        f"    XLA temporaries      {fb(r['temp_bytes'])}   (activations, gathered weights, gradients)",
        f"    XLA outputs          {fb(r['output_bytes'])}   ({fb(r['alias_bytes'])} reuse donated inputs)",
        f"    peak estimate        {fb(r['peak_bytes_per_device'])}",
    ]
    if r["accelerator"]:
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"  {verdict} on {r['accelerator']} ({fb(r['accelerator_bytes'])} per chip; peak {r['peak_bytes_per_device'] / r['accelerator_bytes']:.0%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from lib.config import load_config

    def body():
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        if cfg.plan.devices < 1:
            raise ConfigError(f"plan.devices={cfg.plan.devices}: give the number of devices to plan for (>= 1)")
        try:
            jax.config.update("jax_num_cpu_devices", cfg.plan.devices)
        except RuntimeError:
            pass  # JAX already started (an in-process caller): plan() checks the device count
        print(format_report(cfg, plan(cfg)))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
