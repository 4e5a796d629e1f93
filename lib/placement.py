"""Where a recipe's state and batches live: one device (parallel=single) or a mesh (parallel=fsdp).

The recipe asks the placement to build the state, to keep the train step's
shardings, and to turn host batches into device arrays; it never branches on
the parallelism itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lib import distributed, sharding
from lib.config import Config, ConfigError, ParallelConfig
from lib.train_state import model_loss_sum


class Placement:
    def __init__(self, mesh: Mesh | None, min_shard_bytes: int):
        self.mesh = mesh  # None: the default device, nothing sharded
        self.min_shard_bytes = min_shard_bytes

    def __str__(self) -> str:
        if self.mesh is None:
            return "single device"
        return "mesh " + " x ".join(f"{name}={size}" for name, size in self.mesh.shape.items())

    def init_state(self, build: Callable[[], Any]) -> Any:
        if self.mesh is None:
            return build()
        return sharding.init_sharded(build, self.mesh, self.min_shard_bytes)

    def model_view(self, model: Any) -> Any:
        """The model as the forward pass sees it (activation shardings pinned on a mesh)."""
        return model if self.mesh is None else sharding.fsdp_model_view(self.mesh)(model)

    def loss_sum(self, model: Any, batch: dict, z_loss: float):
        """The forward pass and loss the train and eval steps run (see lib/train_state.py)."""
        return model_loss_sum(self.model_view(model), batch, z_loss)

    def schedule_line(self) -> str:
        return ""  # only a pipeline has a schedule to announce

    def log_row(self) -> dict:
        return {}  # only a pipeline has a schedule to log

    def train_step(self, step: Callable, state: Any) -> Callable:
        return step if self.mesh is None else sharding.keep_state_sharding(step, state, self.mesh)

    def train_batch(self, rows: dict) -> dict:
        """This process's rows of the global batch -> device arrays."""
        if self.mesh is None:
            return jax.device_put(rows)
        return distributed.global_batch(rows, sharding.batch_sharding(self.mesh))

    def eval_batch(self, rows: dict) -> dict:
        """A batch every process holds whole (validation) -> device arrays, split if it divides evenly."""
        if self.mesh is None:
            return jax.device_put(rows)
        n_rows = len(next(iter(rows.values())))
        batch_devices = math.prod(self.mesh.shape[a] for a in sharding.BATCH_AXES)
        # A short last validation batch may not split evenly; then every device evaluates all of it.
        where = sharding.batch_sharding(self.mesh) if n_rows % batch_devices == 0 else NamedSharding(self.mesh, P())
        return distributed.same_on_every_process(rows, where)

    def plan(self, state: Any) -> str:
        """The table path -> shape -> PartitionSpec -> bytes per device for `state`."""
        mesh = self.mesh or sharding.make_mesh(ParallelConfig(), devices=jax.devices()[:1])
        shardings = jax.tree.map(lambda x: x.sharding, state) if self.mesh else sharding.state_shardings(state, mesh, self.min_shard_bytes)
        held = sharding.device_bytes(state)  # measured from the arrays' shards, not from the specs
        total = sum(x.nbytes for x in jax.tree.leaves(state))
        measured = f"measured: at most {max(held.values())} of {total} state bytes on any of this process's {len(held)} devices"
        return sharding.format_plan(sharding.plan_rows(state, shardings)) + "\n" + measured


def make_placement(cfg: Config) -> Placement:
    """The placement for `cfg.parallel`; for fsdp it first joins the multi-process run, if any,
    because jax.distributed must start before anything else touches the devices."""
    p = cfg.parallel
    if p.name == "pipeline":
        from lib.pipeline import Pipeline  # single-process: multi-host pipelines are not wired up yet

        return Pipeline(cfg)
    if p.name == "single":
        spec = distributed.detect_cluster(p)
        if spec is not None and (spec.num_processes or 1) > 1:
            raise ConfigError(f"parallel=single runs in one process but {spec.num_processes} were launched; add parallel=fsdp")
        return Placement(None, p.min_shard_bytes)
    if p.name != "fsdp":
        raise ConfigError(f"parallel.name={p.name!r}: choose single, fsdp or pipeline (conf/parallel/)")
    distributed.initialize(p)
    mesh = sharding.make_mesh(p)
    sharding.check_batch_divisible(cfg.trainer.batch_size, cfg.optim.accum_steps, mesh)
    return Placement(mesh, p.min_shard_bytes)
