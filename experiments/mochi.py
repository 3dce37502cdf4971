"""Mochi on a 4 × 4 board: worked d = 4 examples of every update rule, computed by the library.

Every number comes out of :mod:`lineage_jax.memory` (``linear_attention``,
``delta_rule``, ``delta_rule_step``, ``delta_corrections``, ``gated_delta_rule``,
``kda``) fed with small hand-checkable keys, values, gates and write strengths;
nothing below is an answer typed in. The tests compare the results to the same
examples worked by hand.

The examples, one per step of the lineage: an outer-product write and its read-back
(linear attention); interference of two overlapping keys; the delta rule's overwrite
(Schlag et al., "Linear Transformers Are Secretly Fast Weight Programmers", 2021,
arXiv:2102.11174); the chunked form's triangular (WY) solve against the sequential rule
(Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length", 2024, arXiv:2406.06484); a scalar decay gate (Gated DeltaNet: Yang, Kautz,
Hatamizadeh, 2024, arXiv:2412.06464); and a per-channel gate (KDA: Kimi Team, "Kimi
Linear", 2025, arXiv:2510.26692).

    python -m experiments.mochi [--quick] [--out results] [--json]

Inputs:
``k_cat = [1,0,0,0]``, ``k_dog = [0.6,0.8,0,0]``, ``v_Mochi = [2,1,0,1]``,
``v_Rex = [0,3,1,2]``, ``v_Biscuit = [1,0,2,2]``, and a second stored value (Silver's, row 2).
``scale = 1`` throughout (reads are ``o = qS`` with no ``1/√d``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import types

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from lineage_jax import memory as _memory

# The public API, each function jit-compiled once per call signature (eager dispatch
# would compile every small op separately; this keeps the script to a few seconds).
_SEQ_STATIC = ("scale", "mode", "chunk_size")
M = types.SimpleNamespace(
    linear_attention=jax.jit(_memory.linear_attention, static_argnames=_SEQ_STATIC + ("normalize",)),
    delta_rule=jax.jit(_memory.delta_rule, static_argnames=_SEQ_STATIC),
    gated_delta_rule=jax.jit(_memory.gated_delta_rule, static_argnames=_SEQ_STATIC),
    kda=jax.jit(_memory.kda, static_argnames=_SEQ_STATIC),
    delta_rule_step=jax.jit(_memory.delta_rule_step, static_argnames=("scale",)),
    delta_corrections=jax.jit(_memory.delta_corrections),
)

NAME = "mochi"

CAT = [1.0, 0.0, 0.0, 0.0]
DOG = [0.6, 0.8, 0.0, 0.0]
SILVER_KEY = [0.0, 0.0, 1.0, 0.0]
ZERO = [0.0, 0.0, 0.0, 0.0]
MOCHI = [2.0, 1.0, 0.0, 1.0]
REX = [0.0, 3.0, 1.0, 2.0]
BISCUIT = [1.0, 0.0, 2.0, 2.0]
SILVER = [3.0, 0.0, 1.0, 0.0]
# Per-channel gate: junk written on channels 2-3, and the context-switch gate α = 0.2.
JUNK_KEY = [0.0, 0.0, 0.6, 0.8]
JUNK = [5.0, 5.0, 5.0, 5.0]
SWITCH_ALPHA = 0.2
# Scalar gate: Mochi written at step 3, gates 0.9, 0.5, 0.9 at steps 4-6, read at step 6.
SURVIVAL_GATES = [0.9, 0.5, 0.9]


def _seq(*rows) -> jnp.ndarray:
    """Tokens -> ``[B=1, T, H=1, D]``."""
    return jnp.asarray(rows, jnp.float32)[None, :, None, :]


def _tok(row) -> jnp.ndarray:
    """One token -> ``[B=1, H=1, D]``."""
    return jnp.asarray(row, jnp.float32)[None, None, :]


def _ones(T: int) -> jnp.ndarray:
    return jnp.ones((1, T, 1), jnp.float32)


def _read(key, S) -> np.ndarray:
    """``o = k S`` on a board ``S [1, 1, K, V]``."""
    return np.asarray(key, np.float64) @ np.asarray(S[0, 0], np.float64)


def _strength(read, value) -> float:
    """How much of ``value`` a read holds: the projection coefficient ``⟨read, value⟩ / |value|²``."""
    value = np.asarray(value, np.float64)
    return float(np.asarray(read, np.float64) @ value / (value @ value))


def _board(S) -> list:
    return np.asarray(S[0, 0], np.float64).tolist()


# ----------------------------------------------------------------------------
# The examples.
# ----------------------------------------------------------------------------
def read_back() -> dict:
    """Read-back: store ``S = kᵀv``; reading with ``k`` returns ``|k|² v`` (exactly ``v`` for a unit key)."""
    _, S_unit = M.linear_attention(_seq(DOG), _seq(DOG), _seq(REX), scale=1.0)
    long_key = [0.0, 2.0, 0.0, 0.0]
    _, S_long = M.linear_attention(_seq(long_key), _seq(long_key), _seq(REX), scale=1.0)
    long_read = _read(long_key, S_long)
    return {
        "unit_key": DOG, "value": REX, "unit_key_read": _read(DOG, S_unit),
        "long_key": long_key, "long_key_norm_sq": float(np.dot(long_key, long_key)),
        "long_key_read": long_read, "long_key_gain": _strength(long_read, REX),
    }


def interference() -> dict:
    """Interference: cat→Mochi then dog→Rex, additively; read "cat"."""
    o, S = M.linear_attention(_seq(CAT, CAT), _seq(CAT, DOG), _seq(MOCHI, REX), scale=1.0)
    read = np.asarray(o[0, 1, 0], np.float64)
    overlap = float(np.dot(CAT, DOG))
    error = read - np.asarray(MOCHI)
    return {
        "read": read, "board": _board(S), "key_overlap": overlap, "error": error,
        # the interference law: error = (k_cat · k_dog) v_Rex
        "law_max_abs_dev": float(np.max(np.abs(error - overlap * np.asarray(REX)))),
    }


def overwrite() -> dict:
    """Delta-rule overwrite, clean case: board cat→Mochi (row 0), Silver (row 2); delta write cat→Biscuit with β = 1."""
    q = k = _seq(CAT, SILVER_KEY, CAT)
    o, S_after = M.delta_rule(q, k, _seq(MOCHI, SILVER, BISCUIT), _ones(3), scale=1.0)
    _, S_before = M.delta_rule(q[:, :2], k[:, :2], _seq(MOCHI, SILVER), _ones(2), scale=1.0)
    # READ / SUBTRACT / WRITE: the correction the write stamps, u = β(v − k S).
    u = M.delta_corrections(_seq(CAT), _seq(BISCUIT), _ones(1), initial_state=S_before)
    return {
        "v_old": _read(CAT, S_before), "u": np.asarray(u[0, 0, 0], np.float64),
        "read": np.asarray(o[0, 2, 0], np.float64),
        "silver_read_before": _read(SILVER_KEY, S_before), "silver_read_after": _read(SILVER_KEY, S_after),
        "board_before": _board(S_before), "board_after": _board(S_after),
    }


def contaminated() -> dict:
    """Delta-rule overwrite, honest case: Rex bled into row 0 additively; then the delta write cat→Biscuit."""
    _, S = M.linear_attention(_seq(CAT, DOG), _seq(CAT, DOG), _seq(MOCHI, REX), scale=1.0)
    o, S2 = M.delta_rule_step(_tok(CAT), _tok(CAT), _tok(BISCUIT), jnp.ones((1, 1)), S, scale=1.0)
    cat_before, dog_before, dog_after = _read(CAT, S), _read(DOG, S), _read(DOG, S2)
    return {
        "cat_read_before": cat_before, "cat_read_after": np.asarray(o[0, 0], np.float64),
        "dog_read_before": dog_before, "dog_read_after": dog_after, "dog_shift": dog_after - dog_before,
        # what the algebra predicts for the side effect: (k_dog · k_cat)(Biscuit − contaminated read)
        "dog_shift_predicted": float(np.dot(DOG, CAT)) * (np.asarray(BISCUIT) - cat_before),
        "board_before": _board(S), "board_after": _board(S2),
    }


def wy_solve() -> dict:
    """Chunked (WY) solve, C = 2: the triangular solve's u₂ equals the sequential rule's correction."""
    u = M.delta_corrections(_seq(CAT, DOG), _seq(MOCHI, REX), _ones(2))
    # Sequential: after writing Mochi, token 2 reads v_old = k₂ S₁ and writes u₂ = β(v₂ − v_old).
    _, S1 = M.delta_rule(_seq(CAT), _seq(CAT), _seq(MOCHI), _ones(1), scale=1.0, mode="recurrent")
    v_old = _read(DOG, S1)
    seq_u2 = np.asarray(REX) - v_old
    # And the whole two-token chunk against the token-by-token scan.
    q = k = _seq(CAT, DOG)
    o_chunk, S_chunk = M.delta_rule(q, k, _seq(MOCHI, REX), _ones(2), scale=1.0, mode="chunked", chunk_size=2)
    o_scan, S_scan = M.delta_rule(q, k, _seq(MOCHI, REX), _ones(2), scale=1.0, mode="recurrent")
    return {
        "u1": np.asarray(u[0, 0, 0], np.float64), "u2": np.asarray(u[0, 1, 0], np.float64),
        "sequential_v_old": v_old, "sequential_u2": seq_u2,
        "u2_max_abs_dev": float(np.max(np.abs(np.asarray(u[0, 1, 0]) - seq_u2))),
        "chunk_vs_scan_max_abs_dev": float(max(np.max(np.abs(o_chunk - o_scan)), np.max(np.abs(S_chunk - S_scan)))),
    }


def survival() -> dict:
    """Scalar gate: Mochi written at step 3, gates 0.9, 0.5, 0.9 at steps 4-6, read "cat" at step 6."""
    T = 3 + len(SURVIVAL_GATES)
    alpha = np.ones(T)
    alpha[3:] = SURVIVAL_GATES
    beta = np.zeros((1, T, 1), np.float32)
    beta[0, 2] = 1.0
    k = _seq(*[CAT if t == 2 else ZERO for t in range(T)])
    v = _seq(*[MOCHI if t == 2 else ZERO for t in range(T)])
    q = _seq(*[CAT] * T)
    g = jnp.asarray(np.log(alpha), jnp.float32)[None, :, None]
    reads = {}
    for mode in ("recurrent", "chunked"):
        o, _ = M.gated_delta_rule(q, k, v, g, jnp.asarray(beta), scale=1.0, mode=mode, chunk_size=4)
        reads[mode] = np.asarray(o[0, T - 1, 0], np.float64)
    return {
        "gates": SURVIVAL_GATES, "read": reads["recurrent"], "read_chunked": reads["chunked"],
        "strength": _strength(reads["recurrent"], MOCHI), "strength_chunked": _strength(reads["chunked"], MOCHI),
        "gate_product": float(np.prod(SURVIVAL_GATES)),
    }


def twin_boards() -> dict:
    """Per-channel gate: Mochi on channel 0, junk on channels 2-3, then a context switch.

    Gated DeltaNet's one scalar gate slams the whole board to α = 0.2; KDA's per-channel
    gate slams only the junk channels. Read "cat" after the switch.
    """
    k = _seq(CAT, JUNK_KEY, ZERO)
    v = _seq(MOCHI, JUNK, ZERO)
    q = _seq(CAT, CAT, CAT)
    beta = jnp.asarray([[[1.0], [1.0], [0.0]]], jnp.float32)
    slam = float(np.log(SWITCH_ALPHA))
    g_scalar = jnp.asarray([[[0.0], [0.0], [slam]]], jnp.float32)
    g_channel = jnp.asarray([[[[0.0] * 4], [[0.0] * 4], [[0.0, 0.0, slam, slam]]]], jnp.float32)
    o_gdn, S_gdn = M.gated_delta_rule(q, k, v, g_scalar, beta, scale=1.0)
    o_kda, S_kda = M.kda(q, k, v, g_channel, beta, scale=1.0)
    gdn_read, kda_read = np.asarray(o_gdn[0, 2, 0], np.float64), np.asarray(o_kda[0, 2, 0], np.float64)
    gdn_junk, kda_junk = _read(JUNK_KEY, S_gdn), _read(JUNK_KEY, S_kda)
    return {
        "switch_alpha": SWITCH_ALPHA,
        "gdn_cat_read": gdn_read, "kda_cat_read": kda_read,
        "gdn_mochi_kept": _strength(gdn_read, MOCHI), "kda_mochi_kept": _strength(kda_read, MOCHI),
        "gdn_junk_read": gdn_junk, "kda_junk_read": kda_junk,
        "gdn_junk_kept": _strength(gdn_junk, JUNK), "kda_junk_kept": _strength(kda_junk, JUNK),
        "gdn_board": _board(S_gdn), "kda_board": _board(S_kda),
    }


# ----------------------------------------------------------------------------
# Run, plot, table, CLI.
# ----------------------------------------------------------------------------
def _plot(res: dict):
    plt = common.plt
    boards = [
        ("linear attn: cat→Mochi + dog→Rex", res["interference"]["board"]),
        ("DeltaNet before: Mochi + Silver", res["overwrite"]["board_before"]),
        ("DeltaNet after: cat→Biscuit", res["overwrite"]["board_after"]),
        ("contaminated, after cat→Biscuit", res["contaminated"]["board_after"]),
        (f"Gated DeltaNet after switch (α={SWITCH_ALPHA})", res["twin_boards"]["gdn_board"]),
        ("KDA after switch (junk channels only)", res["twin_boards"]["kda_board"]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 8.2), constrained_layout=True)
    lim = max(abs(x) for _, b in boards for row in b for x in row)
    for ax, (title, board) in zip(axes.ravel(), boards):
        arr = np.asarray(board)
        im = ax.imshow(arr, cmap="RdBu_r", vmin=-lim, vmax=lim)
        for (i, j), val in np.ndenumerate(arr):
            ax.text(j, i, f"{val:.2g}" if abs(val) > 1e-9 else "0", ha="center", va="center", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(4), [f"v{j}" for j in range(4)])
        ax.set_yticks(range(4), [f"k{i}" for i in range(4)])
    fig.colorbar(im, ax=axes, shrink=0.6, label="state cell S[k, v]")
    fig.suptitle("The d = 4 boards, computed with lineage_jax.memory (rows k = key channels, columns v = value channels)")
    return fig


def run(quick: bool = False, out: str = "results") -> dict:
    """Compute every worked example; write ``<out>/mochi/mochi.{json,png}``; return the record.

    ``quick`` changes nothing (the examples are tiny); it is accepted for the common CLI.
    """
    # Worked examples are exact arithmetic on small numbers: float32 products on every backend
    # (a GPU's default TF32 would print 2.9997 for 3).
    with jax.default_matmul_precision("highest"):
        res = {
            "read_back": read_back(),
            "interference": interference(),
            "overwrite": overwrite(),
            "contaminated": contaminated(),
            "wy_solve": wy_solve(),
            "gated_survival": survival(),
            "twin_boards": twin_boards(),
        }
    record = dict(common.provenance(NAME, quick),
                  inputs={"k_cat": CAT, "k_dog": DOG, "k_silver": SILVER_KEY, "v_mochi": MOCHI, "v_rex": REX,
                          "v_biscuit": BISCUIT, "v_silver": SILVER, "k_junk": JUNK_KEY, "v_junk": JUNK, "scale": 1.0},
                  # the headline numbers, flat
                  interference_read=res["interference"]["read"],
                  overwrite_read=res["overwrite"]["read"],
                  wy_u2=res["wy_solve"]["u2"],
                  survival=res["gated_survival"]["strength"],
                  **res)
    return common.finish(record, NAME, out, _plot(res))


def table(r: dict) -> str:
    tb, cb = r["twin_boards"], r["contaminated"]
    rows = [
        ("read-back, unit key (dog→Rex)", r["read_back"]["unit_key_read"]),
        ("read-back, |k|²=4 key: gain", r["read_back"]["long_key_gain"]),
        ("interference read: cat", r["interference_read"]),
        ("  crosstalk coefficient k_cat·k_dog", r["interference"]["key_overlap"]),
        ("overwrite: v_old / u", f"{common._cell(r['overwrite']['v_old'])} / {common._cell(r['overwrite']['u'])}"),
        ("overwrite read: cat", r["overwrite_read"]),
        ("  Silver row after overwrite", r["overwrite"]["silver_read_after"]),
        ("contaminated: cat after write", cb["cat_read_after"]),
        ("  dog read before -> after", f"{common._cell(cb['dog_read_before'])} -> {common._cell(cb['dog_read_after'])}"),
        ("WY solve u2 (C=2)", r["wy_u2"]),
        ("  sequential u2 = v2 - k2 S1", r["wy_solve"]["sequential_u2"]),
        ("survival of Mochi after gates " + "·".join(map(str, r["gated_survival"]["gates"])), r["survival"]),
        ("twin boards: GDN keeps Mochi ×", tb["gdn_mochi_kept"]),
        ("twin boards: KDA keeps Mochi ×", tb["kda_mochi_kept"]),
        ("twin boards: junk kept GDN / KDA", f"{tb['gdn_junk_kept']:.4g} / {tb['kda_junk_kept']:.4g}"),
    ]
    return common.format_table(["quantity (d = 4, worked by hand)", "computed by lineage_jax.memory"], rows,
                               title=f"Mochi on a 4x4 board — {r['device']['description']}, jax {r['jax_version']}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = common.make_parser(NAME, "Worked d = 4 examples of every update rule, computed with lineage_jax.memory.")
    parser.add_argument("--json", action="store_true", help="print the result record as one JSON object instead of the table")
    return common.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
