"""Losses: next-token cross-entropy over valid tokens, z-loss, perplexity, MSE.

The cross-entropy returns a *sum* and a *count*, not a mean: the train step
divides by the number of valid tokens in the whole optimizer step (all
micro-batches, all devices), so padding never dilutes the loss and
accumulated micro-batches weigh exactly as one big batch would.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


def _at_least_f32(x):
    # fp32 for the softmax even under bf16; float64 passes through for gradient checks.
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _nll_and_lse(logits, targets, z_loss: float = 0.0):
    """Per position: -ln p(target) (+ z-loss), and the log-partition lse it was computed from, in fp32."""
    logits = _at_least_f32(logits)
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    if z_loss:
        # z-loss keeps log Z near 0 so the softmax stays well conditioned (PaLM).
        nll = nll + z_loss * jnp.square(lse)
    return nll, lse


def token_nll(logits: Float[Array, "... v"], targets: Int[Array, "..."]) -> Float[Array, "..."]:
    """-ln p(target) per position, from a fused log-softmax (logsumexp - logit), in fp32."""
    return _nll_and_lse(logits, targets)[0]


def shift_for_next_token(tokens: Int[Array, "b t"], mask: Bool[Array, "b t"]):
    """Position i predicts token i+1: targets are tokens[:, 1:], valid where that token is real."""
    return tokens[:, 1:], mask[:, 1:]


def target_loss_sum(
    logits: Float[Array, "b t v"],
    targets: Int[Array, "b t"],
    valid: Bool[Array, "b t"],
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """Sum of NLL (plus optional z-loss) of `targets` under `logits`, over valid positions, and their count."""
    nll, _ = _nll_and_lse(logits, targets, z_loss)
    nll = jnp.where(valid, nll, 0.0)  # where, not multiply: 0 * inf would be nan
    return nll.sum(), valid.sum()


def next_token_loss_sum(
    logits: Float[Array, "b t v"],
    tokens: Int[Array, "b t"],
    mask: Bool[Array, "b t"],
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """Sum of next-token NLL (plus optional z-loss) over valid targets, and their count."""
    targets, valid = shift_for_next_token(tokens, mask)
    return target_loss_sum(logits[:, :-1], targets, valid, z_loss)


def valid_token_mean(logits, tokens, mask, z_loss: float = 0.0):
    total, count = next_token_loss_sum(logits, tokens, mask, z_loss)
    return total / jnp.maximum(count, 1)


def perplexity(mean_nll):
    return jnp.exp(mean_nll)


def mse(pred, target):
    return jnp.mean(jnp.square(pred - target))


def _chunk_nll_and_dlogits(h_c, w, t_c, v_c, z_loss: float, with_grad: bool):
    """One chunk [b, c, d] of positions: its NLL sum and, if asked, d(NLL sum)/d(logits) [b, c, v] in h's dtype."""
    logits = jnp.einsum("bcd,dv->bcv", h_c, w.astype(h_c.dtype), preferred_element_type=_at_least_f32(h_c).dtype)
    nll, lse = _nll_and_lse(logits, t_c, z_loss)
    total = jnp.where(v_c, nll, 0.0).sum()
    if not with_grad:
        return total, None
    # d/dlogits of (lse - logit[t] + z lse^2) = softmax * (1 + 2 z lse) - onehot(t); zero at invalid positions.
    probs = jnp.exp(logits - lse[..., None]) * (1.0 + 2.0 * z_loss * lse)[..., None]
    dlogits = probs - (jnp.arange(logits.shape[-1]) == t_c[..., None])
    return total, jnp.where(v_c[..., None], dlogits, 0.0).astype(h_c.dtype)


def _chunks(n_chunks: int, *xs):
    """Each [b, t, ...] -> [n_chunks, b, t / n_chunks, ...]: chunks along the sequence, each keeping the whole batch."""
    return tuple(x.reshape(x.shape[0], n_chunks, -1, *x.shape[2:]).swapaxes(0, 1) for x in xs)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _linear_cross_entropy(h, w, targets, valid, n_chunks: int, z_loss: float):
    """Sum over valid positions of -ln softmax(h @ w)[target] (+ z-loss), one sequence chunk at a time."""

    def body(total, xs):
        h_c, t_c, v_c = xs
        return total + _chunk_nll_and_dlogits(h_c, w, t_c, v_c, z_loss, with_grad=False)[0], None

    return jax.lax.scan(body, jnp.zeros((), _at_least_f32(h).dtype), _chunks(n_chunks, h, targets, valid))[0]


def _linear_cross_entropy_fwd(h, w, targets, valid, n_chunks, z_loss):
    # The loss is a scalar, so its gradient is known up to the incoming scale already here: each chunk's
    # dlogits go straight into dh and dw, and no [tokens x vocab] array outlives its chunk.
    def body(carry, xs):
        total, dw = carry
        h_c, t_c, v_c = xs
        nll, dlogits = _chunk_nll_and_dlogits(h_c, w, t_c, v_c, z_loss, with_grad=True)
        dh_c = jnp.einsum("bcv,dv->bcd", dlogits, w.astype(dlogits.dtype))
        dw = dw + jnp.einsum("bcd,bcv->dv", h_c, dlogits, preferred_element_type=dw.dtype)
        return (total + nll, dw), dh_c

    init = (jnp.zeros((), _at_least_f32(h).dtype), jnp.zeros(w.shape, _at_least_f32(w).dtype))
    (total, dw), dh = jax.lax.scan(body, init, _chunks(n_chunks, h, targets, valid))
    return total, (dh.swapaxes(0, 1).reshape(h.shape), dw.astype(w.dtype), targets, valid)


def _linear_cross_entropy_bwd(n_chunks, z_loss, residuals, g):
    dh, dw, targets, valid = residuals
    int_zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # integer and bool inputs have no gradient
    return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), int_zero(targets), int_zero(valid)


_linear_cross_entropy.defvjp(_linear_cross_entropy_fwd, _linear_cross_entropy_bwd)


def chunked_next_token_loss_sum(
    hidden: Float[Array, "b t d"],
    head: Float[Array, "d v"],
    tokens: Int[Array, "b t"],
    mask: Bool[Array, "b t"],
    chunk_positions: int,
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """`next_token_loss_sum(hidden @ head, ...)` without ever holding all [tokens x vocab] logits.

    The LM head and the loss run over `chunk_positions` sequence positions (of every row) at a
    time. Value and gradient are computed together in one pass over the chunks (a fused linear
    cross-entropy), so neither forward nor backward keeps more than one chunk's logits: memory
    grows with batch x chunk x vocab instead of batch x seq x vocab, and the head costs its three
    matmuls with no recomputation. Chunks run along the sequence, so a batch split over devices
    stays split. Forward-mode AD is not defined through it (gradient checks use the VJP).
    """
    t = tokens.shape[1]
    chunk = min(chunk_positions, t)
    pad = -t % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    # The last position predicts nothing: it is padded out (valid=False) rather than sliced off h.
    targets, valid = (jnp.pad(x, ((0, 0), (0, 1 + pad))) for x in shift_for_next_token(tokens, mask))
    total = _linear_cross_entropy(hidden, head, targets, valid, (t + pad) // chunk, float(z_loss))
    return total, valid.sum()
