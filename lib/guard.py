"""The in-step half of the training guard: detect a bad step and skip it, inside the jitted step.

Each step compares its loss and gradient norm with rolling statistics of the
last `window` *accepted* steps, kept in the TrainState (`GuardStats`), so the
check costs no host round trip and survives checkpoints like everything else.
A step is skipped when its loss or gradient is non-finite, or (once `warmup`
steps are in the window) when either is far above its rolling mean.

A skipped step keeps the old parameters, both Adam moments, the optimizer's
step count (and so the LR schedule), `TrainState.step` and the RNG key,
bitwise: the new state is *selected* with `jnp.where`, never blended by
multiplying with 0 (0 x NaN is NaN). The micro-batch gradients of the step
live only inside it, so a skip drops them too. The decision is one scalar
computed from the loss and the global gradient norm; under `jit` over a
sharded state those are global reductions, so every device takes the same
branch whatever the layout.

The host half (quarantine, rollback, repro bundles) lives in lib/rollback.py.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from lib.config import GuardConfig

# Skip reasons, by code; the first that applies wins.
REASONS = ("ok", "nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_norm_spike")


class GuardStats(eqx.Module):
    """Rolling statistics of accepted steps (ring buffers) and counters, part of the TrainState."""

    losses: Float[Array, "w"]
    grad_norms: Float[Array, "w"]
    accepted: Int[Array, ""]  # accepted steps so far; the ring slot of the next one is accepted % w
    seen: Int[Array, ""]  # batches seen, skipped or not: the loop step of the last batch
    skipped: Int[Array, ""]  # skipped steps so far


def init_guard_stats(window: int) -> GuardStats:
    # Separate buffers for every field: the train step donates them, and one buffer cannot be donated twice.
    zeros = lambda: jnp.zeros((window,), jnp.float32)  # noqa: E731
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    return GuardStats(losses=zeros(), grad_norms=zeros(), accepted=zero(), seen=zero(), skipped=zero())


def rolling_mean_std(values: Float[Array, "w"], accepted: Int[Array, ""]):
    """Mean and standard deviation of the filled part of a ring buffer."""
    n = jnp.minimum(accepted, values.shape[0])
    filled = jnp.arange(values.shape[0]) < n
    count = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.where(filled, values, 0.0).sum() / count
    var = jnp.where(filled, jnp.square(values - mean), 0.0).sum() / count
    return mean, jnp.sqrt(var)


def _steps_array(steps) -> jax.Array:
    return jnp.asarray(list(steps) or [-1], jnp.int32)


class StepGuard:
    """Static (jit-time) guard settings and the functions the train step calls."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.nan_steps = tuple(cfg.fault.nan_grad_steps)
        self.spike_steps = tuple(cfg.fault.spike_steps)

    def init_stats(self) -> GuardStats:
        return init_guard_stats(self.cfg.window)

    def inject_faults(self, stats: GuardStats, loss, grads):
        """Configured device-side faults for this step (a no-op unless guard.fault lists steps)."""
        step = stats.seen + 1
        if self.spike_steps:
            # Scaling the loss scales its gradient by the same factor: the same as a spiky batch.
            scale = jnp.where(jnp.isin(step, _steps_array(self.spike_steps)), self.cfg.fault.spike_scale, 1.0)
            loss = loss * scale
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        if self.nan_steps:
            poison = jnp.where(jnp.isin(step, _steps_array(self.nan_steps)), jnp.nan, 0.0)
            grads = jax.tree.map(lambda g: g + poison.astype(g.dtype), grads)
        return loss, grads

    def reason(self, stats: GuardStats, loss, grad_norm) -> Int[Array, ""]:
        """The skip reason code (0 = accept) from two global scalars."""
        cfg = self.cfg
        warm = stats.accepted >= cfg.warmup
        loss_mean, loss_std = rolling_mean_std(stats.losses, stats.accepted)
        gn_mean, gn_std = rolling_mean_std(stats.grad_norms, stats.accepted)

        def spike(value, mean, std, min_rel_jump):
            return warm & (value > mean + jnp.maximum(cfg.sigma * std, min_rel_jump * jnp.abs(mean)))

        checks = [
            ~jnp.isfinite(loss),
            ~jnp.isfinite(grad_norm),
            spike(loss, loss_mean, loss_std, cfg.loss_min_rel_jump),
            spike(grad_norm, gn_mean, gn_std, cfg.grad_norm_min_rel_jump),
        ]
        code = jnp.zeros((), jnp.int32)
        for i, bad in reversed(list(enumerate(checks, start=1))):  # reversed: the first reason that applies wins
            code = jnp.where(bad, i, code)
        return code

    def keep_or_skip(self, old, new, loss, grad_norm):
        """Select the new state, or keep the old one bitwise; update the statistics; guard metrics."""
        stats = old.guard
        code = self.reason(stats, loss, grad_norm)
        skip = code > 0
        keep_old = lambda o, n: jnp.where(skip, o, n)  # noqa: E731 - selection, not arithmetic
        step, model, opt_state, rng = jax.tree.map(keep_old, (old.step, old.model, old.opt_state, old.rng), (new.step, new.model, new.opt_state, new.rng))

        slot = stats.accepted % self.cfg.window
        accepted_stats = GuardStats(
            losses=stats.losses.at[slot].set(loss.astype(jnp.float32)),
            grad_norms=stats.grad_norms.at[slot].set(grad_norm.astype(jnp.float32)),
            accepted=stats.accepted + 1,
            seen=stats.seen + 1,
            skipped=stats.skipped,
        )
        skipped_stats = GuardStats(stats.losses, stats.grad_norms, stats.accepted, stats.seen + 1, stats.skipped + 1)
        new_stats = jax.tree.map(keep_old, skipped_stats, accepted_stats)

        loss_mean, _ = rolling_mean_std(stats.losses, stats.accepted)
        gn_mean, _ = rolling_mean_std(stats.grad_norms, stats.accepted)
        params_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))]))
        metrics = {
            "skipped": skip.astype(jnp.int32),
            "skip_reason": code,
            "skips_total": new_stats.skipped,
            "loss_mean": loss_mean,  # rolling mean before this step: the reference the host compares with
            "grad_norm_mean": gn_mean,
            "stats_ready": (stats.accepted >= self.cfg.warmup).astype(jnp.int32),
            "params_finite": params_finite.astype(jnp.int32),
        }
        state = type(old)(step=step, model=model, opt_state=opt_state, rng=rng, guard=new_stats)
        return state, metrics
