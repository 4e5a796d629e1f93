"""The seed exercise: one gradient step on a linear regression lowers the loss.

    python -m recipes.linear_regression

Everything JAX is about, in thirty lines: a pure model with explicit
parameters, an MSE loss, `jax.value_and_grad` to differentiate it, `jax.vmap`
to lift a one-example model to a batch, `jax.jit` to compile, and a
`jax.tree.map` SGD step over the parameter PyTree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lib.loss import mse


def predict_one(params: dict, x: jax.Array) -> jax.Array:
    return jnp.dot(params["w"], x) + params["b"]


def loss_fn(params: dict, xs: jax.Array, ys: jax.Array) -> jax.Array:
    preds = jax.vmap(predict_one, in_axes=(None, 0))(params, xs)  # batch the one-example model
    return mse(preds, ys)


@jax.jit
def sgd_step(params: dict, xs: jax.Array, ys: jax.Array, lr: float = 0.1):
    loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


def seed_data():
    """The seed text's data: y = 2x, with the weight deliberately started wrong."""
    xs = jnp.array([[1.0], [2.0], [3.0], [4.0]])
    ys = jnp.array([2.0, 4.0, 6.0, 8.0])
    return xs, ys


def main(lr: float = 0.01) -> tuple[float, float]:
    xs, ys = seed_data()
    params = {"w": jnp.array([0.5]), "b": jnp.zeros(())}
    initial_loss = loss_fn(params, xs, ys)
    print(f"initial w = {params['w']}, initial loss = {initial_loss}")
    grads = jax.grad(loss_fn)(params, xs, ys)
    print(f"gradient dL/dw = {grads['w']}, dL/db = {grads['b']}")
    params, _ = sgd_step(params, xs, ys, lr)
    new_loss = loss_fn(params, xs, ys)
    print(f"updated w = {params['w']}, updated loss = {new_loss}")
    print(f"loss decreased: {bool(new_loss < initial_loss)}")
    return float(initial_loss), float(new_loss)


if __name__ == "__main__":
    main()
