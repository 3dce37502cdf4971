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
