"""Feed-forward blocks: GPT-2's GELU MLP, SwiGLU, and K3's SiTU-GLU.

The gated activations are pure functions of ``(gate, up)`` so dense FFNs and MoE
experts share them (:func:`glu`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineage_jax.layers.common import Dense
from lineage_jax.memory import _validate as V

Array = jax.Array

KINDS = ("gelu", "swiglu", "situ")
SITU_BETA1 = 4.0
SITU_BETA2 = 25.0


def situ(gate: Array, up: Array, beta1: float = SITU_BETA1, beta2: float = SITU_BETA2) -> Array:
    """SiTU-GLU: ``[β1·tanh(g/β1) ⊙ σ(g)] ⊙ [β2·tanh(u/β2)]``, in float32.

    Both halves are soft-clamped, so ``|out| < β1 · β2`` for any input.
    """
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    out = (beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g)) * (beta2 * jnp.tanh(u / beta2))
    return out.astype(gate.dtype)


def swiglu(gate: Array, up: Array) -> Array:
    return jax.nn.silu(gate) * up


def glu(kind: str, gate: Array, up: Array) -> Array:
    """The gated activation named ``kind`` ("swiglu" or "situ")."""
    if kind == "swiglu":
        return swiglu(gate, up)
    if kind == "situ":
        return situ(gate, up)
    raise ValueError(f"glu: `kind` must be 'swiglu' or 'situ', got {kind!r}")


class MLP(nnx.Module):
    """``kind="gelu"``: ``W2 gelu(W1 x + b1) + b2`` (GPT-2, biases on);
    ``"swiglu"`` / ``"situ"``: ``W_down glu(W_gate x, W_up x)`` (no biases)."""

    def __init__(self, d_model: int, hidden: int, *, kind: str = "swiglu", rngs: nnx.Rngs,
                 use_bias: bool | None = None, out_std: float | None = None):
        if kind not in KINDS:
            raise ValueError(f"MLP: `kind` must be one of {KINDS}, got {kind!r}")
        V.require_positive_int("MLP", "d_model", d_model)
        V.require_positive_int("MLP", "hidden", hidden)
        V.require_bool("MLP", "use_bias", use_bias, allow_none=True,
                       none_means="the kind's default: biases with 'gelu' only")
        self.kind, self.d_model = kind, d_model
        bias = (kind == "gelu") if use_bias is None else use_bias
        if kind == "gelu":
            self.up = Dense(d_model, hidden, axes=("embed", "mlp"), use_bias=bias, rngs=rngs, std=0.02)
            self.gate = None
        else:
            self.gate = Dense(d_model, hidden, axes=("embed", "mlp"), use_bias=bias, rngs=rngs)
            self.up = Dense(d_model, hidden, axes=("embed", "mlp"), use_bias=bias, rngs=rngs)
        self.down = Dense(hidden, d_model, axes=("mlp", "embed"), use_bias=bias, rngs=rngs,
                          std=out_std if out_std is not None else (0.02 if kind == "gelu" else hidden ** -0.5))

    def __call__(self, x: Array) -> Array:
        """``x [..., D]`` (any leading axes) -> ``[..., D]``."""
        if np.ndim(x) < 1 or V.shape_of(x)[-1] != self.d_model:
            raise ValueError(f"MLP: `x` must have shape [..., D] with D={self.d_model}, got {V.shape_of(x)}")
        V.require_float("MLP", "x", x)
        if self.kind == "gelu":
            return self.down(jax.nn.gelu(self.up(x), approximate=True))
        return self.down(glu(self.kind, self.gate(x), self.up(x)))
