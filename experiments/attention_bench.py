"""Fused softmax attention: every implementation of ``memory.softmax_attention``, timed and checked.

For each shape (``B x T``, 16 heads) and head layout — ``mha`` (q/k/v 128 wide), ``gqa`` (16 query
heads over 4 key/value heads) and ``mla`` (q/k 192 = nope 128 + rope 64, v 128) — with and
without packed documents (``segment_ids``, documents of ~``--doc-len`` tokens), it times the
forward and the forward + backward of each ``impl`` (``xla``, ``cudnn``, ``pallas``; bf16 inputs;
median of ``--reps`` synchronized calls after a warm-up) and reports the error of the output and
of every gradient against :func:`lineage_jax.memory.reference_attention` in float32 on the first
shape. Implementations that cannot run on this backend are skipped with the reason.

Usage::

    python -m experiments.attention_bench                         # 4x4096 and 1x32768
    python -m experiments.attention_bench --shapes 8x2048 --impls cudnn,pallas
    python -m experiments.attention_bench --quick                 # a CPU smoke run
"""

from __future__ import annotations

import statistics
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common as C
from lineage_jax import memory as M

NAME = "attention_bench"
IMPLS = ("xla", "cudnn", "pallas")
LAYOUTS = {"mha": (16, 16, 128, 128), "gqa": (16, 4, 128, 128), "mla": (16, 16, 192, 128)}


def _inputs(key, B, T, layout, dtype, doc_len):
    H, Hk, K, Vd = layout
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (B, T, H, K), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, Hk, K), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, Hk, Vd), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, Vd), jnp.float32).astype(dtype)
    seg = None
    if doc_len:
        seg = jnp.cumsum(jax.random.bernoulli(ks[4], 1.0 / doc_len, (B, T)).astype(jnp.int32), axis=1)
    return q, k, v, do, seg


def _fns(impl, seg):
    f = jax.jit(lambda q, k, v: M.softmax_attention(q, k, v, segment_ids=seg, impl=impl))

    def loss(q, k, v, do):
        return jnp.sum(M.softmax_attention(q, k, v, segment_ids=seg, impl=impl).astype(jnp.float32)
                       * do.astype(jnp.float32))

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return f, g


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(impl, layout, seg_on, B=2, T=300, doc_len=64):
    """Errors of ``impl`` (bf16 inputs) against the float32 reference on the same inputs."""
    q, k, v, do, seg = _inputs(jax.random.key(1), B, T, LAYOUTS[layout], jnp.bfloat16, doc_len if seg_on else 0)
    f, g = _fns(impl, seg)
    up = lambda a: a.astype(jnp.float32)
    ref_o = M.reference_attention(up(q), up(k), up(v), segment_ids=seg)
    ref_g = jax.grad(lambda q, k, v: jnp.sum(M.reference_attention(q, k, v, segment_ids=seg) * up(do)),
                     argnums=(0, 1, 2))(up(q), up(k), up(v))
    out = {"o": _rel(f(q, k, v), ref_o)}
    for name, a, b in zip(("dq", "dk", "dv"), g(q, k, v, do), ref_g):
        out[name] = _rel(a, b)
    return out


DEFAULT_SHAPES, DEFAULT_REPS = "4x4096,1x32768", 10
QUICK_SHAPES, QUICK_REPS = "1x256", 2  # --quick, for the options left unset


def _parse(shapes: str) -> list[tuple[int, int]]:
    """``"4x4096,1x32768"`` -> ``[(4, 4096), (1, 32768)]``; a ``ValueError`` naming ``--shapes`` otherwise."""
    out = []
    for s in shapes.split(","):
        if not s.strip():
            continue
        parts = s.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {s.strip()!r} is not BxT (two positive ints joined by 'x')")
        out.append((int(parts[0]), int(parts[1])))
    if not out:
        raise ValueError("--shapes: no shape given")
    return out


def run(quick=False, out="results", shapes=None, impls=",".join(IMPLS), layouts="mha,gqa,mla",
        reps=None, doc_len=512) -> dict:
    """Time and check every impl, layout and shape; ``shapes`` / ``reps`` left ``None`` take the
    defaults (with ``quick``: one tiny shape, 2 reps)."""
    shape_list = _parse(shapes if shapes is not None else QUICK_SHAPES if quick else DEFAULT_SHAPES)
    reps = reps if reps is not None else QUICK_REPS if quick else DEFAULT_REPS
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"--reps: must be a positive int, got {reps!r}")
    impl_list = [i.strip() for i in impls.split(",") if i.strip()]
    layout_list = [l.strip() for l in layouts.split(",") if l.strip()]
    for i in impl_list:
        if i not in IMPLS:
            raise ValueError(f"--impls: unknown impl {i!r}; choose from {IMPLS}")
    for l in layout_list:
        if l not in LAYOUTS:
            raise ValueError(f"--layouts: unknown layout {l!r}; choose from {tuple(LAYOUTS)}")
    record = C.provenance(NAME, quick)
    record.update(shapes=shape_list, impls=impl_list, layouts=layout_list, reps=reps, doc_len=doc_len,
                  results=[], checks=[], skipped={})
    jobs = [(B, T, lay, s, i) for (B, T) in shape_list for lay in layout_list for s in (False, True) for i in impl_list]
    with C.progress(total=len(jobs), desc=NAME, unit="case") as bar:
        for B, T, lay, seg_on, impl in jobs:
            bar.set_postfix_str(f"{impl} {lay} {B}x{T}{' seg' if seg_on else ''}")
            q, k, v, do, seg = _inputs(jax.random.key(0), B, T, LAYOUTS[lay], jnp.bfloat16, doc_len if seg_on else 0)
            try:
                M.fused.resolve_impl("attention_bench", impl, q, k, v)
            except ValueError as e:
                record["skipped"][impl] = str(e)
                bar.update(1)
                continue
            try:
                f, g = _fns(impl, seg)
                fwd = C.timed_calls(f, (q, k, v), reps, warmup=2)
                bwd = C.timed_calls(g, (q, k, v, do), reps, warmup=2)
                H, Hk, K, Vd = LAYOUTS[lay]
                flops = 2 * B * H * T * T / 2 * (K + Vd)  # causal: half the score matrix
                res = {"impl": impl, "layout": lay, "batch": B, "seq_len": T, "segments": seg_on,
                       "fwd_ms": 1e3 * statistics.median(fwd), "fwd_bwd_ms": 1e3 * statistics.median(bwd)}
                res["fwd_tflops"] = flops / (res["fwd_ms"] * 1e-3) / 1e12
                res["fwd_bwd_tflops"] = 3.5 * flops / (res["fwd_bwd_ms"] * 1e-3) / 1e12
            except Exception as e:
                traceback.print_exc()
                res = {"impl": impl, "layout": lay, "batch": B, "seq_len": T, "segments": seg_on,
                       "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            record["results"].append(res)
            bar.update(1)
    checks = [(impl, lay, seg_on) for impl in impl_list if impl not in record["skipped"]
              for lay in layout_list for seg_on in (False, True)]
    for impl, lay, seg_on in C.progress(checks, desc=f"{NAME} checks", unit="check"):  # each compiles: seconds
        try:
            record["checks"].append({"impl": impl, "layout": lay, "segments": seg_on,
                                     **check(impl, lay, seg_on)})
        except Exception as e:
            record["checks"].append({"impl": impl, "layout": lay, "segments": seg_on,
                                     "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return C.finish(record, NAME, out, plot(record))


def plot(record):
    import matplotlib.pyplot as plt

    ok = [r for r in record["results"] if "fwd_bwd_ms" in r]
    labels = sorted({(r["batch"], r["seq_len"], r["layout"], r["segments"]) for r in ok})
    impls = [i for i in record["impls"] if any(r["impl"] == i for r in ok)]  # a skipped impl draws no bars
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) * len(impls)), 4))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        ys = []
        for lab in labels:
            hit = [r for r in ok if r["impl"] == impl and (r["batch"], r["seq_len"], r["layout"], r["segments"]) == lab]
            ys.append(hit[0]["fwd_bwd_ms"] if hit else 0.0)
        ax.bar([j + i * width for j in range(len(labels))], ys, width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels([f"{b}x{t}\n{l}{' seg' if s else ''}" for b, t, l, s in labels], fontsize=7)
    ax.set_ylabel("forward + backward, ms")
    ax.set_title(f"softmax_attention by impl ({record['device']['description']})")
    ax.legend()
    return fig


def table(record):
    rows = [[r["impl"], r["layout"], f"{r['batch']}x{r['seq_len']}", "yes" if r["segments"] else "no",
             r.get("fwd_ms", "-"), r.get("fwd_bwd_ms", "-"), r.get("fwd_bwd_tflops", r.get("error", "-"))]
            for r in record["results"]]
    t = C.format_table(["impl", "layout", "shape", "segments", "fwd ms", "fwd+bwd ms", "fwd+bwd TFLOP/s"], rows,
                       title=f"{NAME} on {record['device']['description']}")
    checks = [[c["impl"], c["layout"], "yes" if c["segments"] else "no",
               *(c.get(n, c.get("error", "-")) for n in ("o", "dq", "dk", "dv"))] for c in record["checks"]]
    t += "\n\n" + C.format_table(["impl", "layout", "segments", "o", "dq", "dk", "dv"], checks,
                                 title="relative error vs the float32 reference (bf16 inputs)")
    for impl, why in record["skipped"].items():
        t += f"\nskipped {impl}: {why}"
    return t


def main(argv=None):
    p = C.make_parser(NAME, __doc__.split("\n")[0], quick_help=(
        f"a CPU smoke run (seconds to a minute): --shapes {QUICK_SHAPES} --reps {QUICK_REPS}, each only where the "
        f"option is left unset"))
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated BxT (default: {DEFAULT_SHAPES}; --quick: {QUICK_SHAPES})")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated from {', '.join(IMPLS)} (default: all)")
    p.add_argument("--layouts", default="mha,gqa,mla", help="comma-separated from mha, gqa, mla (default: all)")
    p.add_argument("--reps", type=C.positive_int, default=None,
                   help=f"timed calls per case, the median reported (default: {DEFAULT_REPS}; --quick: {QUICK_REPS})")
    p.add_argument("--doc-len", dest="doc_len", type=C.positive_int, default=512,
                   help="mean document length of the packed cases (default: 512)")
    return C.main_for(NAME, p, run, table, argv)


if __name__ == "__main__":
    main()
