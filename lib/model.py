"""A LLaMA-family decoder as an Equinox PyTree.

Written for one device: nothing here knows about meshes or sharding
(`lib/sharding.py` applies those from outside by rules over the PyTree paths).

Layout: weights are plain arrays stored as [in, out] so `x @ w` reads as the
maths. The `n_layers` blocks are stored *stacked* (every block leaf has a
leading layer axis) and run with `lax.scan`, so compile time does not grow
with depth and a pipeline can slice the stack into stages.
"""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from lib.attention import causal_attention, dot_attention, library_attention, merge_heads, split_heads
from lib.config import ModelConfig

# float64 is for gradient checks (lib/gradcheck.py runs the model in double under x64); not a training policy.
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def at_least_f32(x):
    """Upcast to fp32 for numerically delicate maths, but let float64 pass (gradient checks run in double)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _normal(key, shape, std):
    return std * jax.random.normal(key, shape, jnp.float32)


def linear(x, w):
    """x [..., in] @ w [in, out] as one 2-D matmul in x's dtype.

    Flattening the leading axes first matters on CPU: XLA then runs the backward's
    weight gradient as one plain GEMM (x^T @ dy) instead of a slower batched contraction."""
    out = x.reshape(-1, x.shape[-1]) @ w.astype(x.dtype)
    return out.reshape(*x.shape[:-1], w.shape[-1])


class RMSNorm(eqx.Module):
    weight: Float[Array, "d"]
    eps: float = eqx.field(static=True)

    def __init__(self, d: int, eps: float):
        self.weight = jnp.ones((d,), jnp.float32)
        self.eps = eps

    def __call__(self, x):
        # Statistics in fp32 even under a bf16 policy: a mean of squares loses too much in bf16.
        x32 = at_least_f32(x)
        scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale * self.weight).astype(x.dtype)


def rope_tables(positions: Int[Array, "b t"], head_dim: int, theta: float):
    """cos/sin for rotary embeddings, rotating the two halves of each head (the HF LLaMA layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [b, t, hd]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate each head's two halves by the position's angles; cos/sin [..., hd] broadcast against x."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (at_least_f32(x) * cos + at_least_f32(rotated) * sin).astype(x.dtype)


def attention_mask(q_pos, k_pos, q_seg=None, k_seg=None, k_valid=None):
    """Boolean [b, 1, tq, tk]: causal, within the same document, and only real keys."""
    mask = q_pos[:, :, None] >= k_pos[:, None, :]
    if q_seg is not None:
        mask &= q_seg[:, :, None] == k_seg[:, None, :]
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    return mask[:, None]


class Attention(eqx.Module):
    wq: Float[Array, "d hq"]
    wk: Float[Array, "d hk"]
    wv: Float[Array, "d hk"]
    wo: Float[Array, "hq d"]
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    block: int = eqx.field(static=True)  # causal attention runs in query blocks of this many positions
    impl: str = eqx.field(static=True)  # blocked (lib/attention.py) or a jax.nn.dot_product_attention implementation

    def __init__(self, cfg: ModelConfig, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        hd = cfg.d_model // cfg.n_heads
        std = cfg.init_std
        self.wq = _normal(k1, (cfg.d_model, cfg.n_heads * hd), std)
        self.wk = _normal(k2, (cfg.d_model, cfg.n_kv_heads * hd), std)
        self.wv = _normal(k3, (cfg.d_model, cfg.n_kv_heads * hd), std)
        # Scaled like GPT-2's residual projections so the residual stream does not grow with depth.
        self.wo = _normal(k4, (cfg.n_heads * hd, cfg.d_model), std / (2 * cfg.n_layers) ** 0.5)
        self.n_heads, self.n_kv_heads, self.block = cfg.n_heads, cfg.n_kv_heads, cfg.attention_block
        self.impl = cfg.attention_impl

    @property
    def head_dim(self):
        return self.wq.shape[1] // self.n_heads

    def project_qkv(self, x, cos, sin):
        """q [b, t, heads, hd], k and v [b, t, kv_heads, hd], RoPE applied (lib/generate.py fills its cache from these)."""
        b, t, _ = x.shape
        q = linear(x, self.wq).reshape(b, t, self.n_heads, self.head_dim)
        k = linear(x, self.wk).reshape(b, t, self.n_kv_heads, self.head_dim)
        v = linear(x, self.wv).reshape(b, t, self.n_kv_heads, self.head_dim)
        cos, sin = cos[:, :, None], sin[:, :, None]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """Queries against any keys (a KV cache): every query-key pair is computed."""
        out = dot_attention(q, k, v, mask)
        return linear(out.reshape(*out.shape[:2], -1), self.wo)

    def __call__(self, x, cos, sin, mask):
        if self.impl != "blocked":
            out = library_attention(*self.project_qkv(x, cos, sin), mask, self.impl)
            return linear(out.reshape(*out.shape[:2], -1), self.wo)
        # Heads-first from the start: the transpose after each projection fuses with RoPE, and the
        # attention matmuls batch over leading axes.
        kv, hd = self.n_kv_heads, self.head_dim
        q = split_heads(linear(x, self.wq), kv, hd)
        k = split_heads(linear(x, self.wk), kv, hd)[:, :, 0]
        v = split_heads(linear(x, self.wv), kv, hd)[:, :, 0]
        cos, sin = cos[:, None], sin[:, None]  # [b, 1, t, hd]
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos, sin)
        return linear(merge_heads(causal_attention(q, k, v, mask, self.block)), self.wo)


class SwiGLU(eqx.Module):
    w_gate: Float[Array, "d f"]
    w_up: Float[Array, "d f"]
    w_down: Float[Array, "f d"]

    def __init__(self, cfg: ModelConfig, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_gate = _normal(k1, (cfg.d_model, cfg.d_ff), cfg.init_std)
        self.w_up = _normal(k2, (cfg.d_model, cfg.d_ff), cfg.init_std)
        self.w_down = _normal(k3, (cfg.d_ff, cfg.d_model), cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x):
        return linear(jax.nn.silu(linear(x, self.w_gate)) * linear(x, self.w_up), self.w_down)


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: SwiGLU

    def __init__(self, cfg: ModelConfig, key):
        k1, k2 = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, k1)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, k2)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


_REMAT_POLICIES: dict[str, Callable | None] = {
    "layer": None,  # save only the block's input; recompute everything inside it
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Llama(eqx.Module):
    embed: Float[Array, "v d"]
    blocks: Block  # stacked: every leaf has a leading [n_layers] axis
    final_norm: RMSNorm
    lm_head: Float[Array, "d v"] | None
    cfg: ModelConfig = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, key):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = _normal(k_embed, (cfg.vocab_size, cfg.d_model), cfg.init_std)
        layer_keys = jax.random.split(k_blocks, cfg.n_layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(cfg, k))(layer_keys)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else _normal(k_head, (cfg.d_model, cfg.vocab_size), cfg.init_std)
        self.cfg = cfg

    @property
    def compute_dtype(self):
        return _DTYPES[self.cfg.compute_dtype]

    def embed_tokens(self, tokens: Int[Array, "b t"]):
        return jnp.take(self.embed, tokens, axis=0).astype(self.compute_dtype)

    def context(self, tokens, positions=None, segment_ids=None):
        """What every block needs besides the residual stream: RoPE tables and the mask."""
        head_dim = self.cfg.d_model // self.cfg.n_heads
        if positions is None:
            # Every row at positions 0..t-1: the tables are constants, computed once while tracing. Computed
            # inside the step, XLA fused the cos/sin into each RoPE of every layer, forward and backward (4% of a step).
            b, t = tokens.shape
            with jax.ensure_compile_time_eval():
                cos, sin = rope_tables(jnp.arange(t)[None], head_dim, self.cfg.rope_theta)
            cos, sin = jnp.broadcast_to(cos, (b, t, head_dim)), jnp.broadcast_to(sin, (b, t, head_dim))
            positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
        else:
            cos, sin = rope_tables(positions, head_dim, self.cfg.rope_theta)
        mask = attention_mask(positions, positions, segment_ids, segment_ids)
        return cos, sin, mask

    def run_blocks(self, blocks: Block, x, cos, sin, mask, collect: bool = False):
        """Apply a stack of blocks with `lax.scan`; `collect` also returns each block's output."""
        params, static = eqx.partition(blocks, eqx.is_array)

        def one_block(h, block_params):
            h = eqx.combine(block_params, static)(h, cos, sin, mask)
            return h, (h if collect else None)

        if self.cfg.remat != "none":
            one_block = jax.checkpoint(one_block, policy=_REMAT_POLICIES[self.cfg.remat])
            unroll = 1  # unrolled, XLA would merge the recomputation back into the forward and keep everything
        else:
            unroll = min(self.cfg.scan_unroll, self.cfg.n_layers)
        return jax.lax.scan(one_block, x, params, unroll=unroll)

    def head_weight(self):
        return self.embed.T if self.lm_head is None else self.lm_head

    def hidden(self, tokens, positions=None, segment_ids=None, collect: bool = False):
        """Final normalised hidden states [b, t, d] (before the LM head)."""
        cos, sin, mask = self.context(tokens, positions, segment_ids)
        x, per_layer = self.run_blocks(self.blocks, self.embed_tokens(tokens), cos, sin, mask, collect)
        out = self.final_norm(x)
        return (out, per_layer) if collect else out

    def logits(self, h):
        """The LM head on final hidden states, in fp32 (the softmax and loss want full precision; float64 stays float64)."""
        return at_least_f32(linear(h, self.head_weight()))

    def __call__(self, tokens, positions=None, segment_ids=None):
        """Logits [b, t, vocab] in fp32."""
        return self.logits(self.hidden(tokens, positions, segment_ids))


def count_params(model: Llama, include_embeddings: bool = True) -> int:
    n = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    if not include_embeddings:
        n -= model.embed.size
        if model.lm_head is not None:
            n -= model.lm_head.size
    return int(n)
