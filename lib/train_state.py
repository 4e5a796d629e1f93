"""The training state PyTree and the one jitted train step.

`TrainState` holds everything that must survive a restart besides the data
iterator: the model, the optimizer state, the optimizer step and the RNG key.
`make_train_step` returns a pure `(state, batch) -> (state, metrics)` that is
jitted once, with the old state's buffers donated.
"""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from lib.loss import chunked_next_token_loss_sum, next_token_loss_sum
from lib.model import Llama

Batch = dict[str, jax.Array]  # tokens [B, T] int32, mask [B, T] bool, optional segment_ids [B, T]


class TrainState(eqx.Module):
    step: jax.Array  # completed optimizer updates (int32 scalar)
    model: Llama
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32[2] key: plain data, so it checkpoints like any array


def init_train_state(model: Llama, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        model=model,
        opt_state=optimizer.init(model),
        rng=jax.random.PRNGKey(seed + 1),
    )


def model_loss_sum(model: Llama, batch: Batch, z_loss: float):
    chunk = model.cfg.logits_chunk
    if chunk:  # never materialise the full [tokens x vocab] logits
        hidden = model.hidden(batch["tokens"], segment_ids=batch.get("segment_ids"))
        return chunked_next_token_loss_sum(hidden, model.head_weight(), batch["tokens"], batch["mask"], chunk, z_loss)
    logits = model(batch["tokens"], segment_ids=batch.get("segment_ids"))
    return next_token_loss_sum(logits, batch["tokens"], batch["mask"], z_loss)


def split_micro_batches(batch: Batch, accum_steps: int) -> Batch:
    """[B, T] -> [accum, B/accum, T]: micro-batch i is rows i*B/accum ... (i+1)*B/accum - 1."""
    return jax.tree.map(lambda x: x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:]), batch)


def accumulated_grads(model: Llama, batch: Batch, accum_steps: int, z_loss: float):
    """Loss and gradient of the whole batch, normalised by its valid-token count, one micro-batch at a time."""
    total_valid = jnp.maximum(batch["mask"][:, 1:].sum(), 1).astype(jnp.float32)

    def micro_loss(m, micro):
        loss_sum, _ = model_loss_sum(m, micro, z_loss)
        return loss_sum / total_valid

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
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    def train_step(state: TrainState, batch: Batch):
        (loss, grads), valid = accumulated_grads(state.model, batch, accum_steps, z_loss)
        # Clipping happens inside the optimizer chain, after accumulation; this is the pre-clip norm.
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.model)
        model = eqx.apply_updates(state.model, updates)
        new_state = TrainState(step=state.step + 1, model=model, opt_state=opt_state, rng=jax.random.split(state.rng)[0])
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "valid_tokens": valid}
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step() -> Callable[[Llama, Batch], tuple[jax.Array, jax.Array]]:
    """Sum of next-token NLL and valid-token count on one batch (no z-loss: a pure NLL)."""

    @jax.jit
    def eval_step(model: Llama, batch: Batch):
        return model_loss_sum(model, batch, 0.0)

    return eval_step
