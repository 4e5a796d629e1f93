"""Random modules drawn with numpy: JAX's RNG compiles once per shape (~0.3 s each on CPU), which
dominated small tests. The values play the same role as the model's own init."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def random_module(cls, *args, seed: int = 0, std: float = 0.02, norm_noise: float = 0.0):
    """`cls(*args, key)` with N(0, std) weights and norm scales 1 + N(0, norm_noise), built without JAX's RNG."""
    abstract = eqx.filter_eval_shape(cls, *args, jax.random.PRNGKey(0)) if _takes_key(cls) else eqx.filter_eval_shape(cls, *args)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if "norm" in jax.tree_util.keystr(path) or "RMSNorm" == cls.__name__:
            return jnp.asarray(1.0 + norm_noise * rng.standard_normal(leaf.shape), leaf.dtype)
        return jnp.asarray(std * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def _takes_key(cls) -> bool:
    import inspect

    return "key" in inspect.signature(cls.__init__).parameters
