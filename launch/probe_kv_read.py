"""How fast does one decode step read a KV cache? Three ways to read the same cache, timed.

    python launch/probe_kv_read.py [--context 1048576] [--heads 16] [--head-dim 128]
        [--batch 1] [--dtype bfloat16] [--steps 20] [--out DIR]    # DIR/kv_read.json

A question for the device, not an experiment: ``experiments.decode_scaling`` found MHA's decode
step at 1M tokens reading its cache at ~7% of the H200's bandwidth (docs/results.md, "How far
from the roofline"). One suspect: the library's cache is ``[B, L, Hkv, D]`` and a decode step is
a product per ``(b, h)`` — batch dims that are not the cache's leading dims — so XLA may
transpose the whole K and V into new buffers every step. This times, on one layer's cache:

* ``library``: ``memory.softmax_attention_step`` (``[B, L, H, D]``, write then read, einsum);
* ``heads_major``: the same math on a ``[B, H, L, D]`` cache (the per-head products need no
  transpose);
* ``reduce``: the ``[B, L, H, D]`` cache read by multiply-and-reduce fusions (no ``dot_general``).

Each row: median ms per step (cache donated, ``steps`` after 3 warm-up steps), the bytes a step
must read (K + V), the read rate in GB/s, and the compiled step's temporaries (XLA memory
analysis) against the cache. On the 2-core CPU (2026-11-30, this script at commit 78d0e1a's tree,
``--context 65536 --heads 4 --head-dim 64 --steps 5``): float32 library 51 ms, heads_major 116 ms,
reduce 469 ms; bfloat16 69 / 86 / 492 ms — the library's read is fastest there, while the bare
per-head products alone were ~10x faster heads-major (a scratch einsum timing). XLA:CPU does not
answer the GPU question.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from lineage_jax import memory


def _library(q, k_t, v_t, cache):
    o, cache = memory.softmax_attention_step(q, k_t, v_t, cache)
    return o, cache


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


def _reduce(q, k_t, v_t, cache):
    """The library's ``[B, L, H, D]`` cache, read by multiply-and-reduce (no dot_general)."""
    k, v, length = cache.k, cache.v, cache.length
    B, L, H, D = k.shape
    rows = jnp.arange(B)
    k = k.at[rows, length].set(k_t.astype(k.dtype))
    v = v.at[rows, length].set(v_t.astype(v.dtype))
    qs = (q * D ** -0.5).astype(k.dtype).astype(jnp.float32)
    s = jnp.sum(qs[:, None] * k.astype(jnp.float32), axis=-1)  # [B, L, H]
    s = jnp.where(jnp.arange(L)[None, :, None] <= length[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=1).astype(v.dtype).astype(jnp.float32)
    o = jnp.sum(p[..., None] * v.astype(jnp.float32), axis=1)  # [B, H, D]
    return o, memory.KVCache(k, v, length + 1)


def _cache(kind: str, B: int, L: int, H: int, D: int, dtype, writes: int):
    length = jnp.full((B,), L - writes, jnp.int32)  # the last timed step fills the last slot
    if kind == "heads_major":
        z = jnp.zeros((B, H, L, D), dtype)
        return (z, jnp.zeros_like(z), length)
    return memory.KVCache(jnp.zeros((B, L, H, D), dtype), jnp.zeros((B, L, H, D), dtype), length)


FORMS = {"library": _library, "heads_major": _heads_major, "reduce": _reduce}


DTYPES = ("bfloat16", "float16", "float32")


def run(context: int, heads: int, head_dim: int, batch: int, dtype: str, steps: int) -> list[dict]:
    for name, val in (("context", context), ("heads", heads), ("head_dim", head_dim), ("batch", batch)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name}: must be a positive int, got {val!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
    dt = jnp.dtype(dtype)
    if steps < 1 or context <= steps + 3:
        raise ValueError(f"steps / context: need steps >= 1 and context > steps + 3 (warm-up), "
                         f"got {steps} / {context}")
    key = jax.random.key(0)
    q, k_t, v_t = (jax.random.normal(k, (batch, heads, head_dim), jnp.float32) for k in jax.random.split(key, 3))
    out = []
    ref = None
    for name, fn in FORMS.items():
        cache = _cache(name, batch, context, heads, head_dim, dt, writes=3 + steps)
        step = jax.jit(fn, donate_argnums=3)
        compiled = step.lower(q, k_t, v_t, cache).compile()
        mem = compiled.memory_analysis()
        temp = None if mem is None else int(mem.temp_size_in_bytes)
        times = []
        for i in range(3 + steps):
            t0 = time.perf_counter()
            o, cache = compiled(q, k_t, v_t, cache)
            jax.block_until_ready(o)
            if i == 0:
                first = np.asarray(o, np.float32)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        ms = 1e3 * float(np.median(times))
        read = 2 * batch * context * heads * head_dim * dt.itemsize
        ref = first if ref is None else ref
        out.append({"form": name, "ms_per_step": ms, "bytes_read": read, "read_gb_per_s": read / ms / 1e6,
                    "temp_bytes": temp, "max_abs_diff_vs_library": float(np.max(np.abs(first - ref)))})
        del cache
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1 << 20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None, help="also write the rows to OUT/kv_read.json (launch/device_jobs.sh "
                                                "passes --out $RESULTS)")
    a = p.parse_args(argv)
    try:
        rows = run(a.context, a.heads, a.head_dim, a.batch, a.dtype, a.steps)
    except ValueError as err:
        p.error(str(err))
    print(f"KV read, one layer: B={a.batch}, L={a.context}, H={a.heads}, D={a.head_dim}, {a.dtype}; {jax.devices()[0]}")
    print(f"{'form':12s} {'ms/step':>9s} {'GB/s read':>10s} {'temp/cache':>11s} {'max|diff|':>10s}")
    for r in rows:
        temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / r['bytes_read']:.2f}x"
        print(f"{r['form']:12s} {r['ms_per_step']:9.3f} {r['read_gb_per_s']:10.0f} {temp:>11s} "
              f"{r['max_abs_diff_vs_library']:10.2e}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "kv_read.json"), "w") as f:
            json.dump({"args": vars(a), "device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f,
                      indent=1)
    return rows


if __name__ == "__main__":
    main()
