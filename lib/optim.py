"""AdamW with parameter groups, warmup + decay schedules and global-norm clipping (optax).

Gradient accumulation lives in the train step (`lib/train_state.py`): it sums
micro-batch gradients that are already normalised by the whole step's valid
tokens, so one optimizer update here sees exactly the full-batch gradient and
the schedule advances once per optimizer step.
"""

from __future__ import annotations

import jax
import optax

from lib.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine/linear decay to `lr * min_lr_ratio` at `total_steps`."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = max(cfg.warmup_steps, 0)
    decay_steps = max(total_steps - warmup, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    # Warmup starts at peak/warmup rather than 0 so the very first update is not wasted.
    ramp = optax.linear_schedule(peak / warmup, peak, warmup - 1) if warmup > 1 else optax.constant_schedule(peak)
    return optax.join_schedules([ramp, decay], [warmup])


def _leaf_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def weight_decay_mask(params, decay_embeddings: bool):
    """True where weight decay applies: matrices, not norm scales or biases; embeddings by choice."""

    def decays(path, leaf):
        name = _leaf_name(path)
        if "norm" in name or name.endswith("bias"):
            return False
        if name == "embed":  # the input table; the output projection decays like any matrix
            return decay_embeddings
        return leaf.ndim >= 2

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig, params, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask(params, cfg.decay_embeddings),
    )
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
