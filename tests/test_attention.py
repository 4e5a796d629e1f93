"""lib/attention.py: the written-out attention equals jax's, and skipping masked blocks changes nothing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.attention import causal_attention, dot_attention, library_attention, merge_heads, split_heads
from lib.config import ConfigError, ModelConfig
from lib.model import Llama, attention_mask

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


@pytest.mark.parametrize("dtype, atol", [("float32", 2e-5), ("bfloat16", 3e-2)])
def test_model_through_jax_attention_equals_blocked_attention(dtype, atol):
    """attention_impl=xla runs the same jax.nn.dot_product_attention call as cudnn (only the implementation
    argument differs): the model's loss gradient through it equals the blocked path's, packed documents included."""
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=50, attention_block=16,
                      compute_dtype=dtype)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, cfg.vocab_size)
    segments = jnp.repeat(jnp.arange(3), jnp.array([15, 9, 16]), total_repeat_length=T)[None].repeat(B, 0)
    models = {impl: Llama(dataclasses.replace(cfg, attention_impl=impl), jax.random.PRNGKey(0)) for impl in ("blocked", "xla")}

    def loss(model):
        return model(tokens, segment_ids=segments).mean()

    (value_b, grads_b), (value_x, grads_x) = (jax.value_and_grad(loss)(models[i]) for i in ("blocked", "xla"))
    assert abs(float(value_b) - float(value_x)) < atol
    for gb, gx in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_x)):
        np.testing.assert_allclose(gx, gb, atol=atol * 1e-2 if dtype == "float32" else atol)


def test_cudnn_attention_off_a_gpu_is_a_config_error():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv())
    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="model.attention_impl=cudnn needs an NVIDIA GPU.*use model.attention_impl=blocked"):
        library_attention(q, k, v, masks()["causal"], "cudnn")


def test_cudnn_attention_lowers_for_cuda_in_a_whole_train_step(monkeypatch):
    """No GPU here, so check what can be checked: JAX accepts our shapes, dtypes, GQA and mask for its cuDNN
    kernel, in the real train step with remat, and lowers it to cuDNN's fused forward and backward calls."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)  # what a CUDA machine would report
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    from lib.config import OptimConfig
    from lib.optim import lr_schedule, make_optimizer
    from lib.train_state import init_train_state, make_train_step

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, compute_dtype="bfloat16",
                      remat="selective", attention_impl="cudnn")
    optimizer = make_optimizer(OptimConfig(), Llama(cfg, jax.random.PRNGKey(0)), 10)
    state = jax.eval_shape(lambda: init_train_state(Llama(cfg, jax.random.PRNGKey(0)), optimizer, 0))
    batch = {"tokens": jax.ShapeDtypeStruct((2, 128), jnp.int32), "mask": jax.ShapeDtypeStruct((2, 128), bool)}
    step = make_train_step(optimizer, lr_schedule(OptimConfig(), 10))
    text = step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaScaleBiasSoftmax(" in text and "__cudnn$fmhaScaleBiasSoftmaxBackward(" in text
