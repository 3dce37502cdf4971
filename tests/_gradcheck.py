"""Finite-difference checks of gradients, argument by argument (imports nothing from lineage_jax)."""

import jax
import numpy as np


def directional_derivatives(loss, args, *, h=1e-3, directions=2, seed=0):
    """``loss(args) -> scalar`` for a list of arrays ``args``: its gradient, and for each argument and
    each of ``directions`` random Gaussian directions ``u`` (shaped like that argument alone),
    ``(numeric, analytic)`` directional derivatives. The numeric one is the central difference along
    ``u`` extrapolated from steps ``h`` and ``h/2`` (Richardson: truncation error ``O(h^4)``); the
    analytic one is ``<grad, u>``. One compiled ``value_and_grad`` evaluates both.

    Returns ``(grads, pairs)``: ``grads`` the float64 gradients, ``pairs[i]`` a list of
    ``(numeric, analytic)`` for argument ``i``. With ``|u| ~ sqrt(size)``, ``<grad, u>`` is of the
    order of ``|grad|``: ``|numeric - analytic| / |grad|`` is a relative error.
    """
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    _, grads = value_and_grad(list(args))
    grads = [np.asarray(g, np.float64) for g in grads]
    rng = np.random.default_rng(seed)
    pairs = []
    for i, a in enumerate(args):
        out = []
        for _ in range(directions):
            u = rng.normal(size=a.shape).astype(a.dtype)

            def at(step, i=i, u=u):
                moved = [b + step * u if j == i else b for j, b in enumerate(args)]
                return float(value_and_grad(moved)[0])

            d1 = (at(h) - at(-h)) / (2 * h)
            d2 = (at(h / 2) - at(-h / 2)) / h
            out.append(((4 * d2 - d1) / 3, float(np.sum(grads[i] * np.asarray(u, np.float64)))))
        pairs.append(out)
    return grads, pairs
