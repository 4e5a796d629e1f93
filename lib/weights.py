"""Where a model's starting weights come from: an HF folder, an imported weights folder, or a run.

`trainer.init_from=PATH` (pretraining/fine-tuning) and `align.init_from=PATH`
accept any of

    HF folder       config.json + *.safetensors          (lib/hf.py)
    weights folder  model.json + weights/ (Orbax)        (written by `recipes.hf_convert import`)
    run_dir         checkpoints/<step>/ from pretrain    (its newest complete step, or `step`)

The source decides the architecture (d_model, layers, heads, vocabulary, RoPE,
norm eps, tying); the run's config keeps its own execution choices (remat,
compute dtype), which do not change the weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import equinox as eqx
import jax

from lib import checkpoint as ckpt
from lib.checkpoint import CheckpointError
from lib.config import ARCHITECTURE, Config, ModelConfig, from_dict
from lib.model import Llama

WEIGHTS_FORMAT = "jaxpretrain-weights-v1"


def source_kind(path: str | Path) -> str:
    path = Path(path)
    if (path / "model.json").is_file() and (path / "weights").is_dir():
        return "weights"
    if (path / "config.json").is_file():
        return "hf"
    if (path / "checkpoints").is_dir():
        return "run"
    raise CheckpointError(
        f"init_from={path}: not an HF folder (config.json), a weights folder (model.json) or a run_dir (checkpoints/); "
        "check the path or convert with python -m recipes.hf_convert import"
    )


def _open_run(path: Path, step: int | None):
    manager = ckpt.open_manager(path / "checkpoints", keep_last=0, async_save=False)
    steps = ckpt.complete_steps(manager)
    if not steps:
        raise CheckpointError(f"{path}/checkpoints holds no complete checkpoint; train first or point at another run")
    if step is not None and step not in steps:
        raise CheckpointError(f"{path}/checkpoints has no step {step}; it has {steps}")
    step = steps[-1] if step is None else step
    return manager, step, from_dict(ckpt.read_meta(manager, step)["config"])


def read_architecture(path: str | Path, step: int | None = None) -> ModelConfig:
    path = Path(path)
    kind = source_kind(path)
    if kind == "hf":
        from lib.hf import read_config

        return read_config(path)
    if kind == "weights":
        return ModelConfig(**json.loads((path / "model.json").read_text())["model"])
    manager, _, cfg = _open_run(path, step)
    manager.close()
    return cfg.model


def with_architecture(model_cfg: ModelConfig, source: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model_cfg, **{k: getattr(source, k) for k in ARCHITECTURE})


def adopt_init_architecture(cfg: Config) -> Config:
    """`cfg` with the model architecture of `trainer.init_from` (unchanged when it is empty)."""
    if not cfg.trainer.init_from:
        return cfg
    model = with_architecture(cfg.model, read_architecture(cfg.trainer.init_from))
    return dataclasses.replace(cfg, model=model)


def with_execution_config(model: Llama, model_cfg: ModelConfig) -> Llama:
    """The same arrays under `model_cfg`'s static choices (remat, compute dtype)."""
    abstract = eqx.filter_eval_shape(Llama, model_cfg, jax.random.PRNGKey(0))
    leaves = jax.tree.leaves(model)
    if [x.shape for x in leaves] != [x.shape for x in jax.tree.leaves(abstract)]:
        raise ValueError("with_execution_config: model_cfg describes another architecture than the model's")
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves)


def load_model(path: str | Path, model_cfg: ModelConfig, step: int | None = None) -> Llama:
    """The weights at `path` as a Llama run with `model_cfg` (whose architecture must match the source's)."""
    path = Path(path)
    source = read_architecture(path, step)
    if with_architecture(model_cfg, source) != model_cfg:
        diff = ", ".join(f"{k}: source {getattr(source, k)} vs config {getattr(model_cfg, k)}" for k in ARCHITECTURE if getattr(source, k) != getattr(model_cfg, k))
        raise CheckpointError(f"{path} holds a different architecture ({diff}); drop those model.* overrides")
    kind = source_kind(path)
    if kind == "hf":
        from lib.hf import load_llama

        model, _ = load_llama(path)
    elif kind == "weights":
        model = _restore_weights(path, source)
    else:
        model = _restore_run_model(path, step)
    return with_execution_config(model, model_cfg)


def _restore_weights(path: Path, model_cfg: ModelConfig) -> Llama:
    import orbax.checkpoint as ocp

    abstract = eqx.filter_eval_shape(Llama, model_cfg, jax.random.PRNGKey(0))
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), params)
    try:
        restored = ocp.StandardCheckpointer().restore((path / "weights").absolute(), target)
    except Exception as exc:  # orbax raises many types; the user needs one message
        raise CheckpointError(f"cannot read weights in {path}: {(str(exc).splitlines() or [type(exc).__name__])[0][:200]}") from exc
    return eqx.combine(restored, static)


def _restore_run_model(path: Path, step: int | None) -> Llama:
    manager, step, cfg = _open_run(path, step)
    try:
        return ckpt.restore_model(manager, step, cfg.model)
    finally:
        manager.close()


def save_weights(model: Llama, folder: str | Path, source: str = "") -> Path:
    """An Orbax weights folder: model.json (architecture) + weights/ (the arrays)."""
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    if folder.exists() and any(folder.iterdir()):
        raise CheckpointError(f"{folder} is not empty; choose a new folder for the imported weights")
    folder.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / "weights", eqx.filter(model, eqx.is_array))
    checkpointer.wait_until_finished()
    meta = {"format": WEIGHTS_FORMAT, "model": dataclasses.asdict(model.cfg), "source": source}
    (folder / "model.json").write_text(json.dumps(meta, indent=2))  # written last: a folder with it is complete
    return folder
