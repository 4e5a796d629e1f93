"""The planted faults themselves: each changes exactly what it claims to, and nothing else."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.align_faults import Fault, parse_fault
from lib.config import ConfigError, load_config
from lib.model import Llama
from lib.train_state import model_loss_sum


@pytest.fixture(scope="module")
def model():
    return Llama(load_config(["+exp=smoke"]).model, jax.random.PRNGKey(0))


def batch(model):
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, model.cfg.vocab_size)
    return {"tokens": tokens, "mask": jnp.ones(tokens.shape, bool)}


def test_parse_fault(model):
    assert parse_fault("", model) == Fault("")
    assert parse_fault("layer_scale:1:1.5", model).layer == 1
    assert parse_fault("shift_labels", model).changes_loss
    assert parse_fault("grad_scale:blocks.mlp.w_up:0:2", model) == Fault("grad_scale", "blocks.mlp.w_up", 0, 2.0)
    assert parse_fault("grad_scale:embed:2", model).layer is None
    for bad in ("layer_scale:1", "layer_scale:x:2", "shift_labels:1", "grad_scale:blocks.mlp:0:2", "grad_scale:embed:0:2", "nonsense"):
        with pytest.raises(ConfigError):
            parse_fault(bad, model)


def test_layer_scale_changes_only_that_layer(model):
    scaled = parse_fault("layer_scale:1:2", model).weights(model)
    np.testing.assert_array_equal(scaled.blocks.attn.wo[0], model.blocks.attn.wo[0])
    np.testing.assert_allclose(scaled.blocks.mlp.w_down[1], 2 * model.blocks.mlp.w_down[1])


def test_grad_scale_keeps_the_loss_and_scales_one_gradient_slice(model):
    fault = parse_fault("grad_scale:blocks.mlp.w_up:1:3", model)
    b = batch(model)
    plain = eqx.filter_value_and_grad(lambda m: model_loss_sum(m, b, 0.0)[0])(model)
    faulty = eqx.filter_value_and_grad(lambda m: fault.loss_sum(model_loss_sum, lambda x: x)(m, b, 0.0)[0])(model)
    assert float(plain[0]) == float(faulty[0])  # forward bit-identical
    np.testing.assert_allclose(faulty[1].blocks.mlp.w_up[1], 3 * plain[1].blocks.mlp.w_up[1], rtol=1e-6)
    np.testing.assert_array_equal(faulty[1].blocks.mlp.w_up[0], plain[1].blocks.mlp.w_up[0])
    np.testing.assert_array_equal(faulty[1].embed, plain[1].embed)


def test_shift_labels_scores_the_token_two_ahead(model):
    b = batch(model)
    total, count = parse_fault("shift_labels", model).loss_sum(model_loss_sum, lambda x: x)(model, b, 0.0)
    logp = jax.nn.log_softmax(model(b["tokens"]), axis=-1)
    expected = -jnp.take_along_axis(logp[:, :-2], b["tokens"][:, 2:, None], axis=-1).sum()
    assert int(count) == 2 * 14 and float(total) == pytest.approx(float(expected), rel=1e-5)
