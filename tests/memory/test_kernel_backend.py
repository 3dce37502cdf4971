"""memory's ``backend`` reaches kernels.delta: the Pallas path through the rule functions equals the
XLA chunked form, ``auto`` picks per backend, bad backends are refused, residual names agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta.api import RESIDUALS
from lineage_jax import memory as M
from lineage_jax.memory.rules import DELTA_RESIDUALS
from tests.kernels.test_delta_kernels import make_inputs, rel_err


def test_backend_pallas_matches_xla_through_rules():
    x = make_inputs(5)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=jnp.asarray(x["S0"]), segment_ids=jnp.asarray(x["seg"]))
    o1, s1 = M.kda(*args, backend="pallas", **kw)
    o0, s0 = M.kda(*args, backend="xla", **kw)
    assert rel_err(o1, o0) <= 1e-4 and rel_err(s1, s0) <= 1e-4
    o2, _ = M.kda(*args, backend="auto", **kw)  # auto: XLA on a CPU, the kernels on a GPU / TPU
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o0 if jax.default_backend() == "cpu" else o1))


def test_backend_errors():
    x = make_inputs(6)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="backend"):
        M.delta_rule(q, k, v, beta, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        M.gated_delta_rule(q, k, v, jnp.asarray(x["gs"]), beta, backend=None)
    with pytest.raises(ValueError, match="backend"):
        M.kda(q, k, v, jnp.asarray(x["g"]), beta, backend="pallas", mode="recurrent")


def test_residual_names_agree():
    """The remat policy names the kernels' residuals through lineage_jax.memory (no import cycle)."""
    assert RESIDUALS == DELTA_RESIDUALS
