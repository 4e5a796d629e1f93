"""Gradient checks of every layer of the model and of the full loss, and proof the check can fail."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.config import ModelConfig
from lib.gradcheck import GradCheckError, assert_gradcheck, gradcheck
from lib.train_state import model_loss_sum
from tests.fast_init import random_module
from lib.model import Attention, Block, Llama, RMSNorm, SwiGLU, attention_mask, rope_tables

# float64 weights; init_std large enough that every non-linearity (softmax, SiLU, RMSNorm) is exercised.
CFG = ModelConfig(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, vocab_size=37, init_std=0.3, compute_dtype="float64")
B, T = 2, 6


def inputs(seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, CFG.d_model)), jnp.float32)


def context():
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    cos, sin = rope_tables(positions, CFG.d_model // CFG.n_heads, CFG.rope_theta)
    return cos, sin, attention_mask(positions, positions)


def test_rmsnorm():
    norm = random_module(RMSNorm, CFG.d_model, CFG.norm_eps, norm_noise=0.3)
    assert_gradcheck(lambda m, x: m(x), norm, inputs(), name="RMSNorm")


@pytest.mark.parametrize("block", [0, 4])  # dense, and causal blocks of 4 + a ragged 2 over T = 6
def test_attention_gqa(block):
    attn = random_module(Attention, dataclasses.replace(CFG, attention_block=block), seed=1, std=CFG.init_std)
    cos, sin, mask = context()
    assert_gradcheck(lambda m, x: m(x, cos, sin, mask), attn, inputs(), name=f"Attention block={block}")


def test_swiglu():
    assert_gradcheck(lambda m, x: m(x), random_module(SwiGLU, CFG, seed=2, std=CFG.init_std), inputs(), name="SwiGLU")


def test_block():
    block = random_module(Block, CFG, seed=3, std=CFG.init_std, norm_noise=0.3)
    cos, sin, mask = context()
    assert_gradcheck(lambda m, x: m(x, cos, sin, mask), block, inputs(), name="Block")


def tokens_and_mask():
    tokens = jnp.asarray(np.random.default_rng(4).integers(1, CFG.vocab_size, (B, T)), jnp.int32)
    mask = jnp.ones((B, T), bool).at[1, -2:].set(False)  # a padded tail: masked targets must get no gradient
    return tokens, mask


def test_llama_logits():
    model = random_module(Llama, CFG, seed=5, std=CFG.init_std, norm_noise=0.3)
    tokens, _ = tokens_and_mask()
    result = assert_gradcheck(lambda m: m(tokens), model, name="Llama logits")
    assert result.dtype == "float64" and len(result.directions) == 4


@pytest.mark.parametrize("logits_chunk", [0, 4])
def test_full_training_loss(logits_chunk):
    """The train step's own loss (lib.train_state.model_loss_sum) through tied embeddings (two gradient
    paths into one matrix), z-loss and padded targets; with plain logits (forward and reverse mode
    checked) and with the fused chunked head, whose hand-written VJP is checked in reverse mode
    (chunks of 4 positions + a padded one over T = 6)."""
    cfg = dataclasses.replace(CFG, tie_embeddings=True, logits_chunk=logits_chunk)
    model = random_module(Llama, cfg, seed=6, std=CFG.init_std, norm_noise=0.3)
    tokens, mask = tokens_and_mask()

    def loss(m):
        total, count = model_loss_sum(m, {"tokens": tokens, "mask": mask}, 1e-2)  # with z-loss
        return total / count

    result = assert_gradcheck(loss, model, name=f"training loss logits_chunk={logits_chunk}")
    assert all((d.jvp_error is None) == bool(logits_chunk) for d in result.directions)


@jax.custom_vjp
def silu_right(x):
    return x * jax.nn.sigmoid(x)


def _silu_fwd(x):
    return silu_right(x), x


def _silu_bwd(x, g):
    s = jax.nn.sigmoid(x)
    return (g * (s + x * s * (1 - s)),)


silu_right.defvjp(_silu_fwd, _silu_bwd)


@jax.custom_vjp
def silu_wrong(x):
    return x * jax.nn.sigmoid(x)


def _silu_wrong_bwd(x, g):
    return (g * jax.nn.sigmoid(x),)  # forgets the x * s'(x) term: a typical hand-derivation slip


silu_wrong.defvjp(_silu_fwd, _silu_wrong_bwd)


def test_custom_vjp_correct_passes_vjp_only():
    result = assert_gradcheck(lambda x: jnp.sum(silu_right(x) ** 2), inputs())
    assert all(d.jvp_error is None for d in result.directions)
    assert any("custom_vjp" in n for n in result.notes)


def test_wrong_custom_vjp_fails():
    result = gradcheck(lambda x: silu_wrong(x), inputs())
    assert not result.ok and result.worst > 1e3
    with pytest.raises(GradCheckError, match="FAILED"):
        assert_gradcheck(lambda x: silu_wrong(x), inputs())


def test_float32_check_catches_gross_errors_only():
    """float32 tolerances are loose but still separate a right from a wrong backward rule."""
    assert gradcheck(lambda x: silu_right(x), inputs(), dtype="float32").ok
    assert not gradcheck(lambda x: silu_wrong(x), inputs(), dtype="float32").ok


def test_downcasting_function_is_flagged():
    result = gradcheck(lambda x: jnp.tanh(x.astype(jnp.float32)), inputs())
    assert any("casts down" in n for n in result.notes)


def test_integer_only_inputs_rejected():
    with pytest.raises(ValueError, match="no floating-point array"):
        gradcheck(lambda t: jnp.sum(t), jnp.arange(4))
