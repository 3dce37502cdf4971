"""The Pallas short causal convolution against the XLA one it replaces: forward, ``dx`` and ``dw``
on fresh random inputs (odd lengths, partial channel blocks, packed documents, float32 and bf16),
interpreted on the CPU and compiled on a GPU; and the mixers' choice of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax.layers import conv_pallas as CP
from lineage_jax.layers.memory_mixer import causal_conv
from lineage_jax.memory import MemoryOptions
from tests._jaxpr import pallas_launches


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def _case(seed, B, T, C, W, dtype, docs):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (B, T, C), jnp.float32).astype(dtype)
    w = jax.random.normal(k[1], (W, C), jnp.float32) * 0.5
    doc = jnp.cumsum(jax.random.bernoulli(k[2], 0.15, (B, T)), axis=1).astype(jnp.int32) if docs else None
    dy = jax.random.normal(k[3], (B, T, C), jnp.float32).astype(dtype)
    return x, w, doc, dy


def _vjp(fn, x, w, doc, dy):
    y, pull = jax.vjp(lambda x, w: fn(x, w, doc), x, w)
    return (y, *pull(dy))


def _xla(x, w, doc):
    return causal_conv(x.astype(jnp.float32), w, None, doc)[0]


@pytest.mark.parametrize("B,T,C,W,docs", [(2, 37, 48, 4, False), (2, 130, 200, 4, True), (1, 3, 16, 4, True)])
def test_kernel_matches_the_xla_convolution_forward_and_gradients(B, T, C, W, docs):
    """float32: the kernel's y, dx and dw equal XLA's (shifted slices, differentiated by JAX)."""
    x, w, doc, dy = _case(T * C + W, B, T, C, W, jnp.float32, docs)
    got = _vjp(CP.causal_conv, x, w, doc, dy)
    want = _vjp(_xla, x, w, doc, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) <= 1e-5, (name, _rel(a, b))


def test_bf16_inputs_accumulate_in_float32():
    """bf16 in and out, float32 inside: within bf16 rounding of the float32 convolution (two taps)."""
    x, w, doc, dy = _case(7, 2, 70, 128, 2, jnp.bfloat16, True)
    got = _vjp(CP.causal_conv, x, w, doc, dy)
    want = _vjp(_xla, x.astype(jnp.float32), w, doc, dy.astype(jnp.float32))
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert _rel(a, b) <= 1e-2, (name, _rel(a, b))


def test_documents_stay_separate():
    """A token's output does not change when an earlier document's inputs do."""
    x, w, _, _ = _case(3, 1, 20, 16, 4, jnp.float32, False)
    doc = jnp.asarray([[0] * 9 + [1] * 11], jnp.int32)
    x2 = x.at[:, :9].set(100.0)
    y1, y2 = CP.causal_conv(x, w, doc), CP.causal_conv(x2, w, doc)
    np.testing.assert_array_equal(np.asarray(y1[:, 9:]), np.asarray(y2[:, 9:]))
    assert not np.allclose(np.asarray(y1[:, :9]), np.asarray(y2[:, :9]))


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("last", [1, 2, 5])
def test_the_carried_window_holds_the_last_document_only(kernel, last):
    """After packed documents the window carried to the next call (a decode step) is what the last document
    alone leaves: its inputs, zeros before its start (it held the earlier document's last inputs)."""
    x, w, _, _ = _case(5, 2, 9, 16, 4, jnp.float32, False)
    doc = jnp.asarray([[0] * (9 - last) + [1] * last] * 2, jnp.int32)
    _, window = causal_conv(x, w, None, doc, kernel=kernel)
    _, alone = causal_conv(x[:, 9 - last:], w, None, jnp.zeros((2, last), jnp.int32), kernel=kernel)
    np.testing.assert_array_equal(np.asarray(window), np.asarray(alone))
    assert np.any(np.asarray(window) != 0)


def test_decode_after_a_packed_prefill_is_the_last_documents():
    """tiny_kda (KDA layers with short convs): a prefill of two documents, the last of one token, then a
    decode step gives the logits of that document prefilled alone (2.87 apart before)."""
    from flax import nnx

    from lineage_jax.models import Decoder, get_config
    m = Decoder(get_config("tiny_kda"), rngs=nnx.Rngs(0))
    tok = jax.random.randint(jax.random.key(1), (1, 9), 0, 256)
    prefill = nnx.jit(lambda m, t, c, s: m.prefill(t, c, segment_ids=s))
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))
    _, cache = prefill(m, tok[:, :8], m.init_cache(1, 16), jnp.asarray([[0] * 7 + [1]]))
    packed, _ = decode(m, tok[:, 8], cache)
    _, cache = prefill(m, tok[:, 7:8], m.init_cache(1, 16), jnp.zeros((1, 1), jnp.int32))
    alone, _ = decode(m, tok[:, 8], cache)
    assert _rel(packed, alone) <= 1e-5, _rel(packed, alone)


def test_the_mixer_runs_xla_beyond_the_kernels_offsets(monkeypatch):
    """Past the compiled kernels' 32-bit offsets (``fits``), causal_conv(kernel=True) runs XLA's form."""
    x, w, doc, _ = _case(9, 1, 12, 16, 4, jnp.float32, True)
    monkeypatch.setattr(CP, "fits", lambda x: False)
    names = [n for n, _ in pallas_launches(jax.make_jaxpr(lambda x: causal_conv(x, w, None, doc, kernel=True))(x).jaxpr)]
    assert names == []


def test_bad_shapes_name_the_argument():
    x = jnp.zeros((1, 8, 16))
    with pytest.raises(ValueError, match="`x`.*`w`"):
        CP.causal_conv(x, jnp.zeros((4, 8)))
    with pytest.raises(ValueError, match="`doc`"):
        CP.causal_conv(x, jnp.zeros((4, 16)), jnp.zeros((1, 9), jnp.int32))


def test_the_kernel_runs_where_the_delta_rules_run_pallas():
    """MemoryOptions.use_pallas_conv decides: backend "pallas" (interpreted here, compiled on a GPU),
    "auto" on GPUs only, never "xla"; the mixer's causal_conv(kernel=True) is the kernel. (A whole
    model under backend "pallas" against "xla", loss and gradients, is tests/layers/test_models.py::
    test_pallas_memory_backend_gives_same_loss_and_grads.)"""
    assert MemoryOptions(backend="pallas").use_pallas_conv() == CP.available()
    assert not MemoryOptions(backend="xla").use_pallas_conv()
    assert MemoryOptions(backend="auto").use_pallas_conv() == (jax.default_backend() == "gpu")
    x, w, doc, _ = _case(5, 1, 9, 16, 4, jnp.float32, True)
    names = lambda kernel: [n for n, _ in pallas_launches(jax.make_jaxpr(  # noqa: E731
        lambda x: causal_conv(x, w, None, doc, kernel=kernel))(x).jaxpr)]
    assert names(True) == ["causal_conv_fwd"] and names(False) == []
    (y, prefix), (y0, prefix0) = causal_conv(x, w, None, doc, kernel=True), causal_conv(x, w, None, doc)
    assert _rel(y, y0) <= 1e-6
    np.testing.assert_array_equal(np.asarray(prefix), np.asarray(prefix0))  # the decode cache's conv prefix
    short = x[:, :2]  # fewer tokens than the prefix holds: zeros before them
    np.testing.assert_array_equal(np.asarray(causal_conv(short, w, None, None, kernel=True)[1]),
                                  np.asarray(causal_conv(short, w, None, None)[1]))


def test_bad_documents_taps_and_empty_batches():
    """Document ids must be integers in both forms (a float id was truncated by the kernel and compared exactly
    by XLA: the two forms disagreed); a tapless ``w`` is refused by name; an empty batch gives an empty result."""
    x, w = jnp.ones((1, 8, 16)), jnp.ones((4, 16))
    for doc in (jnp.asarray([[0, .5, .5, 1, 1.2, 1.7, 2, 2]]), jnp.zeros((1, 8), bool)):
        with pytest.raises(ValueError, match="`doc` must hold integer document ids"):
            CP.causal_conv(x, w, doc)
        with pytest.raises(ValueError, match="`doc` must hold integer document ids"):
            causal_conv(x, w, None, doc, kernel=False)
    with pytest.raises(ValueError, match="`w` must hold at least one tap"):
        CP.causal_conv(x, w[:0])
    for shape in ((0, 8, 16), (2, 0, 16)):
        y = CP.causal_conv(jnp.ones(shape), w)
        assert y.shape == shape
        dw = jax.grad(lambda w: jnp.sum(CP.causal_conv(jnp.ones(shape), w)))(w)
        assert dw.shape == w.shape and not np.any(np.asarray(dw))
