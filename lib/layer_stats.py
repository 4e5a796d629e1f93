"""Per-layer forward and backward statistics of one step: where does the first non-finite value appear?

Forward: the embedding output, every block's output (Llama.hidden(collect=True)),
the final norm, the logits and the loss. Backward: the gradient of the loss with
respect to each of those, from the loss back to the embedding, one block at a
time with `jax.vjp` (a Python loop over the layers: this is a debugging tool,
clarity beats speed). Then the parameter gradients, per layer. The first entry
in that order with a non-finite value is "the first bad point".
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from lib.loss import next_token_loss_sum
from lib.model import Llama


def tensor_stats(x) -> dict:
    """min, max, mean, rms over the finite entries, and whether every entry is finite."""
    x = np.asarray(jnp.asarray(x, jnp.float32))
    finite = np.isfinite(x)
    vals = x[finite]
    if vals.size == 0:
        return {"min": float("nan"), "max": float("nan"), "mean": float("nan"), "rms": float("nan"), "finite": False, "nonfinite_count": int(x.size)}
    return {
        "min": float(vals.min()), "max": float(vals.max()), "mean": float(vals.mean()),
        "rms": float(np.sqrt(np.mean(np.square(vals.astype(np.float64))))),
        "finite": bool(finite.all()), "nonfinite_count": int((~finite).sum()),
    }


def _block(model: Llama, i: int):
    params, static = eqx.partition(model.blocks, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda a: a[i], params), static)


@eqx.filter_jit
def layer_values(model: Llama, batch: dict, z_loss: float = 0.0) -> tuple[list, list]:
    """[(name, forward value)] from embedding to loss, and [(name, d loss / d that layer's output)] from the top down."""
    tokens, mask, seg = batch["tokens"], batch["mask"], batch.get("segment_ids")
    total_valid = jnp.maximum(mask[:, 1:].sum(), 1).astype(jnp.float32)
    cos, sin, attn_mask = model.context(tokens, segment_ids=seg)
    x0 = model.embed_tokens(tokens)
    _, per_layer = model.hidden(tokens, segment_ids=seg, collect=True)
    outputs = [x0] + [per_layer[i] for i in range(model.cfg.n_layers)]  # outputs[i+1] = block i's output

    def head(x):
        h = model.final_norm(x)
        logits = (h @ model.head_weight().astype(h.dtype)).astype(jnp.float32)
        return h, logits, next_token_loss_sum(logits, tokens, mask, z_loss)[0] / total_valid

    h, logits, loss = head(outputs[-1])
    names = ["embed"] + [f"block_{i}" for i in range(model.cfg.n_layers)]
    forward = list(zip(names, outputs)) + [("final_norm", h), ("logits", logits), ("loss", loss)]

    # Backward: d loss / d (each layer's output), from the top down, one block's vjp at a time.
    _, head_vjp = jax.vjp(lambda x: head(x)[2], outputs[-1])
    (g,) = head_vjp(jnp.ones_like(loss))
    backward = [(names[-1], g)]
    for i in reversed(range(model.cfg.n_layers)):
        _, block_vjp = jax.vjp(lambda x, b=_block(model, i): b(x, cos, sin, attn_mask), outputs[i])
        (g,) = block_vjp(g)
        backward.append((names[i], g))  # names[i] is the layer whose output feeds block i
    return forward, backward


def layer_report(model: Llama, batch: dict, z_loss: float = 0.0, param_grads=None) -> list[dict]:
    """Rows {direction, name, stats...} in the order a value flows: forward, then backward, then parameter grads."""
    forward, backward = layer_values(model, batch, z_loss)
    rows = [{"direction": "forward", "name": name, **tensor_stats(v)} for name, v in forward]
    rows += [{"direction": "backward", "name": f"d loss / d {name} output", **tensor_stats(g)} for name, g in backward]
    if param_grads is not None:
        rows += parameter_grad_rows(param_grads)
    return rows


def parameter_grad_rows(grads: Llama) -> list[dict]:
    """One row per layer (all of its weights together), plus embedding, final norm and LM head."""
    def flat(tree):
        leaves = [np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]
        return np.concatenate(leaves) if leaves else np.zeros(0, np.float32)

    rows = [{"direction": "param_grad", "name": "embed", **tensor_stats(grads.embed)}]
    for i in range(grads.cfg.n_layers):
        rows.append({"direction": "param_grad", "name": f"block_{i}", **tensor_stats(flat(_block(grads, i)))})
    rows.append({"direction": "param_grad", "name": "final_norm", **tensor_stats(flat(grads.final_norm))})
    if grads.lm_head is not None:
        rows.append({"direction": "param_grad", "name": "lm_head", **tensor_stats(grads.lm_head)})
    return rows


def first_nonfinite(rows: list[dict]) -> dict | None:
    return next((r for r in rows if not r["finite"]), None)
