"""Typed configuration: dataclass schemas composed by Hydra from `conf/`.

Every recipe calls `load_config(overrides)`. The YAML files in `conf/` are
checked against these dataclasses, so a typo or a wrong type stops the run
with one line (`ConfigError`) instead of being carried silently into training.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A user-facing configuration problem; the message names the fix."""


@dataclass(unsafe_hash=True)  # hashable: the model keeps it as a static (jit-time) field
class ModelConfig:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 768
    vocab_size: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # none | layer (recompute each block in backward) | selective (keep matmul outputs)
    remat: str = "none"
    # float32 | bfloat16: the dtype matmuls run in; parameters stay float32.
    compute_dtype: str = "float32"
    # Sequence positions per chunk of the fused LM head + loss (0 = all logits at once): bounds logits memory.
    logits_chunk: int = 64
    # Causal attention runs in query blocks of this many positions, skipping fully masked key blocks (0 = dense).
    attention_block: int = 128
    # blocked (lib/attention.py, any backend) | cudnn (jax.nn.dot_product_attention's cuDNN flash attention:
    # NVIDIA GPU, bf16) | xla (the same call on XLA's reference path, any backend).
    attention_impl: str = "blocked"  # one of ATTENTION_IMPLS
    # Blocks per iteration of the layer scan: 1 compiles one block; n_layers unrolls all (faster, slower to
    # compile). Ignored under remat: unrolled, XLA merges the recomputation back into the forward.
    scan_unroll: int = 1
    init_std: float = 0.02


ATTENTION_IMPLS = ("blocked", "cudnn", "xla")

# The ModelConfig fields that fix the weights' shapes and meaning. The others (remat, compute dtype, attention
# and head chunking, scan unrolling, init) are execution choices: a checkpoint resumes under any of them.
ARCHITECTURE = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "rope_theta", "norm_eps", "tie_embeddings")


@dataclass
class SourceConfig:
    """One data source of a mixture."""

    name: str = "stdlib"
    # "stdlib" builds the embedded corpus; otherwise a folder made by recipes.prepare_data.
    path: str = "stdlib"
    weight: float = 1.0


@dataclass
class DataConfig:
    seq_len: int = 256
    # Where the built-in corpus is cached; "" = $JAXPRETRAIN_CACHE or ~/.cache/jaxpretrain.
    cache_dir: str = ""
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    # Embedded-corpus knobs: cap its size so the quickstart stays quick.
    stdlib_max_bytes: int = 6_000_000
    # Percent of files (chosen by a hash of their path) held out for validation.
    val_percent: int = 5
    shard_sequences: int = 8192
    shuffle_seed: int = 0
    prefetch: int = 4
    read_threads: int = 2
    # Mask attention across documents packed into one sequence.
    document_mask: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    # cosine | linear | constant (after warmup)
    schedule: str = "cosine"
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    # Micro-batches per optimizer step (gradient accumulation).
    accum_steps: int = 1
    z_loss: float = 0.0


@dataclass
class ParallelConfig:
    # single: one device | fsdp: every device, parameters and optimizer state split (lib/sharding.py)
    # | pipeline: the layer stack split into stages along a `stage` axis (lib/pipeline.py)
    name: str = "single"
    # Mesh axis sizes; -1 fills the devices left. Batch rows split over data x fsdp;
    # parameters split over fsdp and replicated over data.
    data: int = 1
    fsdp: int = 1
    # Leaves smaller than this stay whole on every device: gathering them costs more than storing them.
    min_shard_bytes: int = 16384
    # Print the table path -> shape -> PartitionSpec -> bytes per device at start.
    print_plan: bool = False
    # Multi-host (lib/distributed.py). auto: an explicit coordinator (here or JAX_COORDINATOR_ADDRESS),
    # else SLURM, else a TPU VM pod, else one process. Or name one: explicit | slurm | tpu | none.
    cluster: str = "auto"
    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0  # 0: from the environment
    process_id: int = -1  # -1: from the environment
    # Seconds to wait for every process to join before failing with a clear error.
    init_timeout_s: int = 300

    # Pipeline: stages along the `stage` mesh axis; micro-batches per (accumulation) batch;
    # gpipe, or circular where the layers wrap around the stages `repeats` times (smaller bubble).
    stages: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    # Keep only each stage's input per tick and recompute its layers in the backward pass.
    stage_remat: bool = False


@dataclass
class PlanConfig:
    """What recipes/plan.py compiles for: a mesh of `devices` simulated devices, judged against `accelerator`."""

    devices: int = 8
    # Memory table key (v5p, v5e, v4, H100, H200, A100) or empty for no fits/does-not-fit verdict.
    accelerator: str = ""


@dataclass
class TrainerConfig:
    steps: int = 200
    # Global batch in sequences per optimizer step (all micro-batches, all devices).
    batch_size: int = 16
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100
    keep_last: int = 2
    keep_every: int = 0
    async_checkpoint: bool = True
    # Keep freed host memory for reuse (glibc only): XLA:CPU allocates its scratch space anew every step,
    # and handing it back to the OS costs page faults in the step and ~20 ms of munmap after it (lib/host_memory.py).
    keep_host_memory: bool = True
    # Peak FLOP/s for MFU on hardware not in the table (CPU): 0 = measure a matmul.
    peak_flops: float = 0.0
    progress: bool = True
    # Trace steps profile_start+1 .. profile_start+profile_steps with jax.profiler into run_dir/profile (0 = off;
    # start after warm-up: the first step compiles). lib/profiling.py says how to view it.
    profile_start: int = 0
    profile_steps: int = 3
    # Start from these weights (HF folder, imported weights folder or run_dir) instead of a random init;
    # the source decides the model architecture. Ignored once run_dir has its own checkpoint.
    init_from: str = ""


@dataclass
class LoggerConfig:
    # offline | online | disabled
    wandb: str = "offline"
    project: str = "jaxpretrain"
    name: str = ""


@dataclass
class FaultConfig:
    """Deliberate faults, for tests and fire drills (docs/guard.md). Steps count optimizer steps from 1."""

    # The gradient at these steps is NaN (the guard must skip them).
    nan_grad_steps: list[int] = field(default_factory=list)
    # The loss (and so the gradient) at these steps is multiplied by spike_scale.
    spike_steps: list[int] = field(default_factory=list)
    spike_scale: float = 100.0
    # The sample in row 0 of these steps' batch is corrupt "on disk": out-of-range token ids wherever it is read.
    corrupt_sample_steps: list[int] = field(default_factory=list)
    # After these steps' update, noise of std poison_std lands on every weight unchecked: a bad update that
    # got through (exercises rollback). Fires only before the run's first rollback.
    poison_steps: list[int] = field(default_factory=list)
    poison_std: float = 1.0
    # Every checkpoint waits this long before it is committed, so a test can kill a run mid-save.
    save_stall_s: float = 0.0


@dataclass
class GuardConfig:
    """The training guard (lib/guard.py, lib/rollback.py): skip bad steps, quarantine data, roll back."""

    enabled: bool = True
    # Rolling mean/std of loss and grad norm over the last `window` accepted steps...
    window: int = 100
    # ...used for spike detection once `warmup` steps are in it.
    warmup: int = 50
    # A spike: value > mean + max(sigma * std, min_rel_jump * mean). Gradient norms are heavy-tailed
    # (a clean tiny run reaches 2.2x its mean), so a grad-norm spike must also at least double it.
    sigma: float = 6.0
    loss_min_rel_jump: float = 0.1
    grad_norm_min_rel_jump: float = 1.0
    # Roll back when `rollback_skips` steps are skipped within `rollback_window` steps, when weights turn
    # non-finite, or when the loss stays above (1 + diverge_ratio) x its pre-anomaly mean for diverge_patience steps.
    rollback_skips: int = 3
    rollback_window: int = 20
    diverge_ratio: float = 0.5
    diverge_patience: int = 10
    # Stop with a report after this many rollbacks.
    max_rollbacks: int = 3
    # A step that fails this many times (across rollbacks) gets a repro bundle in <run_dir>/repro/.
    repro_after: int = 2
    # Health warnings: val loss rose on `overfit_evals` evals in a row while the train loss fell;
    # the grad norm's fitted trend grew by `grad_trend_ratio` x over `grad_trend_window` steps.
    overfit_evals: int = 3
    grad_trend_window: int = 200
    grad_trend_ratio: float = 3.0
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class Config:
    run_dir: str = "runs/${exp_name}"
    exp_name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


_GROUP_SCHEMAS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "guard": GuardConfig,
    "plan": PlanConfig,
}


def _register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, schema in _GROUP_SCHEMAS.items():
        cs.store(group=group, name="schema", node=schema)


def _check_known_keys(node: Any, schema: type, where: str) -> None:
    """Reject keys the schema does not have (`+key=value` slips past Hydra's own check)."""
    names = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)  # field types are strings under `from __future__ import annotations`
    for key in node.keys():
        if key not in names:
            hint = ", ".join(sorted(names))
            raise ConfigError(f"unknown config key '{where}{key}'; valid keys here: {hint}")
        sub = hints[key]
        sub_schema = _GROUP_SCHEMAS.get(key) if where == "" else None
        if sub_schema is None and isinstance(sub, type) and dataclasses.is_dataclass(sub):
            sub_schema = sub
        if sub_schema is not None and isinstance(node[key], DictConfig):
            _check_known_keys(node[key], sub_schema, f"{where}{key}.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_config(overrides: list[str] | None = None, config_name: str = "config") -> Config:
    """Compose `conf/<config_name>.yaml` with Hydra overrides into a typed `Config`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register_schemas()
    overrides = list(overrides or [])
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name=config_name, overrides=overrides)
        raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"])
        _check_known_keys(raw, Config, "")
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"bad configuration: {_first_line(exc)} (check the override's spelling and type)") from exc
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks that a schema cannot express."""
    m, d, t, o = cfg.model, cfg.data, cfg.trainer, cfg.optim
    if d.seq_len < 2:
        raise ConfigError(f"data.seq_len={d.seq_len} is too short: next-token loss needs at least 2 tokens; set data.seq_len>=2")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}; pick n_kv_heads dividing n_heads")
    if m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.d_model={m.d_model} must split into n_heads={m.n_heads} heads of even size (RoPE rotates pairs)")
    if m.remat not in ("none", "layer", "selective"):
        raise ConfigError(f"model.remat={m.remat!r}: choose none, layer or selective")
    if m.compute_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.compute_dtype={m.compute_dtype!r}: choose float32 or bfloat16")
    if m.attention_block < 0:
        raise ConfigError(f"model.attention_block={m.attention_block} must be >= 0 (0 = dense attention)")
    if m.attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(f"model.attention_impl={m.attention_impl!r}: choose blocked, cudnn (NVIDIA GPU, bf16) or xla")
    if m.attention_impl == "cudnn" and m.compute_dtype != "bfloat16":
        raise ConfigError("model.attention_impl=cudnn runs in bf16 only: set model.compute_dtype=bfloat16, or use attention_impl=blocked")
    if m.scan_unroll < 1:
        raise ConfigError(f"model.scan_unroll={m.scan_unroll} must be >= 1 (1 = no unrolling)")
    if m.logits_chunk < 0:
        raise ConfigError(f"model.logits_chunk={m.logits_chunk} must be >= 0 (0 = no chunking)")
    if o.schedule not in ("cosine", "linear", "constant"):
        raise ConfigError(f"optim.schedule={o.schedule!r}: choose cosine, linear or constant")
    if o.accum_steps < 1 or t.batch_size % o.accum_steps:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} is not divisible by optim.accum_steps={o.accum_steps}; "
            "make the batch a multiple of the accumulation steps"
        )
    if t.profile_start < 0 or t.profile_steps < 1:
        raise ConfigError(f"trainer.profile_start={t.profile_start}, trainer.profile_steps={t.profile_steps}: "
                          "need profile_start >= 0 (0 = no profile) and profile_steps >= 1")
    if cfg.logger.wandb not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.wandb={cfg.logger.wandb!r}: choose offline, online or disabled")
    g = cfg.guard
    if g.window < 2 or not 1 <= g.warmup <= g.window:
        raise ConfigError(f"guard.window={g.window}, guard.warmup={g.warmup}: need window>=2 and 1<=warmup<=window")
    if min(g.rollback_skips, g.rollback_window, g.diverge_patience, g.repro_after) < 1 or g.max_rollbacks < 0:
        raise ConfigError("guard.rollback_skips, rollback_window, diverge_patience and repro_after must be >= 1, max_rollbacks >= 0")
    if not d.sources:
        raise ConfigError("data.sources is empty; give at least one source (path=stdlib or a prepared folder)")
    names = [s.name for s in d.sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.sources names {names} repeat; give each source its own name (losses are logged per name)")
    for s in d.sources:
        if not s.weight > 0:
            raise ConfigError(f"data source '{s.name}' has weight {s.weight}; weights must be > 0 (drop the source instead)")


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """Rebuild a typed Config from `to_dict` output (e.g. the copy stored in a checkpoint)."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(data))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


__all__ = ["Config", "ConfigError", "load_config", "to_yaml", "to_dict", "from_dict", "MISSING"]
