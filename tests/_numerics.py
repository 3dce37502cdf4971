"""Numerical helpers shared by test modules."""

import jax
import numpy as np
import pytest


def rel_err(a, b) -> float:
    """Max absolute difference relative to the reference's max magnitude (float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture
def fp32_matmuls():
    """True float32 matmuls, so fp32-rounding tolerances also hold on GPUs (TF32 by default).
    Use with ``pytestmark = pytest.mark.usefixtures("fp32_matmuls")`` after importing it."""
    with jax.default_matmul_precision("highest"):
        yield


def precision_in_force() -> str:
    """The float32 matmul precision in force: "highest" (float32 products), "high" or "default"."""
    p = jax.config.jax_default_matmul_precision
    p = "default" if p is None else str(p).lower()
    return {"float32": "highest", "tensorfloat32": "high", "bfloat16_3x": "high", "bfloat16": "default",
            "fastest": "default"}.get(p, p)


# Relative error of one float32 product, by backend and precision (what a comparison can hold).
_PRODUCT_ERROR = {("gpu", "default"): 1e-3, ("gpu", "high"): 1e-3,  # TF32: 10-bit mantissa
                  ("tpu", "default"): 8e-3, ("tpu", "high"): 1e-5}   # one / three bf16 passes


def tolerance(cpu: float, *, backend: str = None, precision: str = None, kernels: bool = False) -> float:
    """The tolerance of a float32 comparison: ``cpu`` (the CPU suite's own) on a CPU or at
    precision "highest"; on an accelerator at a lower precision, ``cpu`` widened to what
    that precision's products can hold (x5 for a few products in a row).

    ``kernels``: the compared path runs the compiled delta-rule kernels, whose float32 products
    on a GPU are six bf16 MMAs — float32-accurate, not float32-rounded: x10 on a GPU."""
    backend = backend or jax.default_backend()
    precision = precision or precision_in_force()
    if backend == "cpu":
        return cpu
    if precision == "highest":
        return 10 * cpu if kernels and backend == "gpu" else cpu
    return max(cpu, 5 * _PRODUCT_ERROR.get((backend, precision), 1e-3))
