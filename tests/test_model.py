import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.config import ModelConfig
from lib.jaxprs import equations
from lib.loss import valid_token_mean
from lib.model import Llama, count_params

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=50)


def tokens(b=2, t=12, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, CFG.vocab_size)


def test_shapes_dtype_and_stacked_layers():
    model = Llama(CFG, jax.random.PRNGKey(0))
    out = model(tokens())
    assert out.shape == (2, 12, 50) and out.dtype == jnp.float32
    assert model.blocks.attn.wq.shape == (2, 32, 32)
    assert model.blocks.attn.wk.shape == (2, 32, 16)  # grouped-query: 2 kv heads of 8
    hidden, per_layer = model.hidden(tokens(), collect=True)
    assert per_layer.shape == (2, 2, 12, 32)  # [layer, batch, time, d]


def test_default_positions_give_constant_rope_tables_equal_to_explicit_positions():
    model = Llama(CFG, jax.random.PRNGKey(0))
    t = tokens()
    explicit = model.context(t, positions=jnp.broadcast_to(jnp.arange(12), t.shape))
    for got, want in zip(model.context(t), explicit):
        np.testing.assert_array_equal(got, want)
    # Inside a jitted step no cos/sin is left to compute: XLA would otherwise redo it in every layer.
    ops = {eqn.primitive.name for eqn, _ in equations(jax.make_jaxpr(lambda x: model.context(x))(t))}
    assert not ops & {"sin", "cos"}
    assert {"sin", "cos"} <= {eqn.primitive.name for eqn, _ in equations(jax.make_jaxpr(lambda x, p: model.context(x, p))(t, t))}


def test_causal_future_tokens_do_not_change_the_past():
    model = Llama(CFG, jax.random.PRNGKey(0))
    a = tokens()
    b = a.at[:, 8:].set((a[:, 8:] + 1) % CFG.vocab_size)
    np.testing.assert_allclose(model(a)[:, :8], model(b)[:, :8], atol=1e-5)
    assert not np.allclose(model(a)[:, 8:], model(b)[:, 8:])


def test_segment_ids_isolate_packed_documents():
    model = Llama(CFG, jax.random.PRNGKey(0))
    a = tokens(1, 12)
    seg = jnp.array([[0] * 6 + [1] * 6])
    b = a.at[:, :6].set((a[:, :6] + 3) % CFG.vocab_size)  # change only document 0
    # Document 1's logits do not see document 0, but do depend on positions (RoPE) as usual.
    np.testing.assert_allclose(model(a, segment_ids=seg)[:, 6:], model(b, segment_ids=seg)[:, 6:], atol=1e-5)
    assert not np.allclose(model(a)[:, 6:], model(b)[:, 6:], atol=1e-5)


@pytest.mark.parametrize("remat", ["layer", "selective"])
def test_remat_changes_memory_not_maths(remat):
    base = Llama(CFG, jax.random.PRNGKey(0))
    other = Llama(dataclasses.replace(CFG, remat=remat), jax.random.PRNGKey(0))  # same weights
    t = tokens()
    mask = jnp.ones_like(t, bool)
    loss = lambda m: valid_token_mean(m(t), t, mask)
    g0 = jax.grad(loss)(base)
    g1 = jax.grad(loss)(other)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_tied_embeddings_share_the_table():
    tied = Llama(dataclasses.replace(CFG, tie_embeddings=True), jax.random.PRNGKey(0))
    assert tied.lm_head is None
    untied = Llama(CFG, jax.random.PRNGKey(0))
    assert count_params(untied) - count_params(tied) == CFG.d_model * CFG.vocab_size
    assert count_params(tied, include_embeddings=False) == count_params(untied, include_embeddings=False)


def test_bfloat16_policy_keeps_fp32_params_and_logits():
    model = Llama(dataclasses.replace(CFG, compute_dtype="bfloat16"), jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(model))
    out = model(tokens())
    assert out.dtype == jnp.float32
    ref = Llama(CFG, jax.random.PRNGKey(0))(tokens())
    assert float(jnp.max(jnp.abs(out - ref))) < 0.05  # bf16 matmuls: close, not equal


def test_chunked_logits_give_the_same_model_loss_and_gradients():
    from lib.train_state import model_loss_sum

    t = tokens()
    batch = {"tokens": t, "mask": jnp.ones_like(t, bool)}
    plain = Llama(CFG, jax.random.PRNGKey(0))
    chunked = Llama(dataclasses.replace(CFG, logits_chunk=7), jax.random.PRNGKey(0))
    loss = lambda m: model_loss_sum(m, batch, 0.0)[0]
    assert float(loss(chunked)) == pytest.approx(float(loss(plain)), rel=1e-6)
    for a, b in zip(jax.tree.leaves(jax.grad(loss)(chunked)), jax.tree.leaves(jax.grad(loss)(plain))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_training_keeps_fp32_master_weights_and_optimizer_state():
    from lib.config import OptimConfig
    from lib.optim import lr_schedule, make_optimizer
    from lib.train_state import init_train_state, make_train_step

    model = Llama(dataclasses.replace(CFG, compute_dtype="bfloat16"), jax.random.PRNGKey(0))
    opt = make_optimizer(OptimConfig(), model, 10)
    state = init_train_state(model, opt, 0)
    t = tokens()
    state, metrics = make_train_step(opt, lr_schedule(OptimConfig(), 10))(state, {"tokens": t, "mask": jnp.ones_like(t, bool)})
    floats = [x for x in jax.tree.leaves((state.model, state.opt_state)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    assert metrics["loss"].dtype == jnp.float32 and np.isfinite(float(metrics["loss"]))
