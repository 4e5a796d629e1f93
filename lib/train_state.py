"""The training state PyTree and the one jitted train step.

`TrainState` holds everything that must survive a restart besides the data
iterator: the model, the optimizer state, the optimizer step, the RNG key and
the guard's rolling statistics. `step` counts *applied* updates: a step the
guard skips leaves it (and the LR schedule) where it was.
`make_train_step` returns a pure `(state, batch) -> (state, metrics)` that is
jitted once, with the old state's buffers donated.
"""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from lib.guard import GuardStats, StepGuard
from lib.loss import chunked_next_token_loss_sum, shift_for_next_token, target_loss_sum
from lib.model import Llama

Batch = dict[str, jax.Array]  # tokens [B, T] int32, mask [B, T] bool, optional segment_ids [B, T]


class TrainState(eqx.Module):
    step: jax.Array  # completed optimizer updates (int32 scalar)
    model: Llama
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32[2] key: plain data, so it checkpoints like any array
    guard: GuardStats | None = None  # rolling loss/grad-norm statistics of the training guard (lib/guard.py)


def init_train_state(model: Llama, optimizer: optax.GradientTransformation, seed: int, guard: StepGuard | None = None) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        model=model,
        opt_state=optimizer.init(model),
        rng=jax.random.PRNGKey(seed + 1),
        guard=guard.init_stats() if guard is not None else None,
    )


def head_loss_sum(model: Llama, hidden, tokens, mask, z_loss: float):
    """LM head + next-token loss on the final hidden states: fused in chunks (model.logits_chunk) or plain."""
    chunk = model.cfg.logits_chunk
    if chunk:  # never materialise the full [tokens x vocab] logits
        return chunked_next_token_loss_sum(hidden, model.head_weight(), tokens, mask, chunk, z_loss)
    # Drop the last position before the LM head, not after: slicing [tokens x vocab] logits costs a full copy.
    targets, valid = shift_for_next_token(tokens, mask)
    return target_loss_sum(model.logits(hidden[:, :-1]), targets, valid, z_loss)


def model_loss_sum(model: Llama, batch: Batch, z_loss: float):
    hidden = model.hidden(batch["tokens"], segment_ids=batch.get("segment_ids"))
    return head_loss_sum(model, hidden, batch["tokens"], batch["mask"], z_loss)


def split_micro_batches(batch: Batch, accum_steps: int) -> Batch:
    """[B, T] -> [accum, B/accum, T]: micro-batch i is rows i, i+accum, i+2*accum, ...

    Strided, not contiguous: when rows are split over devices, every device then
    feeds every micro-batch, so no resharding is needed between micro-steps."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)


LossSum = Callable[[Llama, Batch, float], tuple[jax.Array, jax.Array]]  # (model, batch, z_loss) -> (sum, count)


def accumulated_grads(model: Llama, batch: Batch, accum_steps: int, z_loss: float, loss_sum: LossSum = model_loss_sum):
    """Loss and gradient of the whole batch, normalised by its valid-token count, one micro-batch at a time.

    `loss_sum` computes the forward pass (the plain model, or a pipelined one from lib/pipeline.py)."""
    total_valid = jnp.maximum(batch["mask"][:, 1:].sum(), 1).astype(jnp.float32)

    def micro_loss(m, micro):
        micro_sum, _ = loss_sum(m, micro, z_loss)
        return micro_sum / total_valid

    grad_fn = eqx.filter_value_and_grad(micro_loss)
    if accum_steps == 1:
        return grad_fn(model, batch), total_valid

    def add_micro(carry, micro):
        loss, grads = grad_fn(model, micro)
        acc_loss, acc_grads = carry
        return (acc_loss + loss, jax.tree.map(jnp.add, acc_grads, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_array))
    (loss, grads), _ = jax.lax.scan(add_micro, (jnp.zeros(()), zeros), split_micro_batches(batch, accum_steps))
    return (loss, grads), total_valid


def make_train_step(
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    accum_steps: int = 1,
    z_loss: float = 0.0,
    guard: StepGuard | None = None,
    loss_sum: LossSum = model_loss_sum,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The jitted step; with a `guard`, a bad step is skipped (state kept bitwise) instead of applied.

    `loss_sum` runs the forward pass: the plain model, the model with activation shardings pinned
    (lib/placement.py), or the pipelined stack (lib/pipeline.py); gradients flow back to the stored model."""

    def train_step(state: TrainState, batch: Batch):
        (loss, grads), valid = accumulated_grads(state.model, batch, accum_steps, z_loss, loss_sum)
        if guard is not None:
            loss, grads = guard.inject_faults(state.guard, loss, grads)
        # Clipping happens inside the optimizer chain, after accumulation; this is the pre-clip norm.
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.model)
        model = eqx.apply_updates(state.model, updates)
        new_state = TrainState(step=state.step + 1, model=model, opt_state=opt_state, rng=jax.random.split(state.rng)[0], guard=state.guard)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "valid_tokens": valid}
        if guard is not None:
            new_state, guard_metrics = guard.keep_or_skip(state, new_state, loss, grad_norm)
            metrics |= guard_metrics
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(loss_sum: LossSum = model_loss_sum) -> Callable[[Llama, Batch], tuple[jax.Array, jax.Array]]:
    """Sum of next-token NLL and valid-token count on one batch (no z-loss: a pure NLL)."""

    @jax.jit
    def eval_step(model: Llama, batch: Batch):
        return loss_sum(model, batch, 0.0)

    return eval_step
