"""Scaled dot-product attention written out in jnp, and a causal version that skips masked blocks.

Why not `jax.nn.dot_product_attention`: on XLA's CPU backend its layout costs
transposes in the forward and the backward, and it computes every query-key
pair although causal attention throws half of them away. Here attention runs
in a heads-first layout (`split_heads`), so the matmuls batch over leading
axes, and `causal_attention` splits the queries into blocks: block i reads only
the keys up to the end of block i, so with 4 blocks it does 10/16 of the work.
Measured in `docs/performance.md`. The same code runs in bf16 (scores and
softmax in fp32) and in float64 (gradient checks). On an NVIDIA GPU,
`library_attention` hands the work to cuDNN's flash attention instead
(`model.attention_impl=cudnn`).

Layouts: grouped-query heads-first q [b, kv, g, t, hd] (query head h = kv * g + j
reads kv head h // g), k and v [b, kv, t, hd]; mask [b, 1, tq, tk] boolean, True
where a query may read a key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from lib.config import ConfigError


def split_heads(x: Float[Array, "b t hd_all"], n_kv: int, head_dim: int):
    """[b, t, heads * hd] -> [b, kv, g, t, hd] (g = heads / kv; g = 1 for keys and values)."""
    b, t, _ = x.shape
    return x.reshape(b, t, n_kv, -1, head_dim).transpose(0, 2, 3, 1, 4)


def merge_heads(out: Float[Array, "b kv g t hd"]) -> Float[Array, "b t hd_all"]:
    """The inverse of `split_heads`."""
    b, kv, g, t, hd = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g * hd)


def _attend(q, k, v, mask):
    """softmax(q k^T / sqrt(hd), masked) v: q [b, kv, g, tq, hd], k/v [b, kv, tk, hd] -> [b, kv, g, tq, hd]."""
    score_dtype = jnp.promote_types(q.dtype, jnp.float32)  # fp32 scores and softmax under bf16; float64 stays
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=score_dtype)
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(score_dtype).min)
    # The softmax is normalised after the second matmul, as flash attention does: dividing the
    # [t, hd] output by the row sums touches less memory than dividing the [t, s] probabilities.
    # The max shift only keeps exp in range and cancels out, so no gradient flows through it.
    shift = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    weights = jnp.exp(scores - shift)
    out = jnp.einsum("bkgts,bksd->bkgtd", weights.astype(v.dtype), v, preferred_element_type=score_dtype)
    return (out / weights.sum(axis=-1, keepdims=True)).astype(v.dtype)


def causal_attention(
    q: Float[Array, "b kv g t hd"], k: Float[Array, "b kv t hd"], v: Float[Array, "b kv t hd"], mask: Bool[Array, "b 1 t t"], block: int
) -> Float[Array, "b kv g t hd"]:
    """Self-attention over one sequence whose mask is causal in index order, `block` queries at a time.

    Query block i reads keys 0 .. end of block i only; everything it skips is masked
    anyway, so the result equals dense attention. Packed documents keep working: the
    mask still hides other documents inside the blocks that are computed. `block` <= 0
    or >= t computes one dense block."""
    t = q.shape[3]
    if block <= 0 or block >= t:
        return _attend(q, k, v, mask)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        outs.append(_attend(q[:, :, :, start:end], k[:, :, :end], v[:, :, :end], mask[:, :, start:end, :end]))
    return jnp.concatenate(outs, axis=3)


def dot_attention(
    q: Float[Array, "b tq h hd"], k: Float[Array, "b tk kv hd"], v: Float[Array, "b tk kv hd"], mask: Bool[Array, "b 1 tq tk"]
) -> Float[Array, "b tq h hd"]:
    """Every query against every key, in the [batch, time, heads, hd] layout (a KV cache, tests)."""
    b, tq, h, hd = q.shape
    kv = k.shape[2]
    heads_first = lambda x: split_heads(x.reshape(*x.shape[:2], -1), kv, hd)
    out = _attend(heads_first(q), heads_first(k)[:, :, 0], heads_first(v)[:, :, 0], mask)
    return merge_heads(out).reshape(b, tq, h, hd)


def library_attention(
    q: Float[Array, "b t h hd"], k: Float[Array, "b t kv hd"], v: Float[Array, "b t kv hd"], mask: Bool[Array, "b 1 t t"], impl: str
) -> Float[Array, "b t h hd"]:
    """Causal self-attention through `jax.nn.dot_product_attention`: impl "cudnn" is cuDNN's flash
    attention (an NVIDIA GPU, bf16), "xla" the same call on XLA's reference path (any backend).

    `mask` (causal, documents) is passed as well as `is_causal`: cuDNN then adds it as a bias, which
    also keeps packed documents apart."""
    if impl == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.attention_impl=cudnn needs an NVIDIA GPU, but this run's backend is "
                          f"{jax.default_backend()}; use model.attention_impl=blocked")
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)
