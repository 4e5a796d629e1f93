"""Cached decoding against the full forward pass, compile counts, and the sampling rules."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lib.config import ModelConfig
from lib.generate import TRACES, KVCache, decode_step, generate_tokens, prefill, sample_token, stream_text
from lib.model import Llama

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=50, init_std=0.3)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, jax.random.PRNGKey(0))


@eqx.filter_jit
def full_logits(model, tokens):
    return model(tokens)


def test_prefill_then_decode_gives_the_full_forward_logits_at_every_position(model):
    tokens = jax.random.randint(jax.random.PRNGKey(2), (1, 9), 0, CFG.vocab_size)
    settings = (jnp.float32(0), jnp.int32(0), jnp.float32(1))
    key = jax.random.PRNGKey(0)
    # The shapes generate_tokens uses below (one row, a 128-slot cache), so their compilations are shared.
    _, logits, cache = prefill(model, tokens[:, :4], KVCache.empty(model, 1, 128), key, *settings)
    cached = [logits]
    for pos in range(4, 9):  # teacher-forced: feed the known next token, one at a time
        _, step_logits, cache = decode_step(model, tokens[:, pos], jnp.int32(pos), cache, key, *settings)
        cached.append(step_logits[:, None])
    full = full_logits(model, tokens)
    assert float(jnp.abs(full).max()) > 0.1  # the comparison is not between near-zeros
    np.testing.assert_allclose(np.asarray(jnp.concatenate(cached, 1)), np.asarray(full), atol=2e-5, rtol=1e-5)


def test_decode_step_compiles_once_for_any_length_and_sampling_settings(model):
    list(generate_tokens(model, [1, 5, 7, 9], max_tokens=6))
    before = dict(TRACES)
    out = list(generate_tokens(model, [1, 2, 3, 4], max_tokens=20, temperature=0.7, top_k=5, top_p=0.9, seed=3))
    assert len(out) == 20 and TRACES == before  # same shapes: no new trace for 19 more decode steps


def test_greedy_follows_the_argmax_and_sampling_is_reproducible(model):
    prompt = [1, 4, 9, 16]
    greedy = list(generate_tokens(model, prompt, max_tokens=5))
    ids = list(prompt)
    for _ in range(5):  # greedy by hand with the uncached model; causal, so right-padding to 8 changes nothing
        logits = full_logits(model, jnp.asarray([ids + [0] * (8 - len(ids))]))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    assert greedy == ids[len(prompt):]
    a = list(generate_tokens(model, prompt, max_tokens=8, temperature=1.0, seed=7))
    b = list(generate_tokens(model, prompt, max_tokens=8, temperature=1.0, seed=7))
    c = list(generate_tokens(model, prompt, max_tokens=8, temperature=1.0, seed=8))
    assert a == b and a != c


def test_generation_stops_at_the_stop_token(model):
    first = next(iter(generate_tokens(model, [1, 4, 9, 16], max_tokens=5)))
    assert list(generate_tokens(model, [1, 4, 9, 16], max_tokens=5, stop_id=first)) == []


def test_top_k_and_top_p_restrict_the_candidates():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)

    many = jax.jit(jax.vmap(lambda k, t, tk, tp: sample_token(logits, k, t, tk, tp)[0], in_axes=(0, None, None, None)))

    def draws(temperature, top_k, top_p):
        return np.bincount(np.asarray(many(keys, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))), minlength=4)

    assert draws(0.0, 0, 1.0).tolist() == [400, 0, 0, 0]  # greedy
    assert draws(1.0, 1, 1.0).tolist() == [400, 0, 0, 0]  # top_k=1 is greedy
    top2 = draws(1.0, 2, 1.0)
    assert top2[2:].sum() == 0 and top2[0] > top2[1] > 0
    nucleus = draws(1.0, 0, 0.8)  # 0.5 + 0.3 reaches 0.8: the last two are cut
    assert nucleus[2:].sum() == 0 and nucleus[1] > 0
    assert (draws(1.0, 0, 1.0) > 0).all()


def test_streaming_holds_back_split_characters():
    from lib.corpus import train_tokenizer

    tok = train_tokenizer(["snow ☃ and ice ☃☃"] * 20, vocab_size=270)
    ids = tok.encode("ice ☃ é").ids
    pieces = []
    text = stream_text(tok, iter(ids), pieces.append)
    assert text == "ice ☃ é" and "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
