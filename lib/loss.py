"""Losses: next-token cross-entropy over valid tokens, z-loss, perplexity, MSE.

The cross-entropy returns a *sum* and a *count*, not a mean: the train step
divides by the number of valid tokens in the whole optimizer step (all
micro-batches, all devices), so padding never dilutes the loss and
accumulated micro-batches weigh exactly as one big batch would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def _at_least_f32(x):
    # fp32 for the softmax even under bf16; float64 passes through for gradient checks.
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def token_nll(logits: Float[Array, "... v"], targets: Int[Array, "..."]) -> Float[Array, "..."]:
    """-ln p(target) per position, from a fused log-softmax (logsumexp - logit), in fp32."""
    logits = _at_least_f32(logits)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - target_logit


def shift_for_next_token(tokens: Int[Array, "b t"], mask: Bool[Array, "b t"]):
    """Position i predicts token i+1: targets are tokens[:, 1:], valid where that token is real."""
    return tokens[:, 1:], mask[:, 1:]


def next_token_loss_sum(
    logits: Float[Array, "b t v"],
    tokens: Int[Array, "b t"],
    mask: Bool[Array, "b t"],
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """Sum of next-token NLL (plus optional z-loss) over valid targets, and their count."""
    targets, valid = shift_for_next_token(tokens, mask)
    logits = _at_least_f32(logits[:, :-1])
    nll = token_nll(logits, targets)
    if z_loss:
        # z-loss keeps log Z near 0 so the softmax stays well conditioned (PaLM).
        nll = nll + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))
    nll = jnp.where(valid, nll, 0.0)  # where, not multiply: 0 * inf would be nan
    return nll.sum(), valid.sum()


def valid_token_mean(logits, tokens, mask, z_loss: float = 0.0):
    total, count = next_token_loss_sum(logits, tokens, mask, z_loss)
    return total / jnp.maximum(count, 1)


def perplexity(mean_nll):
    return jnp.exp(mean_nll)


def mse(pred, target):
    return jnp.mean(jnp.square(pred - target))


def chunked_next_token_loss_sum(
    hidden: Float[Array, "b t d"],
    head: Float[Array, "d v"],
    tokens: Int[Array, "b t"],
    mask: Bool[Array, "b t"],
    chunk_tokens: int,
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """`next_token_loss_sum(hidden @ head, ...)` without ever holding all [tokens x vocab] logits.

    The LM head and the loss run over `chunk_tokens` positions at a time inside a
    scan whose body is rematerialised, so forward *and* backward keep one chunk's
    logits alive: memory grows with chunk x vocab instead of batch x seq x vocab.
    """
    targets, valid = shift_for_next_token(tokens, mask)
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets, valid = targets.reshape(-1), valid.reshape(-1)
    pad = -h.shape[0] % chunk_tokens
    h = jnp.pad(h, ((0, pad), (0, 0)))
    targets = jnp.pad(targets, (0, pad))
    valid = jnp.pad(valid, (0, pad))
    n_chunks = h.shape[0] // chunk_tokens

    @jax.checkpoint
    def chunk_loss(h_c, t_c, v_c):
        logits = _at_least_f32(h_c @ head.astype(h_c.dtype))
        nll = token_nll(logits, t_c)
        if z_loss:
            nll = nll + z_loss * jnp.square(jax.nn.logsumexp(logits, axis=-1))
        return jnp.where(v_c, nll, 0.0).sum()

    def body(total, xs):
        return total + chunk_loss(*xs), None

    chunks = (
        h.reshape(n_chunks, chunk_tokens, -1),
        targets.reshape(n_chunks, chunk_tokens),
        valid.reshape(n_chunks, chunk_tokens),
    )
    total, _ = jax.lax.scan(body, jnp.zeros((), _at_least_f32(h).dtype), chunks)
    return total, valid.sum()
