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


def open_manager(directory: str | Path, *, keep_last: int, keep_every: int = 0, async_save: bool = True) -> ocp.CheckpointManager:
    removed = remove_incomplete_steps(directory)
    if removed:
        print(f"removed incomplete checkpoint folders: {', '.join(removed)}", file=sys.stderr)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep_last if keep_last > 0 else None,
        keep_period=keep_every if keep_every > 0 else None,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=ITEMS)


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
    saved = meta.get("model", {})
    diff = {k: (saved.get(k), v) for k, v in model_cfg.items() if k in saved and saved[k] != v and k not in ("remat", "compute_dtype")}
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
