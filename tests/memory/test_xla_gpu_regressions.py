"""XLA:GPU failures the memory core works around, each as a minimal reproducer.

``reverse cumsum of a zero-padded array``: jaxlib 0.11.2's GPU emitter cannot translate the
fused ``reduce-window`` to LLVM IR ("missing LLVMTranslationDialectInterface registration for
... func.func"); reduced from ``memory.kda`` / ``memory.gated_delta_rule`` on the XLA backend
with fewer than 8 tokens in a chunk of 16 or more (a short prefill). The chunked form takes its
gate sums with ``memory.core.prefix_sum`` (a product with a 0/1 triangle) instead. The
reproducer is a strict expected failure: a jax that fixes it turns it red, and the workaround
can go.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax.memory import core

X = np.random.default_rng(0).normal(size=(2, 2, 7, 16)).astype(np.float32)


def _padded(a):
    return jnp.pad(a, ((0, 0), (0, 0), (0, 57), (0, 0)))  # 7 real tokens in a chunk of 64


@pytest.mark.gpu(reason="an XLA:GPU emitter failure")
@pytest.mark.xfail(strict=True, raises=jax.errors.JaxRuntimeError,
                   reason="XLA:GPU (jaxlib 0.11.2): reverse cumsum of a zero-padded array fails to compile")
def test_reverse_cumsum_of_padding_reproducer():
    f = jax.jit(lambda a: jnp.cumsum(_padded(a)[:, :, ::-1], axis=2)[:, :, ::-1])
    jax.block_until_ready(f(X))


def test_prefix_sum_is_the_workaround():
    """The same sums through ``core.prefix_sum`` compile on every backend and are exact."""
    want = np.cumsum(np.asarray(_padded(X))[:, :, ::-1], axis=2)[:, :, ::-1]
    got = jax.jit(lambda a: core.prefix_sum(_padded(a), axis=2, reverse=True))(X)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    fwd = jax.jit(lambda a: core.prefix_sum(_padded(a), axis=2))(X)
    np.testing.assert_allclose(np.asarray(fwd), np.cumsum(np.asarray(_padded(X)), axis=2), rtol=1e-6, atol=1e-6)
    ints = core.prefix_sum(jnp.asarray([[True, False, True, True]]).astype(jnp.int32), axis=-1)
    assert ints.dtype == jnp.int32 and ints.tolist() == [[1, 1, 2, 3]]
