"""Tests of the Pallas grouped matmul (``grouped_matmul(impl="pallas")``, run by the Pallas
interpreter on the CPU) against ``jax.lax.ragged_dot``: values and gradients for several
group-size patterns and block sizes, dtypes, zero rows past the groups, zero weight
gradients of empty groups, the "auto" switch, argument errors, and the lowering of every
kernel to Triton IR for a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lineage_jax.layers import grouped as GR
from lineage_jax.layers import grouped_pallas as GP
from tests._jaxpr import live_pallas_calls
from tests._numerics import fp32_matmuls, rel_err  # noqa: F401 (fp32_matmuls: fixture)


pytestmark = pytest.mark.usefixtures("fp32_matmuls")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# (M, K, N, group_sizes, block): block 16 calls GP.gmm with block_k = block_n = 16 (several
# K blocks in the loop, several column blocks); None goes through grouped_matmul (blocks
# shrunk from 128 to the next power of two of K / N). tile = 16 throughout.
CASES = [
    pytest.param(40, 24, 20, [7, 0, 21, 5], 16, id="empty-group-long-group-zero-tail"),
    pytest.param(96, 48, 40, [0, 50, 0, 30, 16], 16, id="several-tiles-per-group"),
    pytest.param(30, 20, 36, [20, 20], 16, id="sizes-sum-past-M"),
    pytest.param(45, 40, 33, [3, 9, 13, 11, 2], None, id="grouped-matmul-odd-shapes"),
    pytest.param(64, 32, 32, [16, 0, 48], None, id="grouped-matmul-multiples"),
]


def make_inputs(seed, m, k, n, sizes, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), dtype)
    c = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), c


def pallas_fn(block):
    if block is None:
        return lambda x, w, gs: GR.grouped_matmul(x, w, gs, impl="pallas", tile=16)
    return lambda x, w, gs: GP.gmm(x, w, gs, tile=16, block_k=block, block_n=block)


def value_and_grads(f, x, w, gs, c):
    loss = lambda x, w: jnp.sum(f(x, w, gs).astype(jnp.float32) * c)
    return (f(x, w, gs),) + jax.grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,k,n,sizes,block", CASES)
def test_pallas_matches_ragged_dot(m, k, n, sizes, block, dtype):
    """Forward values and the gradients of a random linear functional w.r.t. x and w, under
    jit, against ragged_dot on fresh random inputs; rows past the groups and the weight
    gradients of empty groups are exactly zero."""
    x, w, gs, c = make_inputs(7919 * m + 31 * k + n, m, k, n, sizes, dtype)
    run = jax.jit(lambda x, w, gs, c: (value_and_grads(pallas_fn(block), x, w, gs, c),
                                       value_and_grads(jax.lax.ragged_dot, x, w, gs, c)))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = run(x, w, gs, c)
    assert y.dtype == y_ref.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert y.shape == (m, n) and dx.shape == x.shape and dw.shape == w.shape
    for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert rel_err(got, want) < TOL[dtype], name
    used = min(sum(sizes), m)
    np.testing.assert_array_equal(np.asarray(y[used:], np.float32), 0)
    np.testing.assert_array_equal(np.asarray(dx[used:], np.float32), 0)
    for g, size in enumerate(sizes):
        if size == 0:
            np.testing.assert_array_equal(np.asarray(dw[g], np.float32), 0)


def test_new_group_sizes_same_compiled_function():
    """group_sizes are traced: one compiled function serves different groupings, including
    all rows in one group and no rows in any group."""
    x, w, _, _ = make_inputs(3, 48, 24, 20, [0, 0, 0], jnp.float32)
    f = jax.jit(lambda x, w, gs: GP.gmm(x, w, gs, tile=16, block_k=16, block_n=16))
    for sizes in ([10, 0, 25], [0, 48, 0], [0, 0, 0], [1, 1, 1]):
        gs = jnp.asarray(sizes, jnp.int32)
        assert rel_err(f(x, w, gs), jax.lax.ragged_dot(x, w, gs)) < 1e-5, sizes


def test_all_groups_empty_gives_zero_gradients():
    x, w, gs, c = make_inputs(5, 32, 20, 24, [0, 0], jnp.float32)
    y, dx, dw = jax.jit(lambda x, w, gs, c: value_and_grads(pallas_fn(16), x, w, gs, c))(x, w, gs, c)
    for a in (y, dx, dw):
        np.testing.assert_array_equal(np.asarray(a), 0)


def test_mixed_dtypes_follow_ragged_dot():
    x, w, gs, c = make_inputs(6, 40, 24, 20, [12, 0, 20], jnp.float32)
    wb = w.astype(jnp.bfloat16)
    got, want = jax.jit(lambda x, w, gs, c: (value_and_grads(pallas_fn(16), x, w, gs, c),
                                            value_and_grads(jax.lax.ragged_dot, x, w, gs, c)))(x, wb, gs, c)
    assert [a.dtype for a in got] == [a.dtype for a in want]
    for a, b in zip(got, want):
        assert rel_err(a, b) < TOL[jnp.bfloat16]


def test_block_sizes():
    assert GP.block_sizes(40, 20, 16, 16) == (16, 16)
    assert GP.block_sizes(40, 20) == (64, 32)                     # shrunk to the next power of two
    assert GP.block_sizes(1, 3) == (16, 16)                       # never below a Triton dot's 16
    assert GP.block_sizes(1024, 768) == (128, 128)
    assert GP.block_sizes(300, 100, 64, 128) == (64, 128)


def test_auto_switch(monkeypatch):
    """"auto" keeps ragged_dot while its dense expansion is small; above the limit it picks
    "pallas" on a GPU and "tiled" on the CPU."""
    if jax.default_backend() == "tpu":
        pytest.skip("TPU keeps ragged_dot")
    limit = GR.DENSE_EXPANSION_LIMIT_BYTES
    g, n = 8, 64
    m = limit // (g * n * 2)                                       # exactly at the limit in bf16
    assert "pallas" in GR.GROUPED_MATMUL_IMPLS
    assert GR.resolve_impl("pallas", 8, 8, 2, jnp.float32) == "pallas"
    monkeypatch.setattr(GR.jax, "default_backend", lambda: "cpu")
    assert GR.resolve_impl("auto", m, n, g, jnp.bfloat16) == "ragged_dot"
    assert GR.resolve_impl("auto", m + 1, n, g, jnp.bfloat16) == "tiled"
    monkeypatch.setattr(GR.jax, "default_backend", lambda: "gpu")
    assert GR.resolve_impl("auto", m, n, g, jnp.bfloat16) == "ragged_dot"
    assert GR.resolve_impl("auto", m + 1, n, g, jnp.bfloat16) == "pallas"


def test_bad_arguments():
    x, w, gs, _ = make_inputs(8, 32, 16, 16, [16, 16], jnp.float32)
    with pytest.raises(ValueError, match=r"`impl`.*auto.*ragged_dot.*tiled.*pallas"):
        GR.grouped_matmul(x, w, gs, impl="gmm")
    for bad in (8, 24, 0):
        with pytest.raises(ValueError, match="`tile`"):
            GR.grouped_matmul(x, w, gs, impl="pallas", tile=bad)
    with pytest.raises(ValueError, match="`tile`"):
        GP.gmm(x, w, gs, tile=48)
    with pytest.raises(ValueError, match="`block_k`"):
        GP.gmm(x, w, gs, tile=16, block_k=8)
    with pytest.raises(ValueError, match="`block_n`"):
        GP.gmm(x, w, gs, tile=16, block_n=96)


def test_interpreter_inside_shard_map_with_varying_operands_raises():
    x, w, gs, _ = make_inputs(9, 32, 16, 16, [16, 16], jnp.float32)
    mesh = jax.make_mesh((1,), ("e",))
    f = jax.shard_map(lambda x, w, gs: GP.gmm(x, w, gs, tile=16, interpret=True), mesh=mesh,
                      in_specs=(P("e"), P(), P()), out_specs=P("e"))
    with pytest.raises(NotImplementedError, match="`interpret`"):
        f(jax.device_put(x, NamedSharding(mesh, P("e"))), w, gs)


def test_kernels_lower_to_triton():
    """The compiled (non-interpreted) forward and both backward kernels lower to Triton IR
    for a CUDA target, at default blocks with K, N not multiples of 128 (export only; no GPU
    needed)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((300, 200), jnp.bfloat16), sd((3, 200, 136), jnp.bfloat16), sd((3,), jnp.int32))

    def f(x, w, gs):
        loss = lambda x, w: jnp.sum(GP.gmm(x, w, gs, tile=64, interpret=False).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    try:
        exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    except (ImportError, ModuleNotFoundError) as e:  # pragma: no cover
        pytest.skip(f"no Pallas Triton lowering in this jaxlib: {e}")
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 3, "one custom call per kernel"


@pytest.mark.parametrize("policy", ["names", "nothing"])
def test_remat_keeps_the_named_outputs(policy):
    """Under ``jax.checkpoint`` with ``RESIDUALS`` saved (the Decoder's "dots" policy), the experts' MLP
    runs its 3 forward kernels once and 2 backward kernels per matmul (9 launches); saving nothing
    reruns the forward ones (12). The group sizes are a constant closed over by the checkpointed
    function (checked without tracing them)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(40, 32)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(3, 32, 16)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(3, 16, 32)), jnp.float32)
    gs = jnp.array([10, 20, 10], jnp.int32)
    pol = {"names": jax.checkpoint_policies.save_only_these_names(GR.RESIDUALS),
           "nothing": jax.checkpoint_policies.nothing_saveable}[policy]

    def f(x):
        return jnp.sum(jnp.sin(GR.grouped_glu_mlp(x, wg, wu, wd, gs, "swiglu", impl="pallas")))

    jaxpr = jax.make_jaxpr(jax.value_and_grad(jax.checkpoint(f, policy=pol)))(x).jaxpr
    assert live_pallas_calls(jaxpr) == {"names": 9, "nothing": 12}[policy]


# ------------------------------------------------------------ tuned launches, MoE padded path
def test_plan_tuned_and_explicit():
    """The tuned plan pads K, N to multiples of 128 and picks wide blocks only for wide outputs;
    explicit blocks apply to every kernel; stages fit the shared-memory budget for float32."""
    p = GP.plan(2048, 624, 128)
    assert (p.kp, p.np_) == (2048, 640)
    assert p.fwd == GP.Launch(128, 64, 128, 8, 3)                  # output 640 wide
    assert p.dx == GP.Launch(128, 64, 256, 8, 4)                   # output 2048 wide
    assert p.dw == GP.Launch(64, 128, 128, 4, 2)
    q = GP.plan(624, 2048, 128)
    assert q.fwd == GP.Launch(128, 64, 256, 8, 4) and q.dx == GP.Launch(128, 64, 128, 4, 3)
    assert q.dw == GP.Launch(128, 128, 256, 8, 2)
    small = GP.plan(20, 40, 16)
    assert (small.kp, small.np_) == (32, 64) and small.dw.rows == 16
    f32 = GP.plan(2048, 2048, 128, itemsize=4)
    for launch in (f32.fwd, f32.dx):
        assert launch.stages * (launch.rows * launch.a + launch.a * launch.b) * 4 <= GP.GPU_SMEM_BYTES
    assert f32.dw.stages * f32.dw.rows * (f32.dw.a + f32.dw.b) * 4 <= GP.GPU_SMEM_BYTES
    e = GP.plan(40, 20, 16, block_k=16, block_n=16)
    assert (e.kp, e.np_) == (48, 32) and (e.fwd.a, e.fwd.b, e.dx.a, e.dx.b, e.dw.a, e.dw.b) == (16, 16, 16, 16, 16, 16)


def _routed_inputs(seed, n, k, e, w, h, dtype, empty_expert=True):
    rng = np.random.default_rng(seed)
    experts = np.arange(1, e) if empty_expert else np.arange(e)    # expert 0 gets no token
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(n)])
    z = jnp.asarray(rng.normal(size=(n, w)), dtype)
    wts = jnp.asarray(rng.random(size=(n, k)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(e, w, h)) / np.sqrt(w), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(e, h, w)) / np.sqrt(h), jnp.float32)
    c = jnp.asarray(rng.normal(size=(n, w)), jnp.float32)
    return z, jnp.asarray(idx, jnp.int32), wts, wg, wu, wd, c


def _sorted_reference(z, idx, wts, wg, wu, wd, activation):
    """The sorted-rows path (``MoE`` before the padded layout): ragged_dot grouped matmuls."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=wg.shape[0]).astype(jnp.int32)
    out = GR.grouped_glu_mlp(jnp.repeat(z, k, axis=0)[order], wg, wu, wd, sizes, activation, impl="ragged_dot")
    return jnp.einsum("nkw,nk->nw", out[jnp.argsort(order)].reshape(n, k, -1).astype(jnp.float32), wts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("activation,shape", [("swiglu", (37, 3, 5, 24, 20)), ("situ", (50, 2, 4, 40, 33))],
                         ids=["swiglu-W24-H20", "situ-W40-H33"])
def test_routed_experts_match_the_sorted_path(dtype, activation, shape):
    """``routed_experts`` (padded layout end to end) equals sorting + ragged_dot grouped matmuls +
    unsorting: the output and the gradients for the input rows, the combine weights and all three
    expert weights, under jit, on fresh random inputs with an expert that gets no token."""
    n, k, e, w, h = shape
    z, idx, wts, wg, wu, wd, c = _routed_inputs(sum(shape), n, k, e, w, h, dtype)
    new = lambda *a: GP.routed_experts(a[0], idx, *a[1:], activation, tile=16)
    ref = lambda *a: _sorted_reference(a[0], idx, *a[1:], activation)
    args = (z, wts, wg, wu, wd)
    loss = lambda f: (lambda *a: jnp.sum(f(*a) * c))
    got = (jax.jit(new)(*args),) + jax.jit(jax.grad(loss(new), argnums=tuple(range(5))))(*args)
    want = (ref(*args),) + jax.grad(loss(ref), argnums=tuple(range(5)))(*args)
    assert got[0].dtype == jnp.float32 and got[1].dtype == dtype
    for name, a, b in zip(("out", "dz", "dweights", "dw_gate", "dw_up", "dw_down"), got, want):
        assert rel_err(a, b) < TOL[dtype], name
    assert np.all(np.asarray(got[3])[0] == 0) and np.all(np.asarray(got[5])[0] == 0), "the empty expert's grads"


def test_routed_experts_slots():
    """Every assignment has its own slot, inside its expert's tiles; the slot knows it back."""
    z, idx, *_ = _routed_inputs(3, 30, 2, 4, 8, 8, jnp.float32)
    s = GP.slots(idx, 4, 16)
    of, assign, token = np.asarray(s.of), np.asarray(s.assign), np.asarray(s.token)
    assert len(set(of.ravel())) == of.size
    tile_of = of // 16
    np.testing.assert_array_equal(np.asarray(s.tile_group)[tile_of], np.asarray(idx))
    np.testing.assert_array_equal(assign[of], np.arange(of.size).reshape(of.shape))
    np.testing.assert_array_equal(token[of], np.repeat(np.arange(30), 2).reshape(30, 2))
    empty = np.setdiff1d(np.arange(assign.size), of.ravel())
    assert np.all(assign[empty] == of.size) and np.all(token[empty] == 30)


@pytest.mark.parametrize("policy", ["names", "nothing"])
def test_routed_experts_remat_keeps_the_named_outputs(policy):
    """As for ``grouped_glu_mlp``: 3 forward + 6 backward kernels when the named outputs are saved,
    the forward ones rerun when nothing is."""
    z, idx, wts, wg, wu, wd, _ = _routed_inputs(4, 20, 2, 3, 32, 16, jnp.float32, empty_expert=False)
    pol = {"names": jax.checkpoint_policies.save_only_these_names(GR.RESIDUALS),
           "nothing": jax.checkpoint_policies.nothing_saveable}[policy]

    def f(z):
        return jnp.sum(jnp.sin(GP.routed_experts(z, idx, wts, wg, wu, wd, "swiglu", tile=16)))

    jaxpr = jax.make_jaxpr(jax.value_and_grad(jax.checkpoint(f, policy=pol)))(z).jaxpr
    assert live_pallas_calls(jaxpr) == {"names": 9, "nothing": 12}[policy]


def test_routed_experts_lower_to_triton():
    """The padded path's nine kernels (3 forward, 6 backward) lower to Triton IR for a CUDA target
    at the tuned launches (export only; no GPU needed)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((300, 256), jnp.bfloat16), sd((300, 2), jnp.int32), sd((300, 2), jnp.float32),
            sd((4, 256, 136), jnp.float32), sd((4, 256, 136), jnp.float32), sd((4, 136, 256), jnp.float32))

    def f(z, idx, wts, wg, wu, wd):
        loss = lambda *a: jnp.sum(GP.routed_experts(a[0], idx, a[1], *a[2:], "swiglu", interpret=False))
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(z, wts, wg, wu, wd)

    try:
        exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    except (ImportError, ModuleNotFoundError) as e:  # pragma: no cover
        pytest.skip(f"no Pallas Triton lowering in this jaxlib: {e}")
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 9


def test_routed_experts_refuse_mismatched_weights_and_expert_ids():
    """A short weight was zero-padded, a missing expert's weights clamped to another's, an id past E dropped and
    a negative one read as expert 0 — each silently; each is refused by name."""
    z, idx, wts, wg, wu, wd, _ = _routed_inputs(3, 12, 2, 4, 16, 8, jnp.float32)
    run = lambda **kw: GP.routed_experts(**{**dict(z=z, expert_idx=idx, weights=wts, w_gate=wg, w_up=wu,  # noqa: E731
                                                   w_down=wd, activation="swiglu", tile=16), **kw})
    for kw, needle in ((dict(w_gate=wg[:, :8]), "`w_gate` must be"), (dict(w_up=wu[:2]), "`w_up` must be"),
                       (dict(w_down=wd[:, :, :8]), "`w_down` must be"), (dict(expert_idx=idx.at[0, 0].set(4)),
                                                                         r"`expert_idx` must lie in \[0, 4\)"),
                       (dict(expert_idx=idx.at[1, 1].set(-1)), "`expert_idx` must lie"),
                       (dict(expert_idx=idx.astype(jnp.float32)), "`expert_idx` must be integer"),
                       (dict(weights=wts[:, :1]), "`weights` must be"), (dict(z=z[None]), "`z` must be")):
        with pytest.raises(ValueError, match=needle):
            run(**kw)
    assert run().shape == z.shape
