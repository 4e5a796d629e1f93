"""Known differences `recipes.align` can plant in setup b, to prove it finds and names them.

    layer_scale:L:F        block L's output projections (attn.wo, mlp.w_down) times F: the weights differ,
                           so the forward pass diverges first, at "layer L".
    shift_labels           each position is scored against the token two ahead instead of one (an
                           off-by-one in the labels): forward is untouched, the loss row diverges first.
    grad_scale:LEAF:L:F    the gradient reaching layer L of the stacked leaf LEAF (e.g. blocks.mlp.w_up)
                           is multiplied by F; with LEAF unstacked (e.g. embed) drop L. Forward and loss
                           are untouched, so the first divergence is that gradient leaf.

A weight fault changes the model before it is placed; a loss fault wraps the setup's
forward+loss function (`(model, batch, z_loss) -> (sum, count)`), so it runs inside the
same jitted gradient and train step as the real code, on any layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from lib.config import ConfigError
from lib.loss import next_token_loss_sum
from lib.model import Llama

KNOWN = "layer_scale:LAYER:FACTOR, shift_labels, grad_scale:LEAF[:LAYER]:FACTOR"


@dataclass(frozen=True)
class Fault:
    kind: str  # "" (none) | layer_scale | shift_labels | grad_scale
    leaf: str = ""
    layer: int | None = None
    factor: float = 1.0

    @property
    def changes_loss(self) -> bool:
        return self.kind in ("shift_labels", "grad_scale")

    def weights(self, model: Llama) -> Llama:
        """The weights setup b starts from."""
        if self.kind != "layer_scale":
            return model
        scale = lambda w: w.at[self.layer].multiply(self.factor)  # noqa: E731
        return eqx.tree_at(lambda m: (m.blocks.attn.wo, m.blocks.mlp.w_down), model, replace_fn=scale)

    def loss_sum(self, loss_sum: Callable, view: Callable) -> Callable:
        """The forward+loss setup b runs; `view` is the layout's model view (for the plain forward)."""
        if self.kind == "shift_labels":
            def shifted(model, batch, z_loss):
                # The layout's own loss fuses forward and labels (a pipeline never exposes logits), so the
                # faulty labels go with the plain forward of the placed model: same weights, same logits.
                logits = view(model)(batch["tokens"], segment_ids=batch.get("segment_ids"))
                mask = batch["mask"].at[:, -1].set(False)  # the wrapped-around last label is not a token
                return next_token_loss_sum(logits, jnp.roll(batch["tokens"], -1, axis=1), mask, z_loss)
            return shifted
        if self.kind == "grad_scale":
            def scaled(model, batch, z_loss):
                return loss_sum(eqx.tree_at(lambda m: _get(m, self.leaf), model, replace_fn=self._scale_grad), batch, z_loss)
            return scaled
        return loss_sum

    def _scale_grad(self, w):
        # Identity forward (bit for bit); the backward multiplies one layer's (or the whole leaf's) cotangent.
        @jax.custom_vjp
        def ident(x):
            return x

        def bwd(_, g):
            return (g * self.factor if self.layer is None else g.at[self.layer].multiply(self.factor),)

        ident.defvjp(lambda x: (x, None), bwd)
        return ident(w)


def _get(model, leaf: str):
    node = model
    for part in leaf.split("."):
        node = getattr(node, part)
    return node


def parse_fault(text: str, model: Llama) -> Fault:
    """`align.fault` -> Fault, checked against `model`; a one-line ConfigError for anything unknown."""
    if not text:
        return Fault("")
    kind, *args = text.split(":")
    try:
        if kind == "layer_scale" and len(args) == 2:
            fault = Fault(kind, "blocks.attn.wo", int(args[0]), float(args[1]))
        elif kind == "shift_labels" and not args:
            return Fault(kind)
        elif kind == "grad_scale" and len(args) in (2, 3):
            fault = Fault(kind, args[0], int(args[1]) if len(args) == 3 else None, float(args[-1]))
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"align.fault={text!r}: the known faults are {KNOWN} (e.g. layer_scale:1:1.05)") from None
    try:
        target = _get(model, fault.leaf)
    except AttributeError:
        target = None
    if not eqx.is_array(target):
        raise ConfigError(f"align.fault={text!r}: the model has no array leaf {fault.leaf!r} (e.g. embed, blocks.mlp.w_up)")
    if fault.layer is not None and not fault.leaf.startswith("blocks."):
        raise ConfigError(f"align.fault={text!r}: {fault.leaf} is not a stacked block leaf; drop the layer (grad_scale:{fault.leaf}:F)")
    if fault.layer is not None and not 0 <= fault.layer < model.cfg.n_layers:
        raise ConfigError(f"align.fault layer {fault.layer} is outside 0..{model.cfg.n_layers - 1}")
    return fault
