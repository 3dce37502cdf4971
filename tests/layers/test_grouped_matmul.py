"""Tests of the grouped matmul behind the MoE experts: the tiled path against
``jax.lax.ragged_dot`` (values, gradients, jit, zero rows past the groups), the "auto"
choice, the MoE layer with either implementation, a compile-only memory check, and
argument errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers import grouped as GR
from lineage_jax.layers import moe as M
from lineage_jax.parallel import expert as EP
from lineage_jax.parallel.mesh import make_mesh
from tests._numerics import fp32_matmuls, rel_err  # noqa: F401 (fp32_matmuls: fixture)


pytestmark = pytest.mark.usefixtures("fp32_matmuls")


# (M, K, N, group_sizes, tile)
CASES = [
    pytest.param(37, 8, 5, [3, 0, 10, 7, 0], 4, id="empty-groups-and-zero-tail"),
    pytest.param(40, 16, 6, [0, 40, 0], 8, id="one-group-holds-all"),
    pytest.param(45, 12, 7, [5, 9, 13, 11, 7], 4, id="sizes-not-multiples-of-tile"),
    pytest.param(30, 8, 9, [4, 11, 2], 128, id="tile-larger-than-M"),
    pytest.param(12, 6, 4, [8, 8], 4, id="sizes-sum-past-M"),
    pytest.param(300, 32, 24, [50, 0, 100, 70, 1, 0, 64], 16, id="larger"),
]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_inputs(seed, m, k, n, sizes, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,k,n,sizes,tile", CASES)
def test_tiled_matches_ragged_dot(m, k, n, sizes, tile, dtype):
    """Forward values (zero rows past the groups, as ragged_dot) and the gradients of a
    random linear functional w.r.t. x and w, all under jax.jit."""
    x, w, gs = make_inputs(1000 * m + k, m, k, n, sizes, dtype)
    c = jnp.asarray(np.random.default_rng(m).normal(size=(m, n)), jnp.float32)

    @jax.jit
    def run(x, w, gs):
        outs = {}
        for impl in ("tiled", "ragged_dot"):
            f = lambda x, w: GR.grouped_matmul(x, w, gs, impl=impl, tile=tile)
            loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * c)
            outs[impl] = (f(x, w),) + jax.grad(loss, argnums=(0, 1))(x, w)
        return outs

    outs = run(x, w, gs)
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = outs["tiled"], outs["ragged_dot"]
    assert y.dtype == y_ref.dtype == dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    chex.assert_shape(y, (m, n))
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert rel_err(got, want) < TOL[dtype]
    used = min(sum(sizes), m)
    np.testing.assert_array_equal(np.asarray(y[used:], np.float32), 0)       # rows past the groups: 0
    np.testing.assert_array_equal(np.asarray(y_ref[used:], np.float32), 0)   # as ragged_dot does
    np.testing.assert_array_equal(np.asarray(dx[used:], np.float32), 0)
    # dw against float64: each group's own rows only; rows past the groups contribute nothing.
    xs, cs = np.asarray(x, np.float64), np.asarray(c, np.float64)
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    dw_np = np.stack([xs[s:e].T @ cs[s:e] for s, e in zip(starts, ends)])
    assert rel_err(dw, dw_np) < TOL[dtype]


def test_jit_and_mixed_dtypes():
    x, w, gs = make_inputs(3, 50, 8, 6, [10, 0, 25, 10], jnp.float32)
    f = jax.jit(lambda x, w, gs: GR.grouped_matmul(x, w, gs, impl="tiled", tile=8))
    assert rel_err(f(x, w, gs), jax.lax.ragged_dot(x, w, gs)) < 1e-5
    gs2 = jnp.asarray([0, 50, 0, 0], jnp.int32)                  # new sizes, same compiled function
    assert rel_err(f(x, w, gs2), jax.lax.ragged_dot(x, w, gs2)) < 1e-5
    wb = w.astype(jnp.bfloat16)                                    # output dtype follows ragged_dot's
    got = GR.grouped_matmul(x, wb, gs, impl="tiled", tile=8)
    want = jax.lax.ragged_dot(x, wb, gs)
    assert got.dtype == want.dtype
    assert rel_err(got, want) < 1e-5


def test_auto_choice(monkeypatch):
    assert GR.resolve_impl("tiled", 8, 8, 2, jnp.float32) == "tiled"
    assert GR.resolve_impl("ragged_dot", 10**6, 10**4, 64, jnp.float32) == "ragged_dot"
    if jax.default_backend() == "tpu":
        assert GR.resolve_impl("auto", 10**6, 10**4, 64, jnp.bfloat16) == "ragged_dot"
        return
    limit = GR.DENSE_EXPANSION_LIMIT_BYTES
    g, n = 8, 64
    m = limit // (g * n * 2)                                       # exactly at the limit in bf16
    big = "pallas" if jax.default_backend() == "gpu" else "tiled"  # past the limit: GPUs take the kernel
    assert GR.resolve_impl("auto", m, n, g, jnp.bfloat16) == "ragged_dot"
    assert GR.resolve_impl("auto", m + 1, n, g, jnp.bfloat16) == big
    assert GR.resolve_impl("auto", m, n, g, jnp.float32) == big         # 4-byte output: twice the bytes
    # "auto" really dispatches on it: force the path past the limit with a tiny limit.
    calls = []
    spy = lambda *a, **kw: calls.append(1) or jax.lax.ragged_dot(*a[:3])  # noqa: E731
    monkeypatch.setattr(GR, "gmm" if big == "pallas" else "_tiled", spy)
    x, w, gs = make_inputs(4, 16, 4, 4, [8, 8], jnp.float32)
    GR.grouped_matmul(x, w, gs)
    assert not calls
    monkeypatch.setattr(GR, "DENSE_EXPANSION_LIMIT_BYTES", 0)
    GR.grouped_matmul(x, w, gs)
    assert calls == [1]


# ----------------------------------------------------------------------------- MoE layer
def test_moe_tiled_equals_ragged_dot():
    """The MoE layer (latent experts + a shared expert), single-device and expert-parallel
    (one-device mesh: the shard_map path through ``_local_experts``), forced to the tiled
    grouped matmul, against ``matmul_impl="ragged_dot"``: output and all gradients."""
    d, e, k, h = 16, 8, 2, 12
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 24, d)), jnp.float32)
    kw = dict(num_experts=e, top_k=k, expert_hidden=h, num_shared_experts=1, latent_dim=6)
    ref = M.MoE(d, matmul_impl="ragged_dot", rngs=nnx.Rngs(0), **kw)
    tiled = M.MoE(d, matmul_impl="tiled", rngs=nnx.Rngs(0), **kw)
    assert tiled.matmul_impl == "tiled"
    ep = EP.ExpertParallel(make_mesh("expert=1"), impl="dense")

    def run(model, x):
        def loss(m, x, parallel):
            y = EP.moe_forward(m, x, ep)[0] if parallel else m(x)[0]
            return jnp.sum(y * jnp.sin(jnp.arange(y.size).reshape(y.shape))), y
        return [nnx.grad(loss, argnums=(0, 1), has_aux=True)(model, x, p) for p in (False, True)]

    results = nnx.jit(lambda a, b, x: (run(a, x), run(b, x)))(ref, tiled, x)
    (((gm_ref, gx_ref), y_ref), _), runs = results[0], results[1]
    for (gm, gx), y in runs:
        assert rel_err(y, y_ref) < 1e-5
        assert rel_err(gx, gx_ref) < 1e-5
        for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(gm, nnx.Param)),
                                     nnx.to_flat_state(nnx.state(gm_ref, nnx.Param))):
            assert rel_err(a[...], b[...]) < 1e-5, path


def test_moe_rejects_bad_matmul_impl():
    with pytest.raises(ValueError, match="matmul_impl"):
        M.MoE(8, num_experts=4, top_k=2, expert_hidden=6, matmul_impl="dense", rngs=nnx.Rngs(0))


# ------------------------------------------------------------------------------- memory
def test_tiled_gradient_memory_is_not_dense():
    """Compile only: the grad of ragged_dot on XLA:CPU/GPU holds [G, M, N]-sized temporaries,
    the tiled one does not (about 56x less here: 14 GiB vs 0.25 GiB on jax 0.10.2 CPU)."""
    if jax.default_backend() == "tpu":
        pytest.skip("TPU lowers ragged_dot natively")
    m, k, n, g = 65536, 256, 256, 64
    dense = g * m * n * 2                                          # one bf16 [G, M, N]: 2 GiB
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((g,), jnp.int32))

    def temp_bytes(impl):
        f = lambda x, w, gs: jnp.sum(GR.grouped_matmul(x, w, gs, impl=impl).astype(jnp.float32))
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).trace(*args).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    tiled, ragged = temp_bytes("tiled"), temp_bytes("ragged_dot")
    assert ragged > dense, (ragged, dense)
    assert tiled < dense / 4, (tiled, dense)
    assert ragged > 20 * tiled, (ragged, tiled)


# ------------------------------------------------------------------------------- errors
def test_bad_arguments():
    x, w, gs = make_inputs(6, 10, 4, 3, [5, 5], jnp.float32)
    with pytest.raises(ValueError, match=r"impl.*auto.*ragged_dot.*tiled"):
        GR.grouped_matmul(x, w, gs, impl="dense")
    for bad in (0, -4, 2.0, True, "8"):
        with pytest.raises(ValueError, match="tile"):
            GR.grouped_matmul(x, w, gs, impl="tiled", tile=bad)
    with pytest.raises(ValueError, match="`x`"):
        GR.grouped_matmul(x[None], w, gs)
    with pytest.raises(ValueError, match="`w`"):
        GR.grouped_matmul(x, w[0], gs)
    with pytest.raises(ValueError, match="contraction"):
        GR.grouped_matmul(x, w[:, :3], gs)
    with pytest.raises(ValueError, match="group_sizes"):
        GR.grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="group_sizes"):
        GR.grouped_matmul(x, w, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="group_sizes.*>= 0"):
        GR.grouped_matmul(x, w, jnp.asarray([7, -2], jnp.int32), impl="tiled")


def test_integer_inputs_zero_columns_and_huge_group_sizes():
    """Integer ``x`` / ``w`` are refused (the kernels accumulate in float32: 2**24 + 1 came back as 2**24);
    ``N = 0`` gives ``[M, 0]`` (the tiled form divided by zero); group sizes near 2**31 (legal: sizes may sum
    past ``M``) give numpy's product (their padded sums overflowed int32)."""
    x, w, gs = make_inputs(6, 10, 4, 3, [5, 5], jnp.float32)
    for impl in ("tiled", "pallas"):
        with pytest.raises(ValueError, match="`x` must be floating"):
            GR.grouped_matmul(x.astype(jnp.int32), w, gs, impl=impl)
        with pytest.raises(ValueError, match="`w` must be floating"):
            GR.grouped_matmul(x, w.astype(jnp.int32), gs, impl=impl)
        assert GR.grouped_matmul(x, w[:, :, :0], gs, impl=impl, tile=16).shape == (x.shape[0], 0)
    r = np.random.default_rng(0)
    xs, ws = r.normal(size=(8, 4)).astype(np.float32), r.normal(size=(2, 4, 3)).astype(np.float32)
    for sizes, want in (([5, 2**31 - 1], np.concatenate([xs[:5] @ ws[0], xs[5:] @ ws[1]])),
                        ([2**31 - 1, 5], xs @ ws[0])):
        for impl in ("tiled", "pallas"):
            got = GR.grouped_matmul(xs, ws, jnp.asarray(sizes, jnp.int32), impl=impl, tile=16)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=f"{impl} {sizes}")


def test_pallas_on_a_tpu_is_refused_by_name(monkeypatch):
    """The grouped-matmul kernels are Triton's: on a TPU ``impl="pallas"`` is refused naming the argument (the
    Mosaic lowering failed on them with a bare AssertionError); ``"auto"`` there is ``ragged_dot``."""
    from lineage_jax.layers import grouped

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    x, w, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([5, 3], jnp.int32)
    with pytest.raises(ValueError, match=r"`impl`='pallas' runs Triton kernels.*TPU"):
        grouped.grouped_matmul(x, w, gs, impl="pallas")
    assert grouped.resolve_impl("auto", 8, 3, 2, jnp.float32) == "ragged_dot"
