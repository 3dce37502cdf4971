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
    kda = jax.jit(M.kda, static_argnames="backend")  # one program per backend (op by op: one per operation)
    o1, s1 = kda(*args, backend="pallas", **kw)
    o0, s0 = kda(*args, backend="xla", **kw)
    assert rel_err(o1, o0) <= 1e-4 and rel_err(s1, s0) <= 1e-4
    o2, _ = kda(*args, backend="auto", **kw)  # auto: XLA on a CPU, the kernels on a GPU / TPU
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o0 if jax.default_backend() == "cpu" else o1))


def test_backend_errors():
    x = make_inputs(6)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="backend"):
        M.delta_rule(q, k, v, beta, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        M.gated_delta_rule(q, k, v, jnp.asarray(x["gs"]), beta, backend="XLA")
    with pytest.raises(ValueError, match="backend"):
        M.kda(q, k, v, jnp.asarray(x["g"]), beta, backend="pallas", mode="recurrent")


def test_auto_runs_xla_at_a_chunk_size_the_kernels_do_not_take(monkeypatch):
    """On an accelerator "auto" picks the kernels for float32 chunked calls, except at a chunk size they do not
    run (not a power of two >= 16; on GPUs above GPU_MAX_CHUNK), where it runs XLA's form instead of failing."""
    from lineage_jax import _kernels
    opts = M.MemoryOptions(backend="auto", chunk_size=24)
    assert not opts.use_pallas("kda", "chunked", jnp.float32)
    for platform in ("gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
        assert M.MemoryOptions(backend="auto").use_pallas("kda", "chunked", jnp.float32)
        assert M.MemoryOptions(backend="auto", chunk_size=32).use_pallas("kda", "chunked", jnp.float32)
        assert not opts.use_pallas("kda", "chunked", jnp.float32)
        big = M.MemoryOptions(backend="auto", chunk_size=2 * _kernels.GPU_MAX_CHUNK)
        assert big.use_pallas("kda", "chunked", jnp.float32) == (platform == "tpu")
    with pytest.raises(ValueError, match="MemoryOptions: `chunk_size` must be a power of two"):  # asked for
        M.MemoryOptions(backend="pallas", chunk_size=24)


def test_residual_names_agree():
    """The remat policy names the kernels' residuals through lineage_jax.memory (no import cycle)."""
    assert RESIDUALS == DELTA_RESIDUALS


def test_memory_options_are_checked_once_naming_the_argument():
    with pytest.raises(ValueError, match="MemoryOptions: `backend`"):
        M.MemoryOptions(backend="cuda")
    with pytest.raises(ValueError, match="MemoryOptions: `chunk_size` must be a power of two"):
        M.MemoryOptions(backend="pallas", chunk_size=24)  # the kernels' constraint, known up front
    with pytest.raises(ValueError, match="`gate_lower_bound` must be a float in"):
        M.MemoryOptions(gate_lower_bound=-9.0)
    with pytest.raises(ValueError, match="`precision`"):
        M.MemoryOptions(precision="fp32")
    assert M.MemoryOptions(gate_lower_bound=-5).gate_lower_bound == -5.0
    x = make_inputs(6)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="kda: pass either `options` or `chunk_size`"):
        M.kda(q, k, v, jnp.asarray(x["g"]), beta, options=M.MemoryOptions(), chunk_size=16)
    with pytest.raises(ValueError, match="`options` must be a MemoryOptions"):
        M.delta_rule(q, k, v, beta, options={"backend": "xla"})


def test_options_give_what_the_arguments_give():
    """``options=`` is the same call as the separate arguments, for each field it carries."""
    x = make_inputs(7)
    q, k, v, g, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta"))
    kda = jax.jit(M.kda, static_argnames=("backend", "chunk_size", "gate_lower_bound", "options"))
    for kw in (dict(backend="xla", chunk_size=16), dict(backend="pallas", chunk_size=16, gate_lower_bound=-5.0)):
        g_ = jnp.maximum(g, -5.0)
        o1, s1 = kda(q, k, v, g_, beta, **kw)
        o2, s2 = kda(q, k, v, g_, beta, options=M.MemoryOptions(**kw))
        np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
        np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))


def test_model_config_options_reach_every_mixer():
    """ModelConfig.memory_options is built once and is what each fixed-state mixer runs with; a
    bounded KDA gate adds its bound; bad fields are named as the config's."""
    from flax import nnx
    from lineage_jax.models import Decoder, get_config
    cfg = get_config("tiny_k3", memory_backend="xla", chunk_size=32)
    assert cfg.memory_options == M.MemoryOptions(backend="xla", chunk_size=32, precision=cfg.matmul_precision)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # the layers' options; no weights needed
    mixers = [m for _, m in nnx.iter_graph(model) if type(m).__name__ == "MemoryMixer"]
    assert mixers
    for m in mixers:
        want = cfg.memory_options
        if m.rule == "kda" and m.kda_gate == "bounded":
            want = want.replace(gate_lower_bound=-float(m.gate_bound))
        assert m.options == want
    with pytest.raises(ValueError, match="ModelConfig.memory_backend"):
        get_config("tiny_kda", memory_backend="triton")
    with pytest.raises(ValueError, match="ModelConfig.chunk_size: must be a power of two"):
        get_config("tiny_kda", memory_backend="pallas", chunk_size=8)
