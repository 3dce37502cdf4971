"""How fast does one decode step read a KV cache? The ways to read the same cache, timed.

    python -m experiments.kv_read [--quick] [--context 1048576] [--heads 16] [--head-dim 128]
        [--kv-heads H] [--batch 1] [--dtype bfloat16] [--steps 20] [--mla-rank 512] [--mla-rope 64]
        [--out DIR]    # writes DIR/kv_read/kv_read.{json,png} (default DIR: results)

A microbenchmark of one layer: ``experiments.decode_scaling`` found MHA's decode
step at 1M tokens reading its cache at ~7% of the H200's bandwidth (docs/results.md,
"Decode scaling"). The library's cache is ``[B, L, Hkv, D]`` and a decode step is a product
per ``(b, h)`` — batch dims that are not the cache's leading dims. This times, on one layer:

* ``dot``: ``memory.softmax_attention_step(..., read="dot")`` (einsum / ``dot_general``);
* ``heads_major``: the same math on a ``[B, H, L, D]`` cache (the per-head products need no
  transpose; only without GQA);
* ``reduce``: ``read="reduce"``, the ``[B, L, H, D]`` cache read by multiply-and-reduce fusions;
* ``mla_dot`` / ``mla_reduce``: MLA's absorbed read of a ``[B, L, C]`` latent + ``[B, L, R]``
  rope-key cache (``layers.mla.MLA.decode``), by ``memory.cache_read`` in each form.

Each row: median ms per step (cache donated, ``steps`` after 3 warm-up steps), the bytes a step
must read (each cached byte once: MLA's latent is read twice, for scores and values, so its
GB/s understate the traffic), the read rate in GB/s, the compiled step's temporaries (XLA memory analysis) against
the cache, and the first step's largest difference from the family's ``dot`` row.

Measured (one H200, 2026-11-30, jax 0.11.2, defaults; record ``docs/results/kv_read_h200.json``,
docs/results.md), dot / heads_major / reduce: 19.21 / 12.20 / 2.36 ms, i.e. 447 / 704 / 3634 GB/s;
the einsum forms held a temporary as large as the cache (XLA:GPU copied K and V every step), the
reduce form 0.01x; MLA's read: mla_dot 0.94 ms (1292 GB/s), mla_reduce 9.12 ms (132 GB/s). That is why
``read="auto"`` means ``"reduce"`` on GPUs only when each cached element meets one query
(``memory.resolve_read``); ``--kv-heads`` measures the grouped-query reads in between. On a 2-core CPU
(``--context 65536 --heads 4 --head-dim 64 --steps 5``): float32 dot 51 ms, heads_major 116,
reduce 469 — the reverse, hence ``"dot"`` on CPUs. ``--quick`` runs those sizes (float32; MLA 128 +
32) for the options left unset: under a minute on 2 CPU cores.

As every experiment, it writes the record (provenance, arguments, rows) to
``<out>/kv_read/kv_read.json`` and a bar chart of the read rates to ``<out>/kv_read/kv_read.png``
(``--out``, default ``results``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common as C
from lineage_jax import memory

NAME = "kv_read"


def _dot(q, k_t, v_t, cache):
    return memory.softmax_attention_step(q, k_t, v_t, cache, read="dot")


def _reduce(q, k_t, v_t, cache):
    return memory.softmax_attention_step(q, k_t, v_t, cache, read="reduce")


def _heads_major(q, k_t, v_t, cache):
    """``cache = (k [B, H, L, D], v [B, H, L, D], length [B])``: write the row, then read."""
    k, v, length = cache
    B, H, L, D = k.shape
    rows = jnp.arange(B)
    k = k.at[rows, :, length].set(k_t.astype(k.dtype))
    v = v.at[rows, :, length].set(v_t.astype(v.dtype))
    s = jnp.einsum("bhd,bhld->bhl", (q * D ** -0.5).astype(k.dtype), k, preferred_element_type=jnp.float32)
    s = jnp.where(jnp.arange(L)[None, None] <= length[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhl,bhld->bhd", p, v, preferred_element_type=jnp.float32)
    return o, (k, v, length + 1)


def _mla(read):
    """MLA's absorbed decode read (``layers.mla.MLA.decode``): ``cache = (latent [B, L, C],
    k_rope [B, L, R], length)``; ``q [B, H, C + R]`` is the absorbed latent query and the rope
    query, ``k_t [B, 1, C + R]`` the new token's latent and rope key (``v_t`` unused)."""
    def step(q, k_t, v_t, cache):
        latent, k_rope, length = cache
        B, L, C = latent.shape
        R = k_rope.shape[-1]
        rows = jnp.arange(B)
        latent = latent.at[rows, length].set(k_t[:, 0, :C].astype(latent.dtype))
        k_rope = k_rope.at[rows, length].set(k_t[:, 0, C:C + R].astype(k_rope.dtype))
        s = (memory.cache_read("bhc,blc->bhl", q[..., :C], latent, read=read)
             + memory.cache_read("bhr,blr->bhl", q[..., C:C + R], k_rope, read=read)) * (C + R) ** -0.5
        s = jnp.where(jnp.arange(L)[None, None] <= length[:, None, None], s, -jnp.inf)
        o = memory.cache_read("bhl,blc->bhc", jax.nn.softmax(s, axis=-1), latent, read=read)
        return o, (latent, k_rope, length + 1)
    return step


def _cache(kind: str, B: int, L: int, H: int, D: int, dtype, writes: int, mla=(512, 64)):
    length = jnp.full((B,), L - writes, jnp.int32)  # the last timed step fills the last slot
    if kind.startswith("mla"):
        return (jnp.zeros((B, L, mla[0]), dtype), jnp.zeros((B, L, mla[1]), dtype), length)
    if kind == "heads_major":
        z = jnp.zeros((B, H, L, D), dtype)
        return (z, jnp.zeros_like(z), length)
    return memory.KVCache(jnp.zeros((B, L, H, D), dtype), jnp.zeros((B, L, H, D), dtype), length)


FORMS = {"dot": _dot, "heads_major": _heads_major, "reduce": _reduce,
         "mla_dot": _mla("dot"), "mla_reduce": _mla("reduce")}


DTYPES = ("bfloat16", "float16", "float32")


def run(context: int, heads: int, head_dim: int, batch: int, dtype: str, steps: int,
        mla_rank: int = 512, mla_rope: int = 64, kv_heads: Optional[int] = None) -> list[dict]:
    kv_heads = heads if kv_heads is None else kv_heads
    for name, val in (("context", context), ("heads", heads), ("head_dim", head_dim), ("batch", batch),
                      ("mla_rank", mla_rank), ("mla_rope", mla_rope), ("kv_heads", kv_heads)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name}: must be a positive int, got {val!r}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: must divide heads ({heads}), got {kv_heads}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
    dt = jnp.dtype(dtype)
    if steps < 1 or context <= steps + 3:
        raise ValueError(f"steps / context: need steps >= 1 and context > steps + 3 (warm-up), "
                         f"got {steps} / {context}")
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
    mha_in = (jax.random.normal(k1, (batch, heads, head_dim), jnp.float32),
              *(jax.random.normal(k, (batch, kv_heads, head_dim), jnp.float32) for k in (k2, k3)))
    mla_in = (jax.random.normal(k4, (batch, heads, mla_rank + mla_rope), jnp.float32),
              jax.random.normal(k5, (batch, 1, mla_rank + mla_rope), jnp.float32), mha_in[2])
    out = []
    refs = {}
    forms = [f for f in FORMS if f != "heads_major" or kv_heads == heads]  # heads_major: one kv head per query head
    for name in C.progress(forms, desc=NAME, unit="form"):
        fn = FORMS[name]
        family = "mla" if name.startswith("mla") else "mha"
        args = mla_in if family == "mla" else mha_in
        cache = _cache(name, batch, context, kv_heads, head_dim, dt, writes=3 + steps, mla=(mla_rank, mla_rope))
        step = jax.jit(fn, donate_argnums=3)
        compiled = step.lower(*args, cache).compile()
        mem = compiled.memory_analysis()
        temp = None if mem is None else int(mem.temp_size_in_bytes)
        times = []
        for i in range(3 + steps):
            t0 = time.perf_counter()
            o, cache = compiled(*args, cache)
            jax.block_until_ready(o)
            if i == 0:
                first = np.asarray(o, np.float32)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        ms = 1e3 * float(np.median(times))
        per_token = (mla_rank + mla_rope) if family == "mla" else 2 * kv_heads * head_dim
        read = batch * context * per_token * dt.itemsize
        ref = refs.setdefault(family, first)
        out.append({"form": name, "ms_per_step": ms, "bytes_read": read, "read_gb_per_s": read / ms / 1e6,
                    "temp_bytes": temp, "max_abs_diff_vs_dot": float(np.max(np.abs(first - ref)))})
        del cache
    return out


# The sizes of a run and of a ``--quick`` one (the options left unset take these).
DEFAULTS = dict(context=1 << 20, heads=16, head_dim=128, dtype="bfloat16", steps=20, mla_rank=512, mla_rope=64)
QUICK = dict(context=65536, heads=4, head_dim=64, dtype="float32", steps=5, mla_rank=128, mla_rope=32)


def plot(record: dict):
    """A bar chart of each form's read rate (GB/s), one colour per family."""
    import matplotlib.pyplot as plt

    rows = record["rows"]
    fig, ax = plt.subplots(figsize=(7, 0.45 * max(1, len(rows)) + 1.5))
    ax.barh(range(len(rows)), [r["read_gb_per_s"] for r in rows],
            color=["C1" if r["form"].startswith("mla") else "C0" for r in rows])
    ax.set_yticks(range(len(rows)), [f"{r['form']} ({r['ms_per_step']:.3g} ms)" for r in rows])
    ax.invert_yaxis()
    a = record["args"]
    ax.set_xlabel("cache read rate, GB/s (bytes a step must read / median step time)")
    ax.set_title(f"KV read, one layer: B={a['batch']}, L={a['context']}, H={a['heads']}, "
                 f"Hkv={a['kv_heads'] or a['heads']}, D={a['head_dim']}, {a['dtype']} "
                 f"({record['device']['description']})", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog=f"python -m experiments.{NAME}", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="CPU sizes for the options left unset: " + " ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + " (under a minute on 2 CPU cores); options given explicitly keep their values")
    p.add_argument("--context", type=C.positive_int, default=None,
                   help=f"cache length L in tokens (default: {DEFAULTS['context']}; --quick: {QUICK['context']})")
    p.add_argument("--heads", type=C.positive_int, default=None,
                   help=f"query heads H (default: {DEFAULTS['heads']}; --quick: {QUICK['heads']})")
    p.add_argument("--head-dim", type=C.positive_int, default=None,
                   help=f"head width D (default: {DEFAULTS['head_dim']}; --quick: {QUICK['head_dim']})")
    p.add_argument("--kv-heads", type=C.positive_int, default=None,
                   help="key/value heads (default: --heads; fewer = GQA, each cached head read by heads/kv_heads "
                        "queries)")
    p.add_argument("--batch", type=C.positive_int, default=1, help="batch B (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help=f"cache dtype (default: {DEFAULTS['dtype']}; --quick: {QUICK['dtype']})")
    p.add_argument("--steps", type=C.positive_int, default=None,
                   help=f"timed decode steps per form, after 3 warm-up steps (default: {DEFAULTS['steps']}; "
                        f"--quick: {QUICK['steps']})")
    p.add_argument("--mla-rank", type=C.positive_int, default=None,
                   help=f"MLA latent width C (the mla_* rows; default: {DEFAULTS['mla_rank']}; "
                        f"--quick: {QUICK['mla_rank']})")
    p.add_argument("--mla-rope", type=C.positive_int, default=None,
                   help=f"MLA rope key width R (the mla_* rows; default: {DEFAULTS['mla_rope']}; "
                        f"--quick: {QUICK['mla_rope']})")
    p.add_argument("--out", default="results", metavar="DIR",
                   help="write the record to DIR/kv_read/kv_read.json and the chart to DIR/kv_read/kv_read.png "
                        "(default: %(default)s)")
    a = p.parse_args(argv)
    for key, value in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    for path in (a.out, os.path.join(a.out, NAME)):
        if os.path.exists(path) and not os.path.isdir(path):
            p.error(f"--out: {path!r} exists and is not a directory")
    try:
        rows = run(a.context, a.heads, a.head_dim, a.batch, a.dtype, a.steps, a.mla_rank, a.mla_rope, a.kv_heads)
    except ValueError as err:
        p.error(str(err))
    print(f"KV read, one layer: B={a.batch}, L={a.context}, H={a.heads}, Hkv={a.kv_heads or a.heads}, D={a.head_dim}, "
          f"{a.dtype}; {jax.devices()[0]}")
    print(f"{'form':12s} {'ms/step':>9s} {'GB/s read':>10s} {'temp/cache':>11s} {'max|diff|':>10s}")
    for r in rows:
        temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / r['bytes_read']:.2f}x"
        print(f"{r['form']:12s} {r['ms_per_step']:9.3f} {r['read_gb_per_s']:10.0f} {temp:>11s} "
              f"{r['max_abs_diff_vs_dot']:10.2e}")
    record = dict(C.provenance(NAME, a.quick), args=vars(a), rows=rows)
    record = C.finish(record, NAME, a.out, plot(record))
    print(f"\nwrote {record['files']['json']} and {record['files']['png']}")
    return rows


if __name__ == "__main__":
    main()
