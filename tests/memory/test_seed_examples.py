"""Worked d = 4 examples (one-hot and overlapping keys, a 4 × 4 board), computed with the
public memory API.

These are specifications: each expected number is worked out by hand from the stated keys,
values, gates and write strengths, and the library must reproduce it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax import memory as M


def jitted(fn, **static):
    """``fn`` with keyword options fixed, as one compiled program (op by op, every operation of the
    chunked form compiles on its own)."""
    return jax.jit(functools.partial(fn, **static))

CAT = [1.0, 0.0, 0.0, 0.0]
DOG = [0.6, 0.8, 0.0, 0.0]
SILVER_KEY = [0.0, 0.0, 1.0, 0.0]
MOCHI = [2.0, 1.0, 0.0, 1.0]
REX = [0.0, 3.0, 1.0, 2.0]
BISCUIT = [1.0, 0.0, 2.0, 2.0]
SILVER = [3.0, 0.0, 1.0, 0.0]


def seq(*rows):
    """Tokens -> [B=1, T, H=1, D]."""
    return jnp.asarray(rows, jnp.float32)[None, :, None, :]


def tok(row):
    return jnp.asarray(row, jnp.float32)[None, None, :]


def test_read_back_identity_unit_key():
    # S = kᵀv; reading with the same unit key returns v exactly: kS = |k|² v.
    _, S = M.linear_attention(seq(DOG), seq(DOG), seq(REX), scale=1.0)
    np.testing.assert_allclose(jnp.asarray(DOG) @ S[0, 0], REX, atol=1e-6)
    # A non-unit key reads back |k|² v.
    k = [0.0, 2.0, 0.0, 0.0]
    _, S = M.linear_attention(seq(k), seq(k), seq(REX), scale=1.0)
    np.testing.assert_allclose(jnp.asarray(k) @ S[0, 0], 4.0 * np.asarray(REX), atol=1e-6)


def test_interference_read():
    # cat→Mochi then dog→Rex, additively; reading "cat" returns Mochi + 0.6·Rex.
    o, S = M.linear_attention(seq(CAT, CAT), seq(CAT, DOG), seq(MOCHI, REX), scale=1.0)
    np.testing.assert_allclose(o[0, 1, 0], [2.0, 2.8, 0.6, 2.2], atol=1e-6)
    np.testing.assert_allclose(S[0, 0, 0], [2.0, 2.8, 0.6, 2.2], atol=1e-6)  # row 0 of the board


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_clean_overwrite(mode):
    # Board: cat→Mochi (row 0) and Silver (row 2). Delta write cat→Biscuit with β = 1.
    q = seq(CAT, SILVER_KEY, CAT)
    k = seq(CAT, SILVER_KEY, CAT)
    v = seq(MOCHI, SILVER, BISCUIT)
    o, S = jitted(M.delta_rule, scale=1.0, mode=mode)(q, k, v, jnp.ones((1, 3, 1)))
    np.testing.assert_allclose(o[0, 2, 0], [1.0, 0.0, 2.0, 2.0], atol=1e-6)  # Biscuit, exactly
    np.testing.assert_allclose(S[0, 0, 2], SILVER, atol=1e-6)  # row 2 untouched


def test_overwrite_on_contaminated_board():
    # Rex bled into row 0 additively; the delta write subtracts the contaminated read.
    _, S = M.linear_attention(seq(CAT, DOG), seq(CAT, DOG), seq(MOCHI, REX), scale=1.0)
    dog_before = jnp.asarray(DOG) @ S[0, 0]
    o, S2 = M.delta_rule_step(tok(CAT), tok(CAT), tok(BISCUIT), jnp.ones((1, 1)), S, scale=1.0)
    np.testing.assert_allclose(o[0, 0], BISCUIT, atol=1e-6)  # "cat" now reads clean Biscuit
    dog_after = jnp.asarray(DOG) @ S2[0, 0]
    # Side effect on the overlapping fact: dog's read moves by 0.6·(Biscuit − contaminated row 0).
    np.testing.assert_allclose(dog_after - dog_before,
                               0.6 * (np.asarray(BISCUIT) - np.array([2.0, 2.8, 0.6, 2.2])), atol=1e-6)
    assert not np.allclose(dog_after, dog_before)


def test_chunk_solve_u2_equals_sequential_read():
    # C = 2: k1 = cat, k2 = dog (overlap 0.6), β = 1, S0 = 0, values Mochi and Rex.
    u = jax.jit(M.delta_corrections)(seq(CAT, DOG), seq(MOCHI, REX), jnp.ones((1, 2, 1)))
    np.testing.assert_allclose(u[0, 0, 0], MOCHI, atol=1e-6)
    np.testing.assert_allclose(u[0, 1, 0], [-1.2, 2.4, 1.0, 1.4], atol=1e-6)
    # Sequential: after writing Mochi, token 2 reads v_old = k2 S1; u2 = v2 − v_old.
    _, S1 = jitted(M.delta_rule, scale=1.0)(seq(CAT), seq(CAT), seq(MOCHI), jnp.ones((1, 1, 1)))
    v_old = jnp.asarray(DOG) @ S1[0, 0]
    np.testing.assert_allclose(np.asarray(REX) - v_old, [-1.2, 2.4, 1.0, 1.4], atol=1e-6)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
def test_survival_product(mode):
    # Mochi written at step 3; gates 0.9, 0.5, 0.9 at steps 4-6; read "cat" at step 6.
    T = 6
    alpha = np.ones(T)
    alpha[3:] = [0.9, 0.5, 0.9]
    beta = np.zeros((1, T, 1))
    beta[0, 2] = 1.0
    zeros = [0.0] * 4
    k = seq(*[zeros, zeros, CAT, zeros, zeros, zeros])
    v = seq(*[zeros, zeros, MOCHI, zeros, zeros, zeros])
    q = seq(*[CAT] * T)
    g = jnp.asarray(np.log(alpha), jnp.float32)[None, :, None]
    o, _ = jitted(M.gated_delta_rule, scale=1.0, mode=mode, chunk_size=4)(q, k, v, g, jnp.asarray(beta, jnp.float32))
    np.testing.assert_allclose(o[0, 5, 0], 0.405 * np.asarray(MOCHI), rtol=1e-6)
    # Every read of "cat": nothing before the write, then Mochi times the gates survived so far.
    survived = [0.0, 0.0, 1.0, 0.9, 0.9 * 0.5, 0.9 * 0.5 * 0.9]
    np.testing.assert_allclose(o[0, :, 0], np.outer(survived, MOCHI), rtol=1e-6, atol=1e-7)


def test_twin_boards_scalar_vs_per_channel_gate():
    # Mochi on channel 0, junk on channels 2-3; at the switch the scalar gate slams the whole
    # board, the per-channel gate slams only the junk channels.
    junk_k = [0.0, 0.0, 0.6, 0.8]
    junk_v = [5.0, 5.0, 5.0, 5.0]
    k = seq(CAT, junk_k, [0.0] * 4)
    v = seq(MOCHI, junk_v, [0.0] * 4)
    q = seq(CAT, CAT, CAT)
    beta = jnp.asarray([[[1.0], [1.0], [0.0]]])
    slam = np.log(0.2)
    g_scalar = jnp.asarray([[[0.0], [0.0], [slam]]], jnp.float32)
    g_channel = jnp.asarray([[[[0.0] * 4], [[0.0] * 4], [[0.0, 0.0, slam, slam]]]], jnp.float32)
    o_gdn, S_gdn = jitted(M.gated_delta_rule, scale=1.0)(q, k, v, g_scalar, beta)
    o_kda, S_kda = jitted(M.kda, scale=1.0)(q, k, v, g_channel, beta)
    np.testing.assert_allclose(o_gdn[0, 2, 0], 0.2 * np.asarray(MOCHI), rtol=1e-6)  # the cat was shot
    np.testing.assert_allclose(o_kda[0, 2, 0], MOCHI, rtol=1e-6)  # the cat lives
    junk_read = lambda S: np.asarray(junk_k) @ np.asarray(S[0, 0])
    np.testing.assert_allclose(junk_read(S_gdn), 0.2 * np.asarray(junk_v), rtol=1e-5)
    np.testing.assert_allclose(junk_read(S_kda), 0.2 * np.asarray(junk_v), rtol=1e-5)  # junk faded in both
