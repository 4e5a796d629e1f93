"""Walking a traced program: every equation of a jaxpr and of the jaxprs nested in it.

Used to count what a step really runs (the benchmark's matmul floor) and to check
what it holds in memory (the fused loss never builds all logits at once).
"""

from __future__ import annotations

from typing import Iterator

from jax.extend.core import JaxprEqn


def equations(jaxpr, times: int = 1) -> Iterator[tuple[JaxprEqn, int]]:
    """(equation, runs per call of `jaxpr`) for every equation, nested ones included: scan bodies,
    custom-VJP rules, inner jits. A scan body counts once per iteration."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr or a Jaxpr
    for eqn in jaxpr.eqns:
        yield eqn, times
        inner_times = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    yield from equations(sub, inner_times)
