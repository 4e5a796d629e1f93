"""lib/jaxprs.py: nested equations are found, and a scan body counts once per iteration."""

import jax
import jax.numpy as jnp

from lib.jaxprs import equations


def test_nested_equations_count_scan_iterations():
    def f(x):
        inner = jax.jit(lambda a: jnp.sin(a) @ a)  # an inner jit: its equations are nested
        y, _ = jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=5)
        return y @ x

    counts = {}
    for eqn, times in equations(jax.make_jaxpr(f)(jnp.ones((3, 3)))):
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + times
    assert counts["dot_general"] == 5 + 1 and counts["sin"] == 5 and counts["scan"] == 1
