"""Opening a finished (or running) training run for use: its config, its weights, its tokenizer.

The config is the one stored in the chosen checkpoint (exactly what that step
was trained with), with the user's overrides applied on top. Only the model is
read from the checkpoint (an Orbax partial restore): the optimizer state, twice
the model's size, stays on disk.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import orbax.checkpoint as ocp
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lib import checkpoint as ckpt
from lib.config import CONF_DIR, Config, ConfigError, _check_known_keys, from_dict, validate
from lib.corpus import load_tokenizer
from lib.model import Llama


@dataclass
class TrainedRun:
    run_dir: Path
    step: int
    cfg: Config
    model: Llama

    def tokenizer(self):
        """The run's own copy of its tokenizer if it has one, else the first data source's."""
        own = self.run_dir / "tokenizer.json"
        if own.is_file():
            return load_tokenizer(own)
        from lib.data import resolve_corpora

        return resolve_corpora(self.cfg.data, self.cfg.model.vocab_size)[0].tokenizer()


def apply_overrides(saved: dict, overrides: list[str]) -> Config:
    """`saved` config with Hydra-style overrides: `group=NAME` picks conf/<group>/NAME.yaml, `a.b=value` sets a key."""
    node = OmegaConf.create(saved)
    try:
        for item in overrides:
            key, sep, value = item.lstrip("+").partition("=")
            if not sep:
                raise ConfigError(f"override '{item}' has no '='; write key=value (for example data.seq_len=128)")
            if key == "exp":
                raise ConfigError("a trained run keeps its own config, so +exp=... does not apply; set single keys instead (e.g. data.seq_len=...)")
            group_file = CONF_DIR / key / f"{value}.yaml"
            if "." not in key and (CONF_DIR / key).is_dir():
                if not group_file.is_file():
                    options = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
                    raise ConfigError(f"no config '{value}' in group '{key}'; choose one of {options}")
                node[key] = OmegaConf.load(group_file)
            else:
                node = OmegaConf.merge(node, OmegaConf.from_dotlist([f"{key}={value}"]))
        _check_known_keys(node, Config, "")
        cfg = from_dict(OmegaConf.to_container(node, resolve=True))
    except ConfigError:
        raise
    except (OmegaConfBaseException, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"bad override: {first} (check the key's spelling and the value's type)") from exc
    validate(cfg)
    return cfg


def choose_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    steps = ckpt.complete_steps(manager)
    if not steps:
        raise ckpt.CheckpointError(f"no complete checkpoint in {manager.directory}; train first (python -m recipes.pretrain ...)")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ckpt.CheckpointError(f"no checkpoint of step {step} in {manager.directory}; choose one of {steps}")
    return step


def open_run(run_dir: str | Path, step: int | None = None, overrides: list[str] | None = None) -> TrainedRun:
    run_dir = Path(run_dir)
    if not (run_dir / "checkpoints").is_dir():
        raise ckpt.CheckpointError(f"{run_dir} has no checkpoints/ folder; give the run_dir a training run wrote to")
    # Read-only: never deletes or cleans anything, so it is safe next to a run that is still training.
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax warns that a read-only manager will not save
    manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(create=False, read_only=True), item_names=ckpt.ITEMS)
    try:
        step = choose_step(manager, step)
        meta = ckpt.read_meta(manager, step)
        if "config" not in meta:
            raise ckpt.CheckpointError(f"checkpoint {run_dir}/checkpoints/{step} stores no config; it was not written by recipes.pretrain")
        cfg = apply_overrides(meta["config"], overrides or [])
        ckpt.check_model_matches(meta, dataclasses.asdict(cfg.model), f"{run_dir}/checkpoints/{step}")
        model = ckpt.restore_model(manager, step, cfg.model)
    finally:
        manager.close()
    return TrainedRun(run_dir=run_dir, step=step, cfg=cfg, model=model)
