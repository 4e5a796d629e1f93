"""FSDP-style sharding applied from outside the model: a mesh, and rules from PyTree leaves to PartitionSpecs.

The mesh has two axes. `fsdp` splits every large leaf of the state (parameters
and, by the same rules, the optimizer's moments) along one dimension, so each
device stores 1/fsdp of it; `data` holds replicas of that split (pure data
parallelism, e.g. one replica per host or per slice). Batch rows are split over
both axes. Nothing here inserts communication: XLA's SPMD partitioner turns the
shardings into all-gathers of weights before use and reduce-scatters of
gradients (the ZeRO-3 / FSDP pattern).

The rules read only a leaf's path and shape, so they apply unchanged to the
model, to the optimizer state (whose `mu`/`nu` mirror the model's paths) and to
abstract `ShapeDtypeStruct` trees (recipes/plan.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lib.config import ConfigError, ParallelConfig

MESH_AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")  # batch rows are split over every device
# PyTree keys whose leaves carry a leading [n_layers] axis (the model scans over it). That axis is
# never split: each scan step reads one layer, which would then live on one device only.
STACKED_KEYS = ("blocks",)


def resolve_mesh_shape(data: int, fsdp: int, n_devices: int) -> tuple[int, int]:
    """(data, fsdp) with a -1 filled in; a one-line ConfigError when they cannot cover `n_devices`."""
    sizes = {"parallel.data": data, "parallel.fsdp": fsdp}
    for name, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"{name}={size}: use a positive size, or -1 for all the devices left")
    if data == -1 and fsdp == -1:
        raise ConfigError("parallel.data and parallel.fsdp are both -1; set one of them to a size")
    known = data if fsdp == -1 else fsdp
    if data == -1 or fsdp == -1:
        if n_devices % known:
            raise ConfigError(
                f"the mesh cannot fill {n_devices} devices: {n_devices} is not divisible by {known}; "
                f"pick parallel.data/parallel.fsdp whose product is {n_devices}"
            )
        data, fsdp = (n_devices // fsdp, fsdp) if data == -1 else (data, n_devices // data)
    if data * fsdp != n_devices:
        raise ConfigError(
            f"mesh data={data} x fsdp={fsdp} = {data * fsdp} devices, but {n_devices} are visible; "
            f"make the product {n_devices} (or set one axis to -1)"
        )
    return data, fsdp


def make_mesh(cfg: ParallelConfig, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(cfg.data, cfg.fsdp, len(devices))
    # Auto axes: XLA propagates shardings and picks the collectives (the classic jit + NamedSharding model).
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def _key_name(key) -> str:
    return str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key))))


def path_str(path) -> str:
    return ".".join(_key_name(k) for k in path)


def leaf_spec(path, shape: tuple[int, ...], itemsize: int, fsdp_size: int, min_shard_bytes: int) -> P:
    """The FSDP rule: a matrix of at least `min_shard_bytes` is split over `fsdp` along its largest
    divisible dimension (never the stacked layer axis); vectors, scalars and small leaves stay whole."""
    first = 1 if any(_key_name(k) in STACKED_KEYS for k in path) else 0
    if fsdp_size == 1 or len(shape) - first < 2 or math.prod(shape) * itemsize < min_shard_bytes:
        return P()
    divisible = [i for i in range(first, len(shape)) if shape[i] % fsdp_size == 0]
    if not divisible:
        return P()  # no even split: kept whole (the plan table shows it)
    dim = max(divisible, key=lambda i: (shape[i], -i))
    return P(*(["fsdp" if i == dim else None for i in range(len(shape))]))


def fsdp_partition_specs(tree: Any, fsdp_size: int, min_shard_bytes: int) -> Any:
    """A PartitionSpec for every array leaf of `tree` (concrete or abstract)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: leaf_spec(path, x.shape, np.dtype(x.dtype).itemsize, fsdp_size, min_shard_bytes), tree
    )


def state_shardings(tree: Any, mesh: Mesh, min_shard_bytes: int) -> Any:
    specs = fsdp_partition_specs(tree, mesh.shape["fsdp"], min_shard_bytes)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def check_batch_divisible(batch_size: int, accum_steps: int, mesh: Mesh) -> None:
    """Every micro-batch is split evenly over all devices of the mesh."""
    n = math.prod(mesh.shape[a] for a in BATCH_AXES)
    micro = batch_size // accum_steps
    if micro % n:
        raise ConfigError(
            f"the mesh splits each batch over {n} devices, but a micro-batch has {micro} rows "
            f"(trainer.batch_size={batch_size} / optim.accum_steps={accum_steps}); "
            f"make trainer.batch_size a multiple of {n * accum_steps}"
        )


def shard_bytes(shape: tuple[int, ...], dtype, sharding: NamedSharding) -> int:
    """Bytes one device stores for a leaf of `shape` under `sharding` (even splits: the same on all)."""
    return math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize


def plan_rows(tree: Any, shardings: Any) -> list[tuple[str, tuple, str, int, int]]:
    """(path, shape, spec, total bytes, bytes per device) for every array leaf."""
    rows = []
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    for (path, x), sharding in zip(leaves, jax.tree.leaves(shardings)):
        total = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        rows.append((path_str(path), tuple(x.shape), str(sharding.spec), total, shard_bytes(x.shape, x.dtype, sharding)))
    return rows


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_plan(rows: list[tuple[str, tuple, str, int, int]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'path':<{width}}  {'shape':<22} {'spec':<28} {'bytes/device':>12}"]
    for path, shape, spec, _, per_device in rows:
        lines.append(f"{path:<{width}}  {str(shape):<22} {spec:<28} {format_bytes(per_device):>12}")
    total, per_device = sum(r[3] for r in rows), sum(r[4] for r in rows)
    lines.append(f"{'total':<{width}}  {format_bytes(total):<22} {'':<28} {format_bytes(per_device):>12}")
    return "\n".join(lines)


def device_bytes(tree: Any) -> dict:
    """Bytes each local device actually holds of `tree`'s arrays (measured from the shards)."""
    held: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def init_sharded(build: Callable[[], Any], mesh: Mesh, min_shard_bytes: int) -> Any:
    """Run `build` (which returns a state PyTree) under jit with sharded outputs: each device
    creates only its own shards, so a model larger than one device's memory can be initialised."""
    abstract = eqx.filter_eval_shape(build)
    arrays, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    shardings = state_shardings(arrays, mesh, min_shard_bytes)
    made = jax.jit(lambda: eqx.filter(build(), eqx.is_array), out_shardings=shardings)()
    return eqx.combine(made, static)


class BatchShardedBlocks(eqx.Module):
    """The model's block stack with each block's input and output pinned to batch-split rows.

    Without this anchor XLA's propagation may keep a weight's split and gather the
    *activations* instead (tensor-parallel style), which materialises the global
    batch on every device; pinned, it gathers the weights (FSDP). Used only as the
    forward pass's view of the model (make_train_step's model_view): the stored
    state, its checkpoints and the model code are unchanged."""

    blocks: eqx.Module
    rows: NamedSharding = eqx.field(static=True)

    def __call__(self, x, *args, **kwargs):
        x = jax.lax.with_sharding_constraint(x, self.rows)
        return jax.lax.with_sharding_constraint(self.blocks(x, *args, **kwargs), self.rows)


def fsdp_model_view(mesh: Mesh) -> Callable[[Any], Any]:
    rows = batch_sharding(mesh)
    return lambda model: eqx.tree_at(lambda m: m.blocks, model, BatchShardedBlocks(model.blocks, rows))


def keep_state_sharding(step: Callable, state: Any, mesh: Mesh) -> Callable:
    """The train step jitted with its new state pinned to the old state's shardings (and donated),
    so step n+1 sees the inputs step n was compiled for; the metrics come back replicated."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(step, donate_argnums=0, out_shardings=(shardings, NamedSharding(mesh, P())))
