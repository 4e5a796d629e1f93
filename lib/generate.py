"""Sampling from a trained model with a key/value cache.

The cache holds every layer's keys and values for `size` positions: [layers,
batch, size, kv_heads, head_dim]. Generation is a prefill (the whole prompt in
one forward pass, filling the cache) and then one jitted decode step per new
token, which attends to the cache instead of recomputing the prefix. The cache
has a fixed size and the write position is a traced value
(`lax.dynamic_update_slice`), so the decode step compiles once per cache shape,
not once per token. Sampling settings are traced values too: changing the
temperature does not recompile.

The layer maths reuses the model's own pieces (`project_qkv`, `attend`, the
norms and the MLP) so cached decoding computes what `Llama.__call__` computes;
`tests/test_generate.py` checks the logits agree position by position.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from lib.model import Llama, attention_mask, rope_tables

# How many times each jitted function was traced (Python runs the body only when tracing): for tests.
TRACES: Counter = Counter()


class KVCache(eqx.Module):
    k: Float[Array, "layers b size kv hd"]
    v: Float[Array, "layers b size kv hd"]

    @staticmethod
    def empty(model: Llama, batch: int, size: int) -> "KVCache":
        c = model.cfg
        shape = (c.n_layers, batch, size, c.n_kv_heads, c.d_model // c.n_heads)
        return KVCache(jnp.zeros(shape, model.compute_dtype), jnp.zeros(shape, model.compute_dtype))


def forward_with_cache(model: Llama, tokens: Int[Array, "b t"], start, cache: KVCache):
    """Logits [b, t, vocab] for `tokens` at positions start..start+t-1, writing their keys/values into the cache."""
    b, t = tokens.shape
    size = cache.k.shape[2]
    positions = start + jnp.broadcast_to(jnp.arange(t), (b, t))
    cos, sin = rope_tables(positions, model.cfg.d_model // model.cfg.n_heads, model.cfg.rope_theta)
    slots = jnp.broadcast_to(jnp.arange(size), (b, size))
    # Causal over absolute positions; k_valid also hides slots not written yet.
    mask = attention_mask(positions, slots, k_valid=slots < start + t)
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def layer(x, xs):
        block_params, k_cache, v_cache = xs
        block = eqx.combine(block_params, static)
        q, k, v = block.attn.project_qkv(block.attn_norm(x), cos, sin)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
        x = x + block.attn.attend(q, k_cache, v_cache, mask)  # the rest is Block.__call__
        x = x + block.mlp(block.mlp_norm(x))
        return x, (k_cache, v_cache)

    x, (k_all, v_all) = jax.lax.scan(layer, model.embed_tokens(tokens), (params, cache.k, cache.v))
    h = model.final_norm(x)
    logits = (h @ model.head_weight().astype(h.dtype)).astype(jnp.float32)
    return logits, KVCache(k_all, v_all)


def sample_token(logits: Float[Array, "b v"], key, temperature, top_k, top_p) -> Int[Array, "b"]:
    """Greedy when temperature == 0; else sample from softmax(logits / T) restricted to the top_k most likely
    tokens (top_k <= 0: all) and to the smallest set whose probability reaches top_p (nucleus)."""
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ranked = jnp.sort(scaled, axis=-1)[..., ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take(ranked, k - 1, axis=-1)[..., None]
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    probs = jax.nn.softmax(ranked, axis=-1)
    # Keep a ranked token while the mass before it is below top_p (so the first is always kept).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    sampled = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@jax.jit
def prefill(model: Llama, tokens, cache: KVCache, key, temperature, top_k, top_p):
    """Run the prompt, fill the cache, sample the first new token (compiles once per prompt length)."""
    TRACES["prefill"] += 1
    logits, cache = forward_with_cache(model, tokens, 0, cache)
    return sample_token(logits[:, -1], key, temperature, top_k, top_p), logits, cache


@partial(jax.jit, donate_argnames="cache")  # the cache is updated in place, not copied per token
def decode_step(model: Llama, token, position, cache: KVCache, key, temperature, top_k, top_p):
    """One new token per row at `position` (traced): compiles once per cache shape."""
    TRACES["decode"] += 1
    logits, cache = forward_with_cache(model, token[:, None], position, cache)
    return sample_token(logits[:, 0], key, temperature, top_k, top_p), logits[:, 0], cache


def cache_size_for(needed: int, multiple: int = 128) -> int:
    """Round the cache up so nearby lengths share one compiled decode step."""
    return -(-needed // multiple) * multiple


def generate_tokens(
    model: Llama,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_id: int | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids after `prompt`, one at a time (for streaming)."""
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    cache = KVCache.empty(model, 1, cache_size_for(len(prompt) + max_tokens))
    settings = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
    key = jax.random.PRNGKey(seed)
    position = len(prompt)
    for i in range(max_tokens):
        key, sub = jax.random.split(key)
        if i == 0:
            token, _, cache = prefill(model, jnp.asarray([prompt], jnp.int32), cache, sub, *settings)
        else:
            token, _, cache = decode_step(model, token, jnp.int32(position), cache, sub, *settings)
            position += 1
        value = int(token[0])
        if value == stop_id:
            return
        yield value


def stream_text(tokenizer, new_ids: Iterator[int], write: Callable[[str], object]) -> str:
    """Decode as tokens arrive and write only the new text; hold back an incomplete UTF-8 character."""
    ids, shown = [], ""
    for token in new_ids:
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            continue
        write(text[len(shown):])
        shown = text
    text = tokenizer.decode(ids)
    write(text[len(shown):])
    return text
