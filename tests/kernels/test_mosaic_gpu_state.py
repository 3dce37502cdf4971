"""The Mosaic GPU state passes (:mod:`kernels.delta.mosaic_gpu`).

Compiled on a GPU, in the Mosaic GPU interpreter elsewhere (the CPU), against a float32 ``jnp`` loop of the state
equations (HIGHEST precision): bf16 and f32 inputs, per-key and all-ones decays, three or
more chunks, an initial state, two value blocks. Also: the Triton-lowered state pass of
:mod:`kernels.delta.api` (interpreted or compiled alike) gives the same results for the same arguments; the
kernel lowers for CUDA from this CPU (a Mosaic GPU custom call); bad shapes raise
``ValueError`` naming the argument. The backward state pass likewise (bf16, f32; CUDA export; shapes).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta import api as kd
from kernels.delta import mosaic_gpu as mg

B, H, K, V = 1, 2, 64, 128  # V: two 64-wide value blocks
# Compiled where the kernels' target is the machine's; elsewhere the interpreter. (On a GPU the
# interpreter's own products run at the GPU's default float32 precision, TF32: not the kernel's.)
INTERPRET = jax.default_backend() != "gpu"
pytestmark = [pytest.mark.xdist_group("mosaic_gpu_state")] if INTERPRET else []  # one CPU worker shares the compiles


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def make_inputs(seed, dtype, C, N, decay="key"):
    r = np.random.default_rng(seed)
    T = N * C
    W = r.uniform(-0.3, 0.3, (B, T, H, K))
    U = r.normal(size=(B, T, H, V))
    kout = r.uniform(-0.3, 0.3, (B, T, H, K))
    if decay == "key":
        dend = np.exp(-r.uniform(0.0, 1.0, (B, N, H, K, 1)))
    else:
        dend = np.ones((B, N, H, K, 1))
    h0 = 0.5 * r.normal(size=(B, H, K, V))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(W), cast(U), cast(kout), jnp.asarray(dend, jnp.float32), jnp.asarray(h0, jnp.float32)


def reference(W, U, kout, dend, h0, C):
    """``h`` (states before each chunk), ``Ũ`` and the final state, in float32."""
    hp = jax.lax.Precision.HIGHEST
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    N = W.shape[1] // C
    S, hs, uts = f(h0), [], []
    for n in range(N):
        rows = slice(n * C, (n + 1) * C)
        w, u, k = f(W[:, rows]), f(U[:, rows]), f(kout[:, rows])
        hs.append(S)
        ut = u - jnp.einsum("bchk,bhkv->bchv", w, S, precision=hp)
        S = dend[:, n] * S + jnp.einsum("bchk,bchv->bhkv", k, ut, precision=hp)
        uts.append(ut)
    return jnp.stack(hs, axis=1), jnp.concatenate(uts, axis=1), S


# f32 inputs: products as three bf16 products of hi/lo splits (about 2^-16 relative each), float32
# accumulation — faithful to float32 well within 1e-4. bf16 inputs: S and Ũ are rounded to bf16
# before the matmuls and h, Ũ are stored in bf16 (as in the Triton kernels).
TOL = {"float32": 1e-4, "bfloat16": 1e-2}


@pytest.mark.parametrize("decay", ["key", "ones"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_state_fwd_matches_reference(dtype, decay):
    C, N = 32, 3
    args = make_inputs(0, jnp.dtype(dtype), C, N, decay)
    h, ut, sT = jax.jit(lambda *a: mg.state_fwd(*a, chunk=C, interpret=INTERPRET))(*args)
    rh, rut, rsT = reference(*args, C)
    assert h.shape == (B, N, H, K, V) and h.dtype == jnp.dtype(dtype)
    assert ut.shape == (B, N * C, H, V) and ut.dtype == jnp.dtype(dtype)
    assert sT.shape == (B, H, K, V) and sT.dtype == jnp.float32
    for name, got, want in (("h", h, rh), ("ut", ut, rut), ("final", sT, rsT)):
        err = rel_err(got, want)
        assert err <= TOL[dtype], (name, err)


def test_state_fwd_chunk64_state_dtype():
    """64-token chunks (no row padding of the wgmma tiles), four chunks, f32 states from bf16 inputs."""
    C, N = 64, 4
    args = make_inputs(1, jnp.bfloat16, C, N)
    h, ut, sT = jax.jit(lambda *a: mg.state_fwd(*a, chunk=C, state_dtype=jnp.float32, interpret=INTERPRET))(*args)
    assert h.dtype == jnp.float32
    for got, want in zip((h, ut, sT), reference(*args, C)):
        assert rel_err(got, want) <= TOL["bfloat16"]


def test_state_fwd_matches_triton_state_pass():
    """Same arguments into the Triton-lowered state pass (``api._state_fwd``, interpreted): the same
    results up to float32 rounding."""
    C, N = 32, 3
    W, U, kout, dend, h0 = make_inputs(2, jnp.bfloat16, C, N)
    q = jnp.zeros((B, N * C, H, K), jnp.bfloat16)
    v = jnp.zeros((B, N * C, H, V), jnp.bfloat16)
    # a per-channel gate's spec: the Triton pass then applies d_end (it skips it without gates or resets)
    spec, _ = kd._prepare(q, q, v, jnp.zeros((B, N * C, H, K)), jnp.ones((B, N * C, H), jnp.bfloat16),
                          gate="channel", scale=None, initial_state=None, segment_ids=None, chunk_size=C,
                          target="gpu", interpret=INTERPRET)
    want = kd._state_fwd(spec, W, U, kd._QK(None, kout), dend, h0)
    got = jax.jit(lambda *a: mg.state_fwd(*a, chunk=C, interpret=INTERPRET))(W, U, kout, dend, h0)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        # both round S and Ũ to bf16 before their matmuls and accumulate in f32: interpreted, they agree
        # to f32 rounding (measured: bf16 outputs bit-equal, final state 5e-8); compiled, the tensor
        # cores' accumulation orders differ, so a bf16 output may round the other way (one bf16 ulp)
        assert rel_err(g, w) <= (1e-5 if INTERPRET else 1e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_state_fwd_lowers_for_cuda(dtype):
    """Exported for CUDA from the CPU: one Mosaic GPU custom call (K = V = 128, 32-token chunks)."""
    sd = jax.ShapeDtypeStruct
    dt, C, N, D = jnp.dtype(dtype), 32, 4, 128
    shapes = [sd((2, N * C, 2, D), dt), sd((2, N * C, 2, D), dt), sd((2, N * C, 2, D), dt),
              sd((2, N, 2, D, 1), jnp.float32), sd((2, 2, D, D), jnp.float32)]
    exp = jax.export.export(jax.jit(lambda *a: mg.state_fwd(*a, chunk=C)), platforms=["cuda"])(*shapes)
    text = exp.mlir_module()
    assert re.search(r"custom_call @mosaic_gpu\w*", text), "no Mosaic GPU custom call in the exported module"


def test_state_fwd_bad_shapes():
    C, N = 32, 3
    W, U, kout, dend, h0 = make_inputs(3, jnp.bfloat16, C, N)
    f = mg.state_fwd
    with pytest.raises(ValueError, match="chunk"):
        f(W, U, kout, dend, h0, chunk=48)
    with pytest.raises(ValueError, match="chunk"):
        f(W[:, :-16], U[:, :-16], kout[:, :-16], dend, h0, chunk=C)  # T not a multiple of the chunk
    with pytest.raises(ValueError, match="`W`"):
        f(W[..., :48], U, kout[..., :48], dend[..., :48, :], h0[:, :, :48], chunk=C)  # K = 48
    with pytest.raises(ValueError, match="`U`"):
        f(W, U[..., :96], kout, dend, h0[..., :96], chunk=C)  # V = 96
    with pytest.raises(ValueError, match="`kout`"):
        f(W, U, kout[:, :, :1], dend, h0, chunk=C)
    with pytest.raises(ValueError, match="`dend`"):
        f(W, U, kout, dend[..., 0], h0, chunk=C)
    with pytest.raises(ValueError, match="`h0`"):
        f(W, U, kout, dend, h0[:, :, :, :64], chunk=C)
    with pytest.raises(ValueError, match="`block_v`"):
        f(W, U, kout, dend, h0, chunk=C, block_v=32)


# ----------------------------------------------------------------------------- backward state pass
def bwd_reference(M, do, kout, qin, W, dend, dsT, C):
    """``dh`` (cotangents of the states after each chunk), ``dŨ`` and ``dh0``, in float32."""
    hp = jax.lax.Precision.HIGHEST
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    N = W.shape[1] // C
    dS, dh, dut = f(dsT), [None] * N, [None] * N
    for n in reversed(range(N)):
        rows = slice(n * C, (n + 1) * C)
        m, o, k, q, w = (f(x[:, rows]) for x in (M, do, kout, qin, W))
        dh[n] = dS
        du = jnp.einsum("bthc,bthv->bchv", m, o, precision=hp) + jnp.einsum("bchk,bhkv->bchv", k, dS, precision=hp)
        dS = (jnp.einsum("bchk,bchv->bhkv", q, o, precision=hp) + dend[:, n] * dS
              - jnp.einsum("bchk,bchv->bhkv", w, du, precision=hp))
        dut[n] = du
    return jnp.stack(dh, axis=1), jnp.concatenate(dut, axis=1), dS


def make_bwd_inputs(seed, dtype, C, N):
    r = np.random.default_rng(seed)
    T = N * C
    small = lambda *s: jnp.asarray(r.uniform(-0.3, 0.3, s), dtype)  # noqa: E731
    M = small(B, T, H, C)
    do = jnp.asarray(r.normal(size=(B, T, H, V)), dtype)
    kout, qin, W = small(B, T, H, K), small(B, T, H, K), small(B, T, H, K)
    dend = jnp.asarray(np.exp(-r.uniform(0.0, 1.0, (B, N, H, K, 1))), jnp.float32)
    dsT = jnp.asarray(r.normal(size=(B, H, K, V)), jnp.float32)
    return M, do, kout, qin, W, dend, dsT


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_state_bwd_matches_reference(dtype):
    C, N = 32, 3
    args = make_bwd_inputs(4, jnp.dtype(dtype), C, N)
    dh, dut, dh0 = jax.jit(lambda *a: mg.state_bwd(*a, chunk=C, interpret=INTERPRET))(*args)
    assert dh.shape == (B, N, H, K, V) and dut.shape == (B, N * C, H, V) and dh0.dtype == jnp.float32
    for name, got, want in zip(("dh", "dut", "dh0"), (dh, dut, dh0), bwd_reference(*args, C)):
        err = rel_err(got, want)
        assert err <= TOL[dtype], (name, err)


def test_state_bwd_lowers_for_cuda():
    sd = jax.ShapeDtypeStruct
    bf, C, N, D = jnp.bfloat16, 32, 4, 128
    tok = sd((2, N * C, 2, D), bf)
    shapes = [sd((2, N * C, 2, C), bf), tok, tok, tok, tok, sd((2, N, 2, D, 1), jnp.float32),
              sd((2, 2, D, D), jnp.float32)]
    exp = jax.export.export(jax.jit(lambda *a: mg.state_bwd(*a, chunk=C)), platforms=["cuda"])(*shapes)
    assert re.search(r"custom_call @mosaic_gpu\w*", exp.mlir_module())


def test_state_bwd_bad_shapes():
    C, N = 32, 3
    M, do, kout, qin, W, dend, dsT = make_bwd_inputs(5, jnp.bfloat16, C, N)
    with pytest.raises(ValueError, match="`M`"):
        mg.state_bwd(M[..., :16], do, kout, qin, W, dend, dsT, chunk=C)
    with pytest.raises(ValueError, match="`qin`"):
        mg.state_bwd(M, do, kout, qin[:, :, :1], W, dend, dsT, chunk=C)
    with pytest.raises(ValueError, match="`dsT`"):
        mg.state_bwd(M, do, kout, qin, W, dend, dsT[..., :64], chunk=C)
