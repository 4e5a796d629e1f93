"""Complete checkpoints with Orbax: save, find the newest complete one, restore (resharding).

A checkpoint step folder holds three items:
    state   the TrainState PyTree: model, optimizer state, step, RNG key
    data    the data iterator's state (JSON)
    meta    the resolved config, the model shape and whether the step was "good" (JSON)

Orbax writes each step under a temporary name and renames it when complete, so
`latest_step()` never returns a half-written step; temporary folders left by a
kill are removed when the manager opens. Restoring takes the *current* state's
shapes and shardings as the target, so a checkpoint written on 8 devices can be
read onto 1 (or the other way) and is resharded on the fly.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from lib.config import ARCHITECTURE

ITEMS = ("state", "data", "meta")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the fix."""


TMP_MARKER = ".orbax-checkpoint-tmp"


def remove_incomplete_steps(directory: str | Path) -> list[str]:
    """Delete the temporary folders a killed save leaves behind (Orbax renames complete ones)."""
    directory = Path(directory)
    if jax.process_index() != 0 or not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if TMP_MARKER in p.name]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]


def open_manager(
    directory: str | Path,
    *,
    keep_last: int,
    keep_every: int = 0,
    async_save: bool = True,
    keep_good: int = 0,
    temporary_path_class: type | None = None,
) -> ocp.CheckpointManager:
    """`keep_good` > 0 also keeps that many newest "good" checkpoints (the rollback targets) past `keep_last`."""
    removed = remove_incomplete_steps(directory)
    if removed:
        print(f"removed incomplete checkpoint folders: {', '.join(removed)}", file=sys.stderr)
    directory = Path(directory).absolute()
    retention: dict = {"max_to_keep": keep_last if keep_last > 0 else None, "keep_period": keep_every if keep_every > 0 else None}
    if keep_good > 0 and keep_last > 0:
        policies = [ocp.checkpoint_managers.LatestN(n=keep_last), KeepNewestGood(directory, keep_good)]
        if keep_every > 0:
            policies.append(ocp.checkpoint_managers.EveryNSteps(keep_every))
        retention = {"preservation_policy": ocp.checkpoint_managers.AnyPreservationPolicy(policies)}
    options = ocp.CheckpointManagerOptions(
        **retention,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
        temporary_path_class=temporary_path_class,
        # What the training loop waits for is only the device-to-host copy. `save` below already removes
        # a step it replaces, so Orbax's own existence check (a filesystem call on a fresh thread, ~30 ms
        # on a busy 2-core host) is skipped, and the step folders are created in the background.
        file_options=ocp.options.FileOptions(skip_sync_file_validations=True),
        async_options=ocp.options.AsyncOptions(create_directories_asynchronously=True) if async_save else None,
    )
    return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)


def is_good(directory: str | Path, step: int) -> bool:
    """Whether checkpoint `step` was saved while no anomaly was open (meta `good`); unreadable = not good."""
    try:
        return bool(json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text()).get("good", False))
    except (OSError, json.JSONDecodeError):
        return False


class KeepNewestGood:
    """Orbax preservation policy: keep the `n` newest good checkpoints, so a rollback always has a target."""

    def __init__(self, directory: Path, n: int):
        self.directory, self.n = directory, n

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        good = sorted((c.step for c in checkpoints if is_good(self.directory, c.step)), reverse=True)[: self.n]
        return [c.step in good for c in checkpoints]


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_state: dict, meta: dict) -> None:
    """Start saving `state` at `step` (async); replaces an existing save of the same step."""
    if step in manager.all_steps():
        # Orbax silently skips a step it already has; after a rollback that step's content is new.
        manager.wait_until_finished()
        manager.delete(step)
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        ),
        force=True,
    )


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
    path = Path(manager.directory) / str(step) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint step {step} in {manager.directory} has no readable meta ({type(exc).__name__}); "
            "it is damaged: move it aside (do not delete other steps) or use a new run_dir"
        ) from exc


def check_model_matches(meta: dict, model_cfg: dict, where: str) -> None:
    """Refuse a checkpoint of another architecture; execution choices (remat, dtype, chunking, attention) may change."""
    saved = meta.get("model", {})
    diff = {k: (saved[k], model_cfg[k]) for k in ARCHITECTURE if k in saved and k in model_cfg and saved[k] != model_cfg[k]}
    if diff:
        desc = ", ".join(f"{k}: checkpoint {a} vs config {b}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {where} belongs to a different model shape ({desc}); use a new run_dir or matching model.* settings")


def abstract_like(tree: Any) -> Any:
    """Shapes, dtypes and shardings of `tree`: the restore target (Orbax reshards to it)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def restore(manager: ocp.CheckpointManager, step: int, like_state: Any, model_cfg: dict) -> tuple[Any, dict, dict]:
    """Restore (state, data_state, meta) of `step`, shaped and sharded like `like_state`."""
    where = f"{manager.directory}/{step}"
    meta = read_meta(manager, step)
    check_model_matches(meta, model_cfg, where)
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_like(like_state)),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
    except Exception as exc:  # orbax raises many types; the user needs one message
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CheckpointError(
            f"cannot read checkpoint {where}: {first}; it may be damaged or from another model: use a new run_dir "
            "or move the damaged step aside"
        ) from exc
    return restored["state"], restored["data"], restored["meta"]


def complete_steps(manager: ocp.CheckpointManager) -> list[int]:
    return sorted(manager.all_steps())


def restore_model(manager: ocp.CheckpointManager, step: int, model_cfg) -> Any:
    """Only the `model` subtree of the saved TrainState, placed on the default device.

    A partial restore: it needs neither the optimizer nor the guard's state, so
    evaluation, generation and weight export read any run's checkpoint."""
    import equinox as eqx

    from lib.model import Llama

    abstract = eqx.filter_eval_shape(Llama, model_cfg, jax.random.PRNGKey(0))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"model": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)}
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True,
        )))
    except Exception as exc:  # orbax raises many types; the user needs one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CheckpointError(
            f"cannot read the model from {manager.directory}/{step}: {first}; it may be damaged: choose another step=N"
        ) from exc
    return restored["state"]["model"]
