"""lib/attention.py: the written-out attention equals jax's, and skipping masked blocks changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.attention import causal_attention, dot_attention, merge_heads, split_heads
from lib.model import attention_mask

B, T, HEADS, KV, HD = 2, 40, 4, 2, 8


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, HEADS, HD)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, KV, HD)), jnp.float32) for _ in range(2))
    return q, k, v


def masks():
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    # Packed documents: row 0 holds three, row 1 one.
    segments = jnp.stack([jnp.repeat(jnp.arange(3), jnp.array([15, 9, 16]), total_repeat_length=T), jnp.zeros(T, jnp.int32)])
    return {"causal": attention_mask(positions, positions), "documents": attention_mask(positions, positions, segments, segments)}


def blocked(q, k, v, mask, block):
    """causal_attention from and back to the [b, t, heads, hd] layout."""
    heads_first = lambda x: split_heads(x.reshape(B, T, -1), KV, HD)
    out = causal_attention(heads_first(q), heads_first(k)[:, :, 0], heads_first(v)[:, :, 0], mask, block)
    return merge_heads(out).reshape(B, T, HEADS, HD)


@pytest.mark.parametrize("mask_name", ["causal", "documents"])
def test_dot_attention_matches_jax_fused_attention(mask_name):
    q, k, v = qkv()
    mask = masks()[mask_name]
    np.testing.assert_allclose(dot_attention(q, k, v, mask), jax.nn.dot_product_attention(q, k, v, mask=mask), atol=2e-6)


@pytest.mark.parametrize("block", [16, 13])  # blocks of 16 (40 = 16 + 16 + 8), of 13 (+ a ragged 1)
@pytest.mark.parametrize("mask_name", ["causal", "documents"])
def test_causal_blocks_equal_dense_attention_in_value_and_gradient(block, mask_name):
    q, k, v = qkv(1)
    mask = masks()[mask_name]
    cotangent = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, HEADS, HD)), jnp.float32)
    dense_out, dense_vjp = jax.vjp(lambda *a: dot_attention(*a, mask), q, k, v)
    out, vjp = jax.vjp(lambda *a: blocked(*a, mask, block), q, k, v)
    np.testing.assert_allclose(out, dense_out, atol=2e-6)
    for a, b in zip(vjp(cotangent), dense_vjp(cotangent)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_blocks_skip_the_masked_work():
    """With 4 blocks the score matrices hold 10/16 of the query-key pairs that dense attention computes."""
    q, k, v = qkv()
    mask = masks()["causal"]

    def score_elements(block):
        jaxpr = jax.make_jaxpr(lambda *a: blocked(*a, mask, block))(q, k, v)
        return sum(int(np.prod(e.outvars[0].aval.shape)) for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] != HD)

    assert score_elements(10) / score_elements(0) == pytest.approx(10 / 16)


def test_bfloat16_keeps_scores_and_softmax_in_float32():
    q, k, v = qkv(3)
    mask = masks()["causal"]
    out = blocked(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask, 16)
    assert out.dtype == jnp.bfloat16
    jaxpr = jax.make_jaxpr(lambda *a: blocked(*a, mask, 16))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    exps = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "exp"]
    assert exps and all(e.outvars[0].aval.dtype == jnp.float32 for e in exps)
    np.testing.assert_allclose(np.asarray(out, np.float32), dot_attention(q, k, v, mask), atol=3e-2)
