"""Gradient checks: automatic differentiation against central finite differences.

For a function `f`, a point `x` and a random unit direction `v` (over every
floating input leaf at once), the directional derivative is estimated by

    fd = (f(x + h v) - f(x - h v)) / 2h         error O(h^2) truncation + O(eps_mach |f| / h) rounding

and compared with both modes of AD:

    JVP   forward mode gives J v directly: it must equal `fd` output by output;
    VJP   reverse mode gives J^T u for a random output cotangent u:
          <J^T u, v> must equal <u, fd>. This is the check that catches a wrong
          backward rule, e.g. a hand-written `jax.custom_vjp`.

JAX cannot run forward mode through a `custom_vjp` function, so for those only
the VJP is checked (the result says so). Checks run in float64 under a scoped
`jax.enable_x64` by default: in float32 the rounding term swamps small
derivatives and only gross errors show. A point where `f` is not
differentiable (a ReLU kink, a max tie) can fail honestly; move the point.

    result = gradcheck(lambda m, x: m(x), layer, x)      # any PyTree inputs, any PyTree output
    assert result.ok, result
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Tolerance:
    eps: float  # finite-difference step along a unit-norm direction
    rtol: float  # allowed |AD - FD| relative to the derivative's size


# Chosen so a correct derivative passes with margin while a wrong one (a missing
# term, a factor) fails: float64 FD is good to ~1e-9 at h=1e-6; float32's
# rounding term (1e-7 / h) forces a large step and a loose tolerance.
TOLERANCES = {
    "float64": Tolerance(eps=1e-6, rtol=1e-6),
    "float32": Tolerance(eps=3e-3, rtol=2e-2),
}


class GradCheckError(AssertionError):
    """AD and finite differences disagree: the message lists each direction's errors."""


@dataclass
class DirectionResult:
    fd_norm: float  # ||(f(x+hv) - f(x-hv)) / 2h||
    jvp_error: float | None  # ||Jv - fd|| / allowed; None when forward mode is unavailable
    vjp_error: float  # |<J^T u, v> - <u, fd>| / allowed

    @property
    def ok(self) -> bool:
        return self.vjp_error <= 1.0 and (self.jvp_error is None or self.jvp_error <= 1.0)


@dataclass
class GradCheckResult:
    name: str
    dtype: str
    tolerance: Tolerance
    directions: list[DirectionResult]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.directions)

    @property
    def worst(self) -> float:
        """Largest error as a fraction of what is allowed (<= 1 passes)."""
        return max(max(d.vjp_error, d.jvp_error or 0.0) for d in self.directions)

    def __str__(self) -> str:
        head = f"gradcheck {self.name}: {'ok' if self.ok else 'FAILED'} ({self.dtype}, eps={self.tolerance.eps:g}, rtol={self.tolerance.rtol:g}; errors are multiples of the allowed error)"
        rows = [
            f"  direction {i}: |fd|={d.fd_norm:.3e}  jvp_error={'n/a' if d.jvp_error is None else f'{d.jvp_error:.3g}'}  vjp_error={d.vjp_error:.3g}"
            for i, d in enumerate(self.directions)
        ]
        return "\n".join([head, *rows, *(f"  note: {n}" for n in self.notes)])


def _flat_output(out, dtype) -> jax.Array:
    """Every floating leaf of the output as one vector (integer outputs have no derivative)."""
    leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        raise ValueError("gradcheck: the function returned no floating-point output to differentiate")
    return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])


def _tree_dot(a, b) -> jax.Array:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _random_unit_direction(rng: np.random.Generator, like, dtype):
    leaves, treedef = jax.tree.flatten(like)
    draws = [rng.standard_normal(np.shape(x)) for x in leaves]
    norm = np.sqrt(sum(float(np.sum(d * d)) for d in draws))
    return jax.tree.unflatten(treedef, [jnp.asarray(d / norm, dtype) for d in draws])


def _forward_mode_unavailable(exc: Exception) -> bool:
    return "custom_vjp" in str(exc)


@partial(jax.jit, static_argnums=(0, 4, 5))
def _evaluate(flat_f, x, V, U, h, with_jvp):
    """f(x +- h v) for every direction v, J v (forward mode) and <J^T u, v> (reverse mode)."""

    # x + hv and x - hv for every direction in one batch: one copy of f in the compiled program, not two.
    both = jax.tree.map(lambda a, d: jnp.concatenate([a + h * d, a - h * d]), x, V)
    values = jax.vmap(flat_f)(both)
    n = U.shape[0]
    jv = jax.vmap(lambda v: jax.jvp(flat_f, (x,), (v,))[1])(V) if with_jvp else None
    _, pullback = jax.vjp(flat_f, x)
    vjp_dots = jax.vmap(lambda u, v: _tree_dot(pullback(u)[0], v))(U, V)
    return values[:n], values[n:], jv, vjp_dots


def gradcheck(
    f: Callable[..., Any],
    *args: Any,
    directions: int = 4,
    seed: int = 0,
    dtype: str = "float64",
    argnums: Sequence[int] | int | None = None,
    eps: float | None = None,
    rtol: float | None = None,
    name: str | None = None,
) -> GradCheckResult:
    """Check `f`'s JVP and VJP at `args` against central differences along random directions.

    Differentiates with respect to every floating array leaf of the arguments in
    `argnums` (default: all); integer leaves (token ids) and static fields pass
    through unchanged. The floating leaves are cast to `dtype`.
    """
    if dtype not in TOLERANCES:
        raise ValueError(f"gradcheck: dtype={dtype!r}; choose one of {sorted(TOLERANCES)}")
    default = TOLERANCES[dtype]
    tol = Tolerance(eps=eps or default.eps, rtol=rtol or default.rtol)
    selected = set(range(len(args))) if argnums is None else {argnums} if isinstance(argnums, int) else set(argnums)
    spec = tuple(eqx.is_inexact_array if i in selected else False for i in range(len(args)))
    name = name or getattr(f, "__name__", "f")
    notes: list[str] = []

    with jax.enable_x64(dtype == "float64"):
        dt = jnp.dtype(dtype)
        diff, static = eqx.partition(args, spec)
        diff = jax.tree.map(lambda x: jnp.asarray(x, dt), diff)
        if not jax.tree.leaves(diff):
            raise ValueError("gradcheck: no floating-point array among the selected arguments to differentiate")

        out_dtypes = {str(jnp.result_type(x)) for x in jax.tree.leaves(jax.eval_shape(lambda d: f(*eqx.combine(d, static)), diff))}
        if any(jnp.finfo(d).bits < jnp.finfo(dt).bits for d in out_dtypes if jnp.issubdtype(d, jnp.inexact)):
            notes.append(f"f returns {sorted(out_dtypes)} for {dtype} inputs: it casts down inside, so FD rounding is that coarse; "
                         f"check with dtype='float32' or let float64 pass through")

        def flat_f(d):
            return _flat_output(f(*eqx.combine(d, static)), dt)

        rng = np.random.default_rng(seed)
        n_out = int(jax.eval_shape(flat_f, diff).size)
        unit = [_random_unit_direction(rng, diff, dt) for _ in range(directions)]
        V = jax.tree.map(lambda *xs: jnp.stack(xs), *unit)  # every direction at once: one compile, not three per check
        U = jnp.asarray(rng.standard_normal((directions, n_out)), dt)
        try:
            plus, minus, jv, vjp_dots = _evaluate(flat_f, diff, V, U, tol.eps, True)
        except TypeError as exc:
            if not _forward_mode_unavailable(exc):
                raise
            notes.append("forward mode is not defined through custom_vjp: checked the VJP only")
            plus, minus, jv, vjp_dots = _evaluate(flat_f, diff, V, U, tol.eps, False)

        finfo_eps = float(jnp.finfo(dt).eps)
        results = []
        for i in range(directions):
            fd = (plus[i] - minus[i]) / (2 * tol.eps)
            fd_norm = float(jnp.linalg.norm(fd))
            # Allowed error: rtol of the derivative's size, plus the rounding FD cannot avoid (a few ulps of f over 2h).
            rounding = 16 * finfo_eps * float(jnp.maximum(jnp.linalg.norm(plus[i]), jnp.linalg.norm(minus[i]))) / (2 * tol.eps)
            jvp_error = None
            if jv is not None:
                allowed = tol.rtol * max(fd_norm, float(jnp.linalg.norm(jv[i]))) + rounding
                jvp_error = float(jnp.linalg.norm(jv[i] - fd)) / max(allowed, 1e-300)
            # <u, e> for a Gaussian u is ~ N(0, |e|^2): allow 4 sigma of the FD error, not |u| |e| (sqrt(n_out) looser).
            allowed = 4.0 * (tol.rtol * fd_norm + rounding)
            vjp_error = abs(float(vjp_dots[i]) - float(jnp.vdot(U[i], fd))) / max(allowed, 1e-300)
            results.append(DirectionResult(fd_norm, jvp_error, vjp_error))

    return GradCheckResult(name, dtype, tol, results, notes)


def assert_gradcheck(f: Callable[..., Any], *args: Any, **kwargs: Any) -> GradCheckResult:
    """`gradcheck`, raising `GradCheckError` (with every direction's errors) when it fails."""
    result = gradcheck(f, *args, **kwargs)
    if not result.ok:
        raise GradCheckError(str(result))
    return result
