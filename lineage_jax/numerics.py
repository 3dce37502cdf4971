"""What float32 means on each backend: the library's matmul-precision policy.

Every matmul in ``lineage_jax`` (projections, the memory rules' XLA forms, fused attention on
the XLA path, MLA's absorbed products) runs at the precision in force — JAX's
``jax.default_matmul_precision`` — and :class:`~lineage_jax.models.ModelConfig` sets it per model
with ``matmul_precision``:

==============  ===========================  ==========================  =========================
name            CPU                          GPU (float32 operands)      TPU (float32 operands)
==============  ===========================  ==========================  =========================
``"default"``   float32                      TF32 (10-bit mantissa)      one bf16 pass
``"high"``      float32                      TF32                        three bf16 passes
``"highest"``   float32                      float32                     six bf16 passes (float32)
==============  ===========================  ==========================  =========================

``"default"`` is what flash-linear-attention (TF32 ``tl.dot``) and MaxText (``matmul_precision:
default``) train with; relative errors are ~1e-3 per product on a GPU instead of ~1e-7.
``"highest"`` gives float32 products everywhere (slower on accelerators). bfloat16 operands
are unaffected (one bf16 MMA, float32 accumulation).

Three things do not follow the policy, by design:

* the gate prefix sums of the chunked forms (``memory.core.prefix_sum``) always run at
  float32 precision — a decay is ``exp`` of a sum, and TF32 sums would move it;
* the Pallas delta-rule kernels keep float32 inputs float32-accurate on every backend (six
  bf16 MMAs on GPU, ``HIGHEST`` on TPU) and run bf16 inputs as bf16;
* cuDNN / Pallas flash attention compute in the dtype of their inputs.

The library's custom backward rules (blockwise attention, the tiled grouped matmul) run at the
precision in force where their forward ran (:func:`precision_in_force`), so a model's
``matmul_precision`` reaches its backward pass wherever ``grad`` is called.
"""

from __future__ import annotations

import contextlib

import jax

MATMUL_PRECISIONS = ("default", "high", "highest")


def check_matmul_precision(name: str, arg: str = "matmul_precision") -> str:
    if name not in MATMUL_PRECISIONS:
        raise ValueError(f"`{arg}` must be one of {MATMUL_PRECISIONS}, got {name!r}")
    return name


def matmul_precision(name: str):
    """A context in which matmuls with no explicit precision run at ``name`` (one of
    :data:`MATMUL_PRECISIONS`). ``"default"`` leaves whatever precision is already in force
    (so an enclosing ``jax.default_matmul_precision`` of the caller still applies)."""
    check_matmul_precision(name)
    if name == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(name)


def precision_in_force() -> "str | None":
    """The matmul precision in force where this is called (``jax.default_matmul_precision``'s
    setting; ``None``: the backend's default) — for a custom VJP to capture in its forward and
    re-enter in its backward (:func:`at_precision`): JAX traces a backward rule when ``grad``
    transposes, after the forward's context has closed."""
    return jax.config.jax_default_matmul_precision


def at_precision(name: "str | None"):
    """A context running matmuls with no explicit precision at ``name`` (a value of
    :func:`precision_in_force`; ``None`` leaves the one in force)."""
    return contextlib.nullcontext() if name is None else jax.default_matmul_precision(name)
