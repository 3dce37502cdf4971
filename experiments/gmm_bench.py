"""The MoE experts' grouped matmul: every implementation of ``layers.grouped.grouped_matmul``, timed and checked.

For each shape (``tokens x top_k`` routed rows over ``experts`` groups, ``d_model -> hidden``: one
expert up-projection of the MoE layer) it times the forward and the forward + backward (``dx`` and
``dw``) of each ``impl`` (``ragged_dot``, ``tiled``, ``pallas``; bf16 inputs, median of ``--reps``
synchronized calls after a warm-up) beside one dense matmul with the same FLOPs (``[rows, d] x [d,
hidden]``: the speed a grouped matmul can at best reach), with rows routed to experts uniformly at
random (so group sizes vary as a trained router's do). On the first shape it reports each impl's
error in the output and both gradients against ``jax.lax.ragged_dot`` in float32. Implementations
that cannot run on this backend, or do not fit, are reported with the reason.

Usage::

    python -m experiments.gmm_bench                                # the train_bench MoE row's shape
    python -m experiments.gmm_bench --shapes 16384x8x64x2048x624 --impls tiled,pallas
    python -m experiments.gmm_bench --quick                        # a CPU smoke run
"""

from __future__ import annotations

import statistics
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common as C
from lineage_jax.layers.grouped import GROUPED_MATMUL_IMPLS, grouped_matmul

NAME = "gmm_bench"
IMPLS = tuple(i for i in GROUPED_MATMUL_IMPLS if i != "auto")
# tokens x top_k x experts x d_model x hidden: train_bench's MoE row at batch 4 x 4096
DEFAULT_SHAPES = "16384x8x64x2048x624"
DEFAULT_REPS = 10
QUICK_SHAPES, QUICK_REPS = "64x2x4x64x48", 2  # --quick, for the options left unset


def _parse(shapes: str) -> list[tuple[int, ...]]:
    out = []
    for s in shapes.split(","):
        if not s.strip():
            continue
        parts = s.strip().split("x")
        if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {s!r} is not tokens x top_k x experts x d_model x hidden "
                             f"(five positive ints joined by 'x')")
        out.append(tuple(int(p) for p in parts))
    if not out:
        raise ValueError("--shapes: no shape given")
    return out


def _inputs(key, tokens, top_k, experts, d, hidden, dtype):
    ks = jax.random.split(key, 4)
    rows = tokens * top_k
    expert = jax.random.randint(ks[0], (rows,), 0, experts)
    sizes = jnp.bincount(expert, length=experts).astype(jnp.int32)
    x = jax.random.normal(ks[1], (rows, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(ks[2], (experts, d, hidden), jnp.float32) * d ** -0.5).astype(dtype)
    dy = jax.random.normal(ks[3], (rows, hidden), jnp.float32).astype(dtype)
    return x, w, sizes, dy


def _fns(impl):
    if impl == "dense":
        f = jax.jit(lambda x, w, s: jnp.dot(x, w[0], preferred_element_type=jnp.float32).astype(x.dtype))
    else:
        f = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl=impl))

    def loss(x, w, s, dy):
        return jnp.sum(f(x, w, s).astype(jnp.float32) * dy.astype(jnp.float32))

    return f, jax.jit(jax.grad(loss, argnums=(0, 1)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check(impl: str, shape: tuple[int, ...]) -> dict:
    """Relative error of ``impl``'s output and gradients against ``ragged_dot`` in float32 (highest precision),
    on a scaled-down copy of ``shape`` (the same group count; a few rows per group)."""
    tokens, top_k, experts, d, hidden = shape
    small = (min(tokens, 8 * experts), top_k, experts, min(d, 256), min(hidden, 200))
    x, w, sizes, dy = _inputs(jax.random.key(1), *small, jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref_f, ref_g = _fns("ragged_dot")
        f, g = _fns(impl)
        y, (dx, dw) = f(x, w, sizes), g(x, w, sizes, dy)
        y0, (dx0, dw0) = ref_f(x, w, sizes), ref_g(x, w, sizes, dy)
    return {"y": _rel(y, y0), "dx": _rel(dx, dx0), "dw": _rel(dw, dw0)}


def run(quick=False, out="results", shapes=None, impls=",".join(IMPLS), reps=None) -> dict:
    """Time and check every impl at every shape; ``shapes`` / ``reps`` left ``None`` take the defaults
    (with ``quick``: one tiny shape, 2 reps)."""
    impl_list = [i.strip() for i in impls.split(",") if i.strip()]
    for i in impl_list:
        if i not in IMPLS:
            raise ValueError(f"--impls: unknown impl {i!r}; choose from {IMPLS}")
    shape_list = _parse(shapes if shapes is not None else QUICK_SHAPES if quick else DEFAULT_SHAPES)
    reps = reps if reps is not None else QUICK_REPS if quick else DEFAULT_REPS
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"--reps: must be a positive int, got {reps!r}")
    record = C.provenance(NAME, quick)
    record.update(shapes=shape_list, impls=impl_list, reps=reps, results=[], checks=[])
    jobs = [(s, i) for s in shape_list for i in ("dense",) + tuple(impl_list)]
    with C.progress(total=len(jobs), desc=NAME, unit="case") as bar:
        for shape, impl in jobs:
            tokens, top_k, experts, d, hidden = shape
            bar.set_postfix_str(f"{impl} {'x'.join(map(str, shape))}")
            res = {"impl": impl, "tokens": tokens, "top_k": top_k, "experts": experts, "d_model": d, "hidden": hidden}
            try:
                x, w, sizes, dy = _inputs(jax.random.key(0), *shape, jnp.bfloat16)
                f, g = _fns(impl)
                fwd = C.timed_calls(f, (x, w, sizes), reps, warmup=2)
                both = C.timed_calls(g, (x, w, sizes, dy), reps, warmup=2)
                flops = 2.0 * tokens * top_k * d * hidden
                res.update(fwd_ms=1e3 * statistics.median(fwd), fwd_bwd_ms=1e3 * statistics.median(both))
                res["fwd_tflops"] = flops / (res["fwd_ms"] * 1e-3) / 1e12
                res["fwd_bwd_tflops"] = 3 * flops / (res["fwd_bwd_ms"] * 1e-3) / 1e12
                del x, w, sizes, dy
            except Exception as e:  # an impl that cannot run here (or does not fit) is reported, not fatal
                traceback.print_exc()
                res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            record["results"].append(res)
            bar.update(1)
    for impl in impl_list:
        try:
            record["checks"].append({"impl": impl, **check(impl, shape_list[0])})
        except Exception as e:
            record["checks"].append({"impl": impl, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    dense = {tuple(r[k] for k in ("tokens", "top_k", "experts", "d_model", "hidden")): r.get("fwd_bwd_ms")
             for r in record["results"] if r["impl"] == "dense"}
    for r in record["results"]:
        base = dense.get(tuple(r[k] for k in ("tokens", "top_k", "experts", "d_model", "hidden")))
        if base and "fwd_bwd_ms" in r:
            r["vs_dense"] = base / r["fwd_bwd_ms"]
    return C.finish(record, NAME, out, plot(record))


def plot(record):
    import matplotlib.pyplot as plt

    ok = [r for r in record["results"] if "fwd_bwd_ms" in r]
    fig, ax = plt.subplots(figsize=(7, 0.5 * max(1, len(ok)) + 1.5))
    labels = [f"{r['impl']}  {r['tokens']}x{r['top_k']} over {r['experts']}, {r['d_model']}->{r['hidden']}" for r in ok]
    ax.barh(range(len(ok)), [r["fwd_bwd_ms"] for r in ok], color=["C7" if r["impl"] == "dense" else "C0" for r in ok])
    ax.set_yticks(range(len(ok)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("forward + backward (dx, dw), ms; grey: a dense matmul of the same FLOPs")
    ax.set_title(f"grouped matmul by impl ({record['device']['description']})")
    fig.tight_layout()
    return fig


def table(record):
    rows = [[r["impl"], f"{r['tokens']}x{r['top_k']}/{r['experts']} {r['d_model']}->{r['hidden']}",
             r.get("fwd_ms", "-"), r.get("fwd_bwd_ms", "-"), r.get("fwd_bwd_tflops", "-"),
             f"{r['vs_dense']:.2f}x" if "vs_dense" in r else r.get("error", "-")] for r in record["results"]]
    t = C.format_table(["impl", "rows/experts d->hidden", "fwd ms", "fwd+bwd ms", "TFLOP/s", "vs dense"], rows,
                       title=f"{NAME} on {record['device']['description']}")
    checks = [[c["impl"], *(c.get(n, c.get("error", "-")) for n in ("y", "dx", "dw"))] for c in record["checks"]]
    t += "\n\n" + C.format_table(["impl", "y", "dx", "dw"], checks,
                                 title="relative error vs jax.lax.ragged_dot (float32, highest precision)")
    return t


def main(argv=None):
    p = C.make_parser(NAME, __doc__.split("\n")[0], quick_help=(
        f"a CPU smoke run (seconds): --shapes {QUICK_SHAPES} --reps {QUICK_REPS}, each only where the option is "
        f"left unset"))
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated tokens x top_k x experts x d_model x hidden (default: {DEFAULT_SHAPES}; "
                        f"--quick: {QUICK_SHAPES})")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated from {', '.join(IMPLS)} (default: all)")
    p.add_argument("--reps", type=C.positive_int, default=None,
                   help=f"timed calls per case, the median reported (default: {DEFAULT_REPS}; --quick: {QUICK_REPS})")
    return C.main_for(NAME, p, run, table, argv)


if __name__ == "__main__":
    main()
