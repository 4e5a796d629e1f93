"""Pipeline parallelism applied from outside the model: the stacked blocks split into stages.

The model's `blocks` leaves have a leading [n_layers] axis. The pipeline cuts
that stack into R*S equal chunks of K = n_layers/(R*S) layers: chunk c = r*S + s
runs on stage s in its repeat r (GPipe is R = 1; the circular schedule wraps
the layers around the stages R times). A batch is cut into M micro-batches.

At every tick each stage runs one chunk on one micro-batch and hands the
result to the next stage with a collective permute (`ppermute`, inside
`shard_map` over the `stage` mesh axis); the last stage hands it back to stage
0, which parks it in a ring buffer until the micro-batch's next repeat starts
(or, after the last repeat, until the end, when a psum over `stage` hands
the outputs on). Stage s works at tick t on
item i = t - s, that is micro-batch i mod M in repeat i div M, so the whole
batch takes R*M + S - 1 ticks, of which S - 1 per stage are idle (the bubble).
docs/pipeline.md draws the ticks.

Only the blocks are pipelined. The embedding, the final norm, the LM head and
the loss run before and after it under ordinary (automatic) sharding over all
devices, so the loss is computed exactly as the un-pipelined model computes it.

Parameters stay in the single-device layout (stacked [n_layers] leaves), sharded
with the `stage` mesh axis on the layer dimension: each stage stores 1/S of the
stack and of its optimizer state, and checkpoints are interchangeable with
single-device ones. (With R > 1 a stage's chunks are not contiguous in that
layout, so each step moves the stack once to the chunk layout and the
gradients back: an all-to-all over `stage`, the price of a layout-free
checkpoint.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lib.config import Config, ConfigError, ParallelConfig
from lib.model import Llama
from lib.placement import Placement
from lib.train_state import Batch, head_loss_sum, model_loss_sum

MESH_AXES = ("stage", "data", "fsdp")  # stage outermost: it carries the least traffic (activations only)
ROW_AXES = ("data", "fsdp")  # within a stage, each micro-batch's rows are split over these
STACKED_KEYS = ("blocks",)  # PyTree keys whose leaves carry the leading [n_layers] axis
SCHEDULES = ("gpipe", "circular")


@dataclass(frozen=True)
class Schedule:
    """Which stage runs which layers on which micro-batch at each tick."""

    name: str
    stages: int  # S
    microbatches: int  # M
    repeats: int  # R: 1 for GPipe
    layers_per_chunk: int  # K = n_layers / (R * S)

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Idle share of each stage's ticks: (S-1)/(M+S-1) for GPipe, (S-1)/(R*M+S-1) circular."""
        return (self.stages - 1) / self.ticks

    def work(self, stage, tick):
        """(micro-batch, repeat) that `stage` runs at `tick`; Python ints or traced arrays.
        Outside 0 <= tick - stage < R*M the stage idles (its output is never used)."""
        item = tick - stage
        return item % self.microbatches, item // self.microbatches

    def table(self) -> list[list[str]]:
        """rows = stages, columns = ticks; "m3" = micro-batch 3, "m3r1" = micro-batch 3 in repeat 1."""
        rows = []
        for s in range(self.stages):
            row = []
            for t in range(self.ticks):
                micro, repeat = self.work(s, t)
                busy = 0 <= t - s < self.repeats * self.microbatches
                row.append("." if not busy else f"m{micro}" + (f"r{repeat}" if self.repeats > 1 else ""))
            rows.append(row)
        return rows

    def describe(self) -> str:
        formula = "(S-1)/(M+S-1)" if self.repeats == 1 else "(S-1)/(R*M+S-1)"
        return (
            f"pipeline schedule {self.name}: {self.stages} stages x {self.repeats} repeat(s), "
            f"{self.microbatches} micro-batches, {self.layers_per_chunk} layer(s) per stage and repeat, "
            f"{self.ticks} ticks, bubble {formula} = {self.bubble_fraction:.1%}"
        )


def resolve_mesh_shape(p: ParallelConfig, n_devices: int) -> tuple[int, int, int]:
    """(stages, data, fsdp) covering exactly `n_devices`, filling one -1; else a one-line ConfigError."""
    if p.stages < 1 or n_devices % p.stages:
        raise ConfigError(
            f"parallel.stages={p.stages} does not fit the {n_devices} visible devices; "
            f"pick a number of stages that divides {n_devices}"
        )
    left = n_devices // p.stages
    data, fsdp = p.data, p.fsdp
    for name, size in (("parallel.data", data), ("parallel.fsdp", fsdp)):
        if size == 0 or size < -1:
            raise ConfigError(f"{name}={size}: use a positive size, or -1 for the devices left after the stages")
    if data == -1 and fsdp == -1:
        raise ConfigError("parallel.data and parallel.fsdp are both -1; set one of them to a size")
    if data == -1 or fsdp == -1:
        known = fsdp if data == -1 else data
        if left % known:
            raise ConfigError(
                f"{left} devices per stage ({n_devices} / parallel.stages={p.stages}) do not split by {known}; "
                f"pick parallel.data/parallel.fsdp dividing {left}"
            )
        data, fsdp = (left // fsdp, fsdp) if data == -1 else (data, left // data)
    if p.stages * data * fsdp != n_devices:
        raise ConfigError(
            f"parallel.stages={p.stages} x data={data} x fsdp={fsdp} = {p.stages * data * fsdp} devices, "
            f"but {n_devices} are visible; make the product {n_devices} (or set parallel.fsdp=-1)"
        )
    return p.stages, data, fsdp


def make_schedule(p: ParallelConfig, n_layers: int, batch_size: int, accum_steps: int, rows_split: int) -> Schedule:
    """Check that the layers, the batch and the micro-batches fit the stages; one-line errors."""
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={p.schedule!r}: choose gpipe or circular")
    if p.repeats < 1 or (p.schedule == "gpipe" and p.repeats != 1):
        raise ConfigError(
            f"parallel.repeats={p.repeats} with schedule {p.schedule}: GPipe uses repeats=1; "
            "for more repeats set parallel.schedule=circular (repeats >= 1)"
        )
    chunks = p.stages * p.repeats
    if n_layers % chunks:
        raise ConfigError(
            f"model.n_layers={n_layers} does not split into parallel.stages={p.stages} x parallel.repeats={p.repeats} "
            f"= {chunks} equal chunks; pick n_layers a multiple of {chunks}, or fewer stages/repeats"
        )
    if p.microbatches < p.stages:
        raise ConfigError(
            f"parallel.microbatches={p.microbatches} is fewer than parallel.stages={p.stages}: stages would idle "
            f"and the circular schedule needs each micro-batch back at stage 0 in time; set parallel.microbatches>={p.stages}"
        )
    rows = batch_size // accum_steps
    if rows % p.microbatches:
        raise ConfigError(
            f"a batch of {rows} rows (trainer.batch_size={batch_size} / optim.accum_steps={accum_steps}) does not split "
            f"into parallel.microbatches={p.microbatches}; make trainer.batch_size a multiple of {p.microbatches * accum_steps}"
        )
    if (rows // p.microbatches) % rows_split:
        need = p.microbatches * accum_steps * rows_split
        raise ConfigError(
            f"each micro-batch has {rows // p.microbatches} rows but a stage splits rows over data x fsdp = {rows_split} "
            f"devices; make trainer.batch_size a multiple of {need}"
        )
    return Schedule(p.schedule, p.stages, p.microbatches, p.repeats, n_layers // chunks)


def _is_stacked(path) -> bool:
    return any(str(getattr(k, "name", getattr(k, "key", ""))) in STACKED_KEYS for k in path)


def leaf_spec(path, shape: tuple[int, ...], itemsize: int, n_layers: int, fsdp: int, min_shard_bytes: int) -> P:
    """`stage` on the layer axis of stacked leaves (model and optimizer moments alike); within a stage,
    matrices of at least `min_shard_bytes` split over `fsdp` along their largest divisible dimension."""
    stacked = _is_stacked(path) and len(shape) >= 1 and shape[0] == n_layers
    spec: list[str | None] = [None] * len(shape)
    first = 0
    if stacked:
        spec[0], first = "stage", 1
    if fsdp > 1 and len(shape) - first >= 2 and math.prod(shape) * itemsize >= min_shard_bytes:
        divisible = [i for i in range(first, len(shape)) if shape[i] % fsdp == 0]
        if divisible:
            spec[max(divisible, key=lambda i: (shape[i], -i))] = "fsdp"
    return P(*spec)


def micro_rows(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] rows reordered so micro-batch j (rows j, M+j, 2M+j, ...) is the j-th block of B/M rows.
    Rows arrive split over data x fsdp in contiguous blocks; the strided choice keeps every micro-batch
    spread over those devices. The loss is a sum over rows, so the order does not change it."""
    return a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


def run_pipelined_blocks(model: Llama, x, context, schedule: Schedule, mesh: Mesh, stage_remat: bool):
    """The blocks of `model` on micro-batches x [M, mb, T, D] (context likewise [M, mb, ...]) as the
    schedule runs them; equals `model.run_blocks(model.blocks, x[j], *context[j])[0]` for each j."""
    S, M, R, K = schedule.stages, schedule.microbatches, schedule.repeats, schedule.layers_per_chunk
    # Chunk layout [R, S, K, ...]: chunk r*S + s holds layers (r*S + s)*K ... +K-1 and runs on stage s.
    chunks = jax.tree.map(lambda a: a.reshape(R, S, K, *a.shape[1:]), model.blocks)
    # run_blocks reads only the static config; strip the arrays so the stage body closes over none.
    skeleton = eqx.filter(model, eqx.is_array, inverse=True)
    to_next_stage = [(s, (s + 1) % S) for s in range(S)]

    def stage_body(chunks, x, cos, sin, mask):
        chunks = jax.tree.map(lambda a: a[:, 0], chunks)  # this stage's [R, K, ...] layers
        stage = jax.lax.axis_index("stage")
        first = stage == 0

        def run_chunk(h, repeat, micro):
            chunk = jax.tree.map(lambda a: a[repeat], chunks)
            return skeleton.run_blocks(chunk, h, cos[micro], sin[micro], mask[micro])[0]

        if stage_remat:
            run_chunk = jax.checkpoint(run_chunk)

        def park(ring, received, t):
            # Stage 0 keeps what the last stage finished at tick t-1 (item t-S) in its micro-batch's slot.
            slot = (t - S) % M
            keep = first & (t >= S)
            return ring.at[slot].set(jnp.where(keep, received, ring[slot]))

        def tick(carry, t):
            received, ring = carry
            ring = park(ring, received, t)
            micro, repeat = schedule.work(stage, t)
            h = jnp.where(first, ring[t % M], received)  # stage 0 starts item t from its ring
            out = run_chunk(h, jnp.clip(repeat, 0, R - 1), micro)
            return (jax.lax.ppermute(out, "stage", to_next_stage), ring), None

        # Values that differ per stage must be marked so for shard_map's checks (they start equal).
        received = jax.lax.pcast(jnp.zeros_like(x[0]), "stage", to="varying")
        ring = jax.lax.pcast(x, "stage", to="varying")  # embeddings: repeat 0 reads them, then outputs replace them
        (received, ring), _ = jax.lax.scan(tick, (received, ring), jnp.arange(schedule.ticks))
        ring = park(ring, received, schedule.ticks)  # the last item comes home after the final tick
        # Stage 0's ring now holds every output; share it with all stages (the others add zeros).
        return jax.lax.psum(jnp.where(first, ring, jnp.zeros_like(ring)), "stage")

    return jax.shard_map(
        stage_body,
        mesh=mesh,
        in_specs=(P(None, "stage"), P(), P(), P(), P()),
        out_specs=P(),
        axis_names={"stage"},  # manual over stages only: data/fsdp stay automatic inside a stage
    )(chunks, x, *context)


def make_pipelined_loss_sum(schedule: Schedule, mesh: Mesh, stage_remat: bool, row_sharding: Callable[[int], NamedSharding]):
    """A `(model, batch, z_loss) -> (loss sum, valid count)` like train_state.model_loss_sum, pipelined."""
    M = schedule.microbatches

    def loss_sum(model: Llama, batch: Batch, z_loss: float):
        n_rows, seq = batch["tokens"].shape
        if n_rows % (M * math.prod(mesh.shape[a] for a in ROW_AXES)):
            return model_loss_sum(model, batch, z_loss)  # a short validation batch: the plain forward
        rows = row_sharding(n_rows)
        batch = {k: jax.lax.with_sharding_constraint(micro_rows(v, M), rows) for k, v in batch.items()}
        tokens = batch["tokens"]
        as_micro = lambda a: a.reshape(M, n_rows // M, *a.shape[1:])  # noqa: E731
        context = [as_micro(c) for c in model.context(tokens, segment_ids=batch.get("segment_ids"))]
        y = run_pipelined_blocks(model, as_micro(model.embed_tokens(tokens)), context, schedule, mesh, stage_remat)
        # The head and loss split rows over every device, not only one stage's (the head is costly).
        y = jax.lax.with_sharding_constraint(y.reshape(n_rows, seq, -1), rows)
        return head_loss_sum(model, model.final_norm(y), tokens, batch["mask"], z_loss)

    return loss_sum


class Pipeline(Placement):
    """Where a pipelined run's state and batches live, and its forward pass (the recipe's view)."""

    def __init__(self, cfg: Config, devices: list | None = None):
        p = cfg.parallel
        devices = list(jax.devices() if devices is None else devices)
        shape = resolve_mesh_shape(p, len(devices))
        self.schedule = make_schedule(p, cfg.model.n_layers, cfg.trainer.batch_size, cfg.optim.accum_steps, shape[1] * shape[2])
        self.mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)
        self.n_layers = cfg.model.n_layers
        self.min_shard_bytes = p.min_shard_bytes
        self.loss_sum = make_pipelined_loss_sum(self.schedule, self.mesh, p.stage_remat, self.row_sharding)

    def __str__(self) -> str:
        return "mesh " + " x ".join(f"{name}={size}" for name, size in self.mesh.shape.items())

    def row_sharding(self, n_rows: int) -> NamedSharding:
        """Rows over every device when they divide evenly, else over data x fsdp (replicated over stages)."""
        if n_rows % self.mesh.size == 0:
            return NamedSharding(self.mesh, P(MESH_AXES))
        if n_rows % math.prod(self.mesh.shape[a] for a in ROW_AXES) == 0:
            return NamedSharding(self.mesh, P(ROW_AXES))
        return NamedSharding(self.mesh, P())

    def state_shardings(self, tree: Any) -> Any:
        def sharding(path, x):
            spec = leaf_spec(path, x.shape, np.dtype(x.dtype).itemsize, self.n_layers, self.mesh.shape["fsdp"], self.min_shard_bytes)
            return NamedSharding(self.mesh, spec)

        return jax.tree_util.tree_map_with_path(sharding, tree)

    def init_state(self, build: Callable[[], Any]) -> Any:
        """Run `build` under jit with sharded outputs: each device makes only its own stage's shards."""
        arrays, static = eqx.partition(eqx.filter_eval_shape(build), lambda x: isinstance(x, jax.ShapeDtypeStruct))
        made = jax.jit(lambda: eqx.filter(build(), eqx.is_array), out_shardings=self.state_shardings(arrays))()
        return eqx.combine(made, static)

    def train_step(self, step: Callable, state: Any) -> Callable:
        """`step` re-jitted with the new state pinned to the old state's shardings (and donated)."""
        shardings = jax.tree.map(lambda x: x.sharding, state)
        return jax.jit(step, donate_argnums=0, out_shardings=(shardings, NamedSharding(self.mesh, P())))

    def batch(self, rows: dict) -> dict:
        """Host rows -> device arrays split by rows (one process holds the whole batch)."""
        where = self.row_sharding(len(next(iter(rows.values()))))
        return jax.device_put(rows, where)

    train_batch = eval_batch = batch

    def schedule_line(self) -> str:
        return f"{self.schedule.describe()} on {self}"

    def log_row(self) -> dict:
        s = self.schedule
        return {"pipeline_schedule": s.name, "pipeline_stages": s.stages, "pipeline_microbatches": s.microbatches,
                "pipeline_repeats": s.repeats, "pipeline_bubble": s.bubble_fraction}
