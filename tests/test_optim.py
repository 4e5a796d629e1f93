import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.config import ModelConfig, OptimConfig
from lib.model import Llama
from lib.optim import lr_schedule, make_optimizer, weight_decay_mask
from lib.train_state import accumulated_grads, init_train_state, make_train_step

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64)


def test_weight_decay_groups():
    model = Llama(TINY, jax.random.PRNGKey(0))
    mask = weight_decay_mask(model, decay_embeddings=False)
    assert mask.blocks.attn.wq and mask.blocks.mlp.w_down and mask.lm_head
    assert not mask.blocks.attn_norm.weight and not mask.final_norm.weight  # norm scales: never
    assert not mask.embed
    assert weight_decay_mask(model, decay_embeddings=True).embed


def test_schedule_warmup_peak_and_decay_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    sched = lr_schedule(cfg, total_steps=110)
    lrs = np.array([float(sched(s)) for s in range(111)])
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert np.all(np.diff(lrs[:10]) > 0)  # warmup rises
    assert np.all(np.diff(lrs[10:]) <= 1e-7)  # then decays
    assert lrs[110] == pytest.approx(0.1, abs=1e-6)  # to the floor
    linear = lr_schedule(OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear"), 100)
    assert float(linear(50)) == pytest.approx(0.5)


def _batch(key, b=8, t=16, vocab=64):
    tokens = jax.random.randint(key, (b, t), 2, vocab)
    # Uneven padding: micro-batches hold different numbers of valid tokens.
    lengths = jnp.array([16, 3, 16, 9, 16, 16, 5, 2])
    mask = jnp.arange(t)[None] < lengths[:, None]
    return {"tokens": jnp.where(mask, tokens, 0), "mask": mask}


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulation_equals_full_batch_update(accum):
    batch = _batch(jax.random.PRNGKey(1))
    results = []
    for steps in (1, accum):
        model = Llama(TINY, jax.random.PRNGKey(0))  # fresh: the step donates the state's buffers
        cfg = OptimConfig(accum_steps=steps, warmup_steps=0, clip_norm=0.05)  # clipping active
        opt = make_optimizer(cfg, model, 10)
        step = make_train_step(opt, lr_schedule(cfg, 10), steps)
        state, metrics = step(init_train_state(model, opt, 0), batch)
        results.append((state, metrics))
    (full, m_full), (acc, m_acc) = results
    assert float(m_acc["loss"]) == pytest.approx(float(m_full["loss"]), rel=1e-5)
    assert float(m_acc["grad_norm"]) == pytest.approx(float(m_full["grad_norm"]), rel=1e-5)
    # Adam's first step is ~lr * sign(g): compare with an absolute tolerance far below lr (1e-3).
    for a, b in zip(jax.tree.leaves(acc.model), jax.tree.leaves(full.model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_accumulated_gradients_equal_full_batch_gradients():
    model = Llama(TINY, jax.random.PRNGKey(0))
    batch = _batch(jax.random.PRNGKey(1))
    (loss1, g1), n1 = accumulated_grads(model, batch, 1, 0.0)
    (loss4, g4), n4 = accumulated_grads(model, batch, 4, 0.0)
    assert float(n1) == float(n4) == float(batch["mask"][:, 1:].sum())
    assert float(loss4) == pytest.approx(float(loss1), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8)


def test_schedule_advances_per_optimizer_step_not_micro_step():
    model = Llama(TINY, jax.random.PRNGKey(0))
    cfg = OptimConfig(accum_steps=4, warmup_steps=10, lr=1.0)
    opt = make_optimizer(cfg, model, 100)
    step = make_train_step(opt, lr_schedule(cfg, 100), 4)
    state = init_train_state(model, opt, 0)
    lrs = []
    for _ in range(3):
        state, m = step(state, _batch(jax.random.PRNGKey(2)))
        lrs.append(float(m["lr"]))
    assert int(state.step) == 3
    assert lrs == pytest.approx([0.1, 0.2, 0.3])
