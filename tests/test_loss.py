import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.jaxprs import equations
from lib.loss import chunked_next_token_loss_sum, mse, next_token_loss_sum, perplexity, token_nll, valid_token_mean


def logits_for_probs(probs):
    return jnp.log(jnp.asarray(probs, jnp.float32))


@pytest.mark.parametrize("p, expected", [(0.9, 0.105), (0.8, 0.223), (0.1, 2.303), (0.001, 6.908)])
def test_seed_minus_ln_p_values(p, expected):
    # The seed text's numbers: -ln p for a confident, an unsure and a badly wrong prediction.
    rest = (1 - p) / 3
    logits = logits_for_probs([p, rest, rest, rest])
    assert float(token_nll(logits, jnp.array(0))) == pytest.approx(expected, abs=5e-4)


def test_labels_are_shifted_by_one():
    # Position t's logits predict token t+1: make position 0 certain of token 2 (the next token).
    vocab = 4
    tokens = jnp.array([[3, 2, 1]])
    logits = jnp.full((1, 3, vocab), -1e4).at[0, 0, 2].set(0.0).at[0, 1, 1].set(0.0)
    total, count = next_token_loss_sum(logits, tokens, jnp.ones_like(tokens, bool))
    assert int(count) == 2
    assert float(total) == pytest.approx(0.0, abs=1e-5)


def test_masked_targets_are_excluded_and_not_in_the_denominator():
    key = jax.random.PRNGKey(0)
    logits = jax.random.normal(key, (1, 5, 7))
    tokens = jnp.array([[1, 2, 3, 0, 0]])
    mask = tokens != 0
    per_token = token_nll(logits[:, :-1], tokens[:, 1:])
    expected = float(per_token[0, :2].mean())  # targets 2 and 3 only
    assert float(valid_token_mean(logits, tokens, mask)) == pytest.approx(expected, rel=1e-6)


def test_masking_uses_selection_so_nan_in_padding_does_not_leak():
    logits = jnp.zeros((1, 3, 4)).at[0, 2].set(jnp.nan)
    tokens = jnp.array([[1, 2, 0]])
    total, count = next_token_loss_sum(logits, tokens, jnp.array([[True, True, False]]))
    assert np.isfinite(float(total)) and int(count) == 1


def test_z_loss_adds_squared_log_partition():
    logits = jnp.array([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    tokens = jnp.array([[0, 2]])
    mask = jnp.ones_like(tokens, bool)
    plain = valid_token_mean(logits, tokens, mask)
    with_z = valid_token_mean(logits, tokens, mask, z_loss=1e-2)
    lse = jax.nn.logsumexp(logits[0, 0])
    assert float(with_z - plain) == pytest.approx(1e-2 * float(lse) ** 2, rel=1e-5)


def test_perplexity_and_mse():
    assert float(perplexity(jnp.log(50.0))) == pytest.approx(50.0, rel=1e-5)
    assert float(mse(jnp.array([1.0, 3.0]), jnp.array([0.0, 0.0]))) == pytest.approx(5.0)


@pytest.mark.parametrize("chunk", [5, 16])  # of T = 9 positions: two chunks (the second padded), one chunk
def test_chunked_loss_equals_plain_loss_in_value_and_gradient(chunk):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = jax.random.normal(k1, (3, 9, 8))
    head = jax.random.normal(k2, (8, 30))
    tokens = jax.random.randint(k3, (3, 9), 0, 30)
    mask = jnp.arange(9)[None] < jnp.array([[9], [4], [7]])

    def plain(h, w):
        return next_token_loss_sum(h @ w, tokens, mask, 1e-3)[0]

    def chunked(h, w):
        return chunked_next_token_loss_sum(h, w, tokens, mask, chunk, 1e-3)[0]

    assert float(chunked(hidden, head)) == pytest.approx(float(plain(hidden, head)), rel=1e-6)
    for a, b in zip(jax.grad(chunked, (0, 1))(hidden, head), jax.grad(plain, (0, 1))(hidden, head)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(chunked_next_token_loss_sum(hidden, head, tokens, mask, chunk)[1]) == int(mask[:, 1:].sum())


def largest_intermediate(fn, *args) -> int:
    """Elements of the biggest array any equation of fn's jaxpr (sub-jaxprs of scans etc. included) produces."""
    eqns = equations(jax.make_jaxpr(fn)(*args))
    return max(int(np.prod(v.aval.shape)) for eqn, _ in eqns for v in eqn.outvars if hasattr(v.aval, "shape"))


def test_chunked_loss_never_holds_all_logits_in_forward_or_backward():
    b, t, d, v, chunk = 2, 64, 8, 100, 16
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    hidden, head = jax.random.normal(k1, (b, t, d)), jax.random.normal(k2, (d, v))
    tokens = jax.random.randint(k3, (b, t), 0, v)
    mask = jnp.ones((b, t), bool)
    chunked = jax.value_and_grad(lambda h, w: chunked_next_token_loss_sum(h, w, tokens, mask, chunk)[0], (0, 1))
    plain = jax.value_and_grad(lambda h, w: next_token_loss_sum(h @ w, tokens, mask)[0], (0, 1))
    assert largest_intermediate(chunked, hidden, head) == b * chunk * v
    assert largest_intermediate(plain, hidden, head) >= b * (t - 1) * v  # the check sees full logits when they exist
