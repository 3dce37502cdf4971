"""Fused softmax attention: every ``impl`` against the float64 reference, forward and every gradient, causal and
bidirectional."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax import memory as M
from lineage_jax.memory import fused
from tests.memory import naive

ON_GPU = jax.default_backend() == "gpu"
IMPLS = ["xla", "pallas"] + (["cudnn"] if ON_GPU else [])


def _inputs(seed, B, T, H, Hk, K, Vd, dtype, segments):
    r = np.random.default_rng(seed)
    q, k, v, do = (r.normal(size=s).astype(np.float32) for s in
                   ((B, T, H, K), (B, T, Hk, K), (B, T, Hk, Vd), (B, T, H, Vd)))
    seg = np.cumsum(r.random((B, T)) < 0.08, axis=1).astype(np.int32) if segments else None
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v, do)), seg


def _grads(fn, q, k, v, do):
    """Gradients of ``sum(fn(q, k, v) * do)``, jitted (op by op every operation compiles on its own)."""
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)),
                            argnums=(0, 1, 2)))(q, k, v)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _jnp_attention(q, k, v, causal, segment_ids):
    """Whole-matrix softmax attention written out here (grouped heads; causal and document masks, a
    document starting where the segment id changes), differentiable for the gradient references."""
    B, T, H, K = q.shape
    group = H // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bthk,bshk->bhts", q, k) * K ** -0.5
    visible = np.ones((B, 1, T, T), bool)
    if causal:
        visible &= np.tril(np.ones((T, T), bool))
    if segment_ids is not None:
        doc = np.cumsum(naive._resets(segment_ids, B, T), axis=1)
        visible &= doc[:, None, :, None] == doc[:, None, None, :]
    p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshv->bthv", p, v)


CASES = [  # (B, T, H, Hk, K, V): GQA, MLA-like unequal widths, odd T, T past one key block
    (2, 37, 4, 2, 16, 16),
    (1, 45, 2, 2, 24, 16),
    (2, 600, 2, 1, 16, 8),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("segments", [False, True], ids=["whole", "packed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_impl_matches_reference_forward_and_grads(impl, case, dtype, segments, causal):
    if impl == "cudnn" and dtype == jnp.float32:
        pytest.skip("cuDNN's flash attention takes bf16/fp16 only (an f32 call is refused: see the next test)")
    if impl == "pallas" and case[1] > 100 and not ON_GPU:
        pytest.skip("interpret mode at T=600 is slow on the CPU; the smaller cases cover the kernel's logic")
    B, T, H, Hk, K, Vd = case
    (q, k, v, do), seg = _inputs(hash((case, segments, causal)) % 2**31, B, T, H, Hk, K, Vd, dtype, segments)
    f = lambda q, k, v: M.softmax_attention(q, k, v, causal=causal, segment_ids=seg, impl=impl)
    up = lambda a: a.astype(jnp.float64) if jax.config.jax_enable_x64 else a.astype(jnp.float32)
    want = naive.softmax_attention(*(np.asarray(up(a)) for a in (q, k, v)), causal=causal, segment_ids=seg)
    # float32 holds float32 tolerances on every backend (the suite runs at precision "highest"),
    # except JAX's Triton flash kernel, whose dots take their own (TF32) precision on a GPU.
    own_precision = ON_GPU and impl == "pallas"
    tol = 2e-5 if dtype == jnp.float32 and not own_precision else 1.5e-2
    got = jax.jit(f)(q, k, v)
    assert got.dtype == dtype and got.shape == (B, T, H, Vd)
    assert _rel(got, want) < tol
    ref = lambda q, k, v: _jnp_attention(q, k, v, causal, seg)
    for g, w in zip(_grads(f, q, k, v, do), _grads(ref, up(q), up(k), up(v), up(do))):
        assert g.dtype == dtype
        assert _rel(g, w) < (tol if dtype == jnp.bfloat16 else 5e-5 if not own_precision else 1.5e-2)


@pytest.mark.gpu(reason="cuDNN flash attention")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("T", [1, 50, 129])
def test_cudnn_takes_any_sequence_length(causal, T):
    """cuDNN trains on multiples of 64 tokens only; other lengths are padded, the padding a
    document of its own that no real query sees (also without a causal mask)."""
    (q, k, v, do), seg = _inputs(T, 2, T, 4, 2, 64, 64, jnp.bfloat16, T > 1)
    f = lambda q, k, v: M.softmax_attention(q, k, v, causal=causal, segment_ids=seg, impl="cudnn")
    ref = lambda q, k, v: _jnp_attention(q, k, v, causal, seg)
    up = lambda a: a.astype(jnp.float32)
    assert _rel(f(q, k, v), ref(up(q), up(k), up(v))) < 1.5e-2
    for g, w in zip(_grads(f, q, k, v, do), _grads(ref, up(q), up(k), up(v), up(do))):
        if T == 1 and not np.any(w):  # one key: the softmax is constant, dq = dk = 0 exactly
            assert np.max(np.abs(np.asarray(g, np.float32))) < 1e-5
        else:
            assert _rel(g, w) < 1.5e-2


def test_blockwise_keeps_no_full_score_matrix():
    """The XLA form's compiled gradient holds blocks of keys, never a ``[B, H, T, T]`` float32 array."""
    B, T, H, K = 1, 8192, 2, 16
    q = jnp.ones((B, T, H, K), jnp.bfloat16)
    g = jax.jit(jax.grad(lambda q: jnp.sum(M.softmax_attention(q, q, q, impl="xla").astype(jnp.float32))))
    text = g.lower(q).as_text()
    assert f"{T}x{T}" not in text.replace(",", "x")
    full = g.lower(q).compile().memory_analysis()
    if full is not None:
        assert full.temp_size_in_bytes < B * H * T * T * 4 / 2


def test_fully_masked_rows_read_zero_not_nan():
    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.normal(size=s), jnp.float32) for s in ((1, 4, 1, 8), (1, 6, 1, 8), (1, 6, 1, 8)))
    # Queries 2, 3 are in document 1, which no key belongs to: they see nothing and read zeros.
    o = fused.blockwise_attention(q, k[:, :4], v[:, :4], scale=1.0, causal=True, doc_q=jnp.array([[0, 0, 1, 1]]),
                                  doc_k=jnp.array([[0, 0, 2, 2]]))
    assert np.all(np.isfinite(np.asarray(o)))
    assert np.all(np.asarray(o)[:, 2:] == 0)
    # Queries 0, 1 see the causal keys of document 0 only.
    want = naive.softmax_attention(q[:, :2], k[:, :2], v[:, :2], scale=1.0)
    np.testing.assert_allclose(np.asarray(o)[:, :2], want, rtol=1e-5, atol=1e-6)
    # Non-causal, no segments, more keys than queries: every query sees all six keys.
    o = M.softmax_attention(q, k, v, causal=False, impl="xla")
    assert o.shape == (1, 4, 1, 8)
    np.testing.assert_allclose(o, naive.softmax_attention(q, k, v, causal=False), rtol=1e-5, atol=1e-6)


def test_unknown_impl_names_the_argument():
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="`impl` must be one of"):
        M.softmax_attention(q, q, q, impl="flash")


@pytest.mark.skipif(ON_GPU, reason="on a GPU cuDNN is available for bf16")
def test_unavailable_impl_says_why():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl.*'cudnn'.*unavailable here.*NVIDIA GPU"):
        M.softmax_attention(q, q, q, impl="cudnn")


def test_cudnn_refuses_float32_clearly(monkeypatch):
    """The dtype is the reason given, on a GPU (off one, the backend is: the dtype check is reached with the
    backend taken as a GPU's)."""
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    if not ON_GPU:
        monkeypatch.setattr(fused.jax, "default_backend", lambda: "gpu")
        assert "takes bfloat16 / float16 inputs, got float32" in fused._cudnn_unsupported(q, q, q)
        half = q.astype(jnp.bfloat16)
        assert fused._cudnn_unsupported(half, half, half) is None
        monkeypatch.undo()
    with pytest.raises(ValueError, match="unavailable here"):
        M.softmax_attention(q, q, q, impl="cudnn")


def test_auto_resolves_per_backend():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    want = {"gpu": "cudnn", "tpu": "pallas"}.get(jax.default_backend(), "xla")
    assert fused.resolve_impl("t", "auto", q, q, q) == want
    assert fused.resolve_impl("t", "auto", q.astype(jnp.float32), q, q) in ("xla", "pallas")


@pytest.mark.parametrize("T,H,Hk,K,V,segments,causal", [(200, 2, 2, 192, 128, True, True),
                                                        (130, 2, 1, 64, 64, False, True),
                                                        (60, 2, 2, 128, 128, True, False)])
def test_tpu_flash_attention_takes_mla_widths_and_any_length(T, H, Hk, K, V, segments, causal):
    """JAX's Mosaic flash attention (``"auto"`` on a TPU) refuses heads wider than 128 that are not
    multiples of 128 (MLA's 192) and sequences shorter than its 128-token blocks; ``_pallas_tpu`` pads
    both. Run in the TPU interpret mode: output and gradients against the float32 blockwise form."""
    from jax.experimental.pallas import tpu as pltpu

    r = np.random.default_rng(T + K)
    q = jnp.asarray(r.normal(size=(2, T, H, K)), jnp.float32)
    k = jnp.asarray(r.normal(size=(2, T, Hk, K)), jnp.float32)
    v = jnp.asarray(r.normal(size=(2, T, Hk, V)), jnp.float32)
    doc = jnp.asarray(np.sort(r.integers(0, 3, size=(2, T)), axis=1), jnp.int32) if segments else None
    w = jnp.asarray(r.normal(size=(2, T, H, V)), jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v) * w)

    def tpu(q, k, v):
        kk, vv = jnp.repeat(k, H // Hk, 2), jnp.repeat(v, H // Hk, 2)  # as fused._pallas hands them over
        vv = jnp.pad(vv, ((0, 0), (0, 0), (0, 0), (0, max(K - V, 0))))
        return fused._pallas_tpu(q, kk, vv, doc, doc, causal, K ** -0.5)[..., :V]

    ref = lambda q, k, v: fused.blockwise_attention(q, k, v, scale=K ** -0.5, causal=causal, doc_q=doc, doc_k=doc)
    want = jax.value_and_grad(loss, argnums=(1, 2, 3))(ref, q, k, v)
    with pltpu.force_tpu_interpret_mode():
        got = jax.value_and_grad(loss, argnums=(1, 2, 3))(tpu, q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < 5e-5
    # the interpret mode does not check Mosaic's shape rules: the TPU lowering, from the CPU, does
    sd = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16)  # noqa: E731
    text = jax.export.export(jax.jit(jax.grad(lambda q, k, v: loss(tpu, q, k, v), argnums=(0, 1, 2))),
                             platforms=["tpu"])(sd(q), sd(k), sd(v)).mlir_module()
    assert "tpu_custom_call" in text
