"""The chunk dial of the chunked form: FLOPs fall as the chunk C shrinks; wall-clock does not.

    python -m experiments.chunk_dial [--quick] [--out results] [--seq-len T] [--head-dim d]
                                     [--heads H] [--batch B] [--repeats N] [--rules ...]

For every chunk size C = 1, 2, 4, …, T this times the chunked form of
``lineage_jax.memory.linear_attention`` and ``lineage_jax.memory.delta_rule`` on the
current default JAX device (``jax.jit``, two warm-up calls, then the median of N
timed calls, each ended by ``block_until_ready``) and sets it beside the analytic
cost of the chunked form, per (batch, head)::

    linear attention:  2·L·d² + 2·L·C·d       (state fold + read; intra-chunk attention)
    delta rule:        3·L·d² + 4·L·C·d       (+ the W·S₀ correction; + the C×C key overlaps
                                               and the triangular solve applied to β[K|V])

counted as multiply-adds: one multiply-add = one FLOP (the per-term counts are this
module's). The chunked form is that of Yang et al., "Gated Linear Attention Transformers
with Hardware-Efficient Training" (2023, arXiv:2312.06635) and, for the delta rule, Yang
et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length" (2024,
arXiv:2406.06484). (Achieved throughput
``achieved_flop_per_s`` counts two per multiply-add.) The FLOP-optimal C is the
smallest; the wall-clock optimum sits at the bottom of a U. Every timed output is
also checked against the token-by-token ``mode="recurrent"`` scan (which is timed
too, as the reference point of the dial's C = 1 end).

``--quick``: T = 1024, d = 32, H = 2, 5 repeats (about half a minute on a CPU).
Default: T = 8192, d = 128, H = 16, 10 repeats — sized for one GPU.
"""

from __future__ import annotations

import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from lineage_jax import memory as M

NAME = "chunk_dial"
RULES = ("linear_attention", "delta_rule")
DEFAULT = dict(seq_len=8192, head_dim=128, heads=16, batch=1, repeats=10)
QUICK = dict(seq_len=1024, head_dim=32, heads=2, batch=1, repeats=5)
FORMULAS = {"linear_attention": "2*L*d^2 + 2*L*C*d", "delta_rule": "3*L*d^2 + 4*L*C*d"}


def analytic_flops(rule: str, L: int, C: int, d: int, batch_heads: int = 1) -> float:
    """The chunked form's cost law (multiply-adds) for one sequence of ``L`` tokens, all heads."""
    if rule == "linear_attention":
        per_head = 2 * L * d * d + 2 * L * C * d
    elif rule == "delta_rule":
        per_head = 3 * L * d * d + 4 * L * C * d
    else:
        raise ValueError(f"unknown rule {rule!r}; valid: {RULES}")
    return float(batch_heads * per_head)


def chunk_sizes(T: int) -> list[int]:
    """1, 2, 4, …, T (``T`` a power of two)."""
    if T < 2 or T & (T - 1):
        raise ValueError(f"seq_len must be a power of two >= 2, got {T}")
    return [1 << e for e in range(T.bit_length())]


def make_inputs(B: int, T: int, H: int, d: int, seed: int = 0) -> dict:
    """Random ``q, v``, L2-normalized ``k`` (the solve is well-conditioned only then), ``β ∈ (0, 1)``."""
    rq, rk, rv, rb = jax.random.split(jax.random.key(seed), 4)
    k = jax.random.normal(rk, (B, T, H, d), jnp.float32)
    return {
        "q": jax.random.normal(rq, (B, T, H, d), jnp.float32),
        "k": k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        "v": jax.random.normal(rv, (B, T, H, d), jnp.float32),
        "beta": jax.nn.sigmoid(jax.random.normal(rb, (B, T, H), jnp.float32)),
    }


def _fn(rule: str, mode: str, C: int):
    base = getattr(M, rule)
    kwargs = dict(mode=mode) if mode == "recurrent" else dict(mode=mode, chunk_size=C)
    return jax.jit(functools.partial(base, **kwargs))


def _args(rule: str, x: dict) -> tuple:
    return (x["q"], x["k"], x["v"]) if rule == "linear_attention" else (x["q"], x["k"], x["v"], x["beta"])


def time_call(fn, args: tuple, repeats: int) -> dict:
    """Compile + 2 warm-up calls, then ``repeats`` timed calls (each ``block_until_ready``)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    t = np.asarray(common.timed_calls(fn, args, repeats, warmup=1))
    return {"out": out, "compile_s": compile_s, "median_s": float(np.median(t)), "min_s": float(t.min()),
            "p25_s": float(np.percentile(t, 25)), "p75_s": float(np.percentile(t, 75))}


def dial(quick: bool = False, *, seq_len: Optional[int] = None, head_dim: Optional[int] = None,
         heads: Optional[int] = None, batch: Optional[int] = None, repeats: Optional[int] = None,
         rules: Sequence[str] = RULES, check: bool = True) -> dict:
    """Measure every (rule, C); see the module docstring."""
    p = dict(QUICK if quick else DEFAULT)
    for key, val in dict(seq_len=seq_len, head_dim=head_dim, heads=heads, batch=batch, repeats=repeats).items():
        if val is not None:
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{key} must be a positive int, got {val!r}")
            p[key] = val
    rules = tuple(rules)
    bad = [r for r in rules if r not in RULES]
    if bad or not rules:
        raise ValueError(f"rules must be a non-empty subset of {RULES}, got {list(rules)}")
    T, d, H, B = p["seq_len"], p["head_dim"], p["heads"], p["batch"]
    Cs = chunk_sizes(T)
    x = make_inputs(B, T, H, d)
    results = {}
    bar = common.progress(desc=f"chunk dial T={T} d={d} H={H}", total=len(rules) * (len(Cs) + 1), unit="config")
    with bar:
        for rule in rules:
            args = _args(rule, x)
            bar.set_postfix_str(f"{rule} recurrent")
            ref = time_call(_fn(rule, "recurrent", 0), args, p["repeats"])
            o_ref = np.asarray(ref.pop("out")[0])
            scale = float(np.max(np.abs(o_ref)))
            bar.update()
            rows = []
            for C in Cs:
                bar.set_postfix_str(f"{rule} C={C}")
                meas = time_call(_fn(rule, "chunked", C), args, p["repeats"])
                o = meas.pop("out")[0]
                flops = analytic_flops(rule, T, C, d, B * H)
                row = dict(C=C, analytic_flops=flops, **meas,
                           achieved_flop_per_s=2 * flops / meas["median_s"])
                if check:
                    row["max_rel_err_vs_recurrent"] = float(np.max(np.abs(np.asarray(o) - o_ref))) / scale
                rows.append(row)
                bar.update()
            fl = [r["analytic_flops"] for r in rows]
            wall = [r["median_s"] for r in rows]
            best = int(np.argmin(wall))
            results[rule] = {
                "formula": FORMULAS[rule],
                "rows": rows,
                "recurrent": ref,
                "flop_optimal_C": Cs[int(np.argmin(fl))],
                "wall_clock_optimal_C": Cs[best],
                "wall_clock_optimal_s": wall[best],
                "speedup_best_vs_C1": wall[0] / wall[best],
                "speedup_best_vs_recurrent": ref["median_s"] / wall[best],
                "flops_ratio_best_vs_C1": fl[best] / fl[0],
            }
    return {"params": p, "chunk_sizes": Cs, "rules": results,
            "flop_convention": "one multiply-add = one FLOP; achieved_flop_per_s counts two"}


def _plot(res: dict):
    plt = common.plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.4))
    Cs = np.asarray(res["chunk_sizes"])
    colors = {"linear_attention": "#c8553d", "delta_rule": "#2e6f95"}
    for rule, r in res["rules"].items():
        fl = np.asarray([row["analytic_flops"] for row in r["rows"]])
        wall = np.asarray([row["median_s"] for row in r["rows"]])
        lo = np.asarray([row["p25_s"] for row in r["rows"]])
        hi = np.asarray([row["p75_s"] for row in r["rows"]])
        c = colors.get(rule)
        ax1.plot(Cs, fl / fl.min(), "--", color=c, label=f"{rule}: analytic {r['formula']}")
        ax1.plot(Cs, wall / wall.min(), "o-", color=c, label=f"{rule}: measured wall-clock (median)")
        ax1.fill_between(Cs, lo / wall.min(), hi / wall.min(), color=c, alpha=0.15)
        ax1.plot([r["wall_clock_optimal_C"]], [1.0], "*", ms=16, color=c, mec="k")
        ax2.plot(Cs, 1e3 * wall, "o-", color=c, label=f"{rule} chunked")
        ax2.axhline(1e3 * r["recurrent"]["median_s"], color=c, ls=":", label=f"{rule} recurrent scan")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("chunk size C")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_ylabel("relative to its own minimum")
    ax1.set_title("FLOPs fall with C; wall-clock is a U (★ = wall-clock optimum)")
    ax1.legend(fontsize=7)
    ax2.set_ylabel("median wall-clock per call (ms)")
    p = res["params"]
    ax2.set_title(f"B={p['batch']} T={p['seq_len']} H={p['heads']} d={p['head_dim']} on {res['device']['device_kind']}")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def run(quick: bool = False, out: str = "results", **kwargs) -> dict:
    """Measure the dial; write ``<out>/chunk_dial/chunk_dial.{json,png}``; return the record.

    Keyword overrides (``seq_len``, ``head_dim``, ``heads``, ``batch``, ``repeats``,
    ``rules``, ``check``) are passed to :func:`dial`.
    """
    res = dial(quick, **kwargs)
    record = dict(common.provenance(NAME, quick), **res)
    return common.finish(record, NAME, out, _plot(record))


def table(r: dict) -> str:
    parts = []
    for rule, s in r["rules"].items():
        rows = [[row["C"], f"{row['analytic_flops']:.4g}", f"{1e3 * row['median_s']:.3f}",
                 f"{row['achieved_flop_per_s'] / 1e9:.3g}", f"{row.get('max_rel_err_vs_recurrent', float('nan')):.1e}"]
                for row in s["rows"]]
        rows.append(["recurrent", "", f"{1e3 * s['recurrent']['median_s']:.3f}", "", ""])
        parts.append(common.format_table(
            ["C", f"FLOPs ({s['formula']})", "median ms", "GFLOP/s", "rel err vs scan"], rows,
            title=f"{rule}: FLOP-optimal C = {s['flop_optimal_C']}, wall-clock-optimal C = {s['wall_clock_optimal_C']} "
                  f"({s['speedup_best_vs_C1']:.2f}x faster than C=1 with {s['flops_ratio_best_vs_C1']:.2f}x its FLOPs)"))
    p = r["params"]
    head = (f"Chunk dial on {r['device']['description']}, jax {r['jax_version']}: "
            f"B={p['batch']} T={p['seq_len']} H={p['heads']} d={p['head_dim']}, median of {p['repeats']}")
    return "\n\n".join([head] + parts)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = common.make_parser(NAME, "Analytic FLOPs vs measured wall-clock of the chunked memories, C = 1 … T.")
    parser.add_argument("--seq-len", type=common.power_of_two, help="tokens T, a power of two (default 8192; quick 1024)")
    parser.add_argument("--head-dim", type=common.positive_int, help="d = K = V (default 128; quick 32)")
    parser.add_argument("--heads", type=common.positive_int, help="heads H (default 16; quick 2)")
    parser.add_argument("--batch", type=common.positive_int, help="batch B (default 1)")
    parser.add_argument("--repeats", type=common.positive_int, help="timed calls per point (default 10; quick 5)")
    parser.add_argument("--rules", nargs="+", choices=RULES, help=f"which memories to time (default: {' '.join(RULES)})")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip comparing every output with the recurrent scan")
    return common.main_for(NAME, parser, _run_cli, table, argv)


def _run_cli(quick: bool, out: str, rules=None, **kwargs) -> dict:
    return run(quick, out, rules=tuple(rules) if rules else RULES, **kwargs)


if __name__ == "__main__":
    main()
