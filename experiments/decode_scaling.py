"""Decode cost vs context: per-token latency and cache memory from 1K to 1M tokens.

    python -m experiments.decode_scaling [--quick] [--out results] [--only mha,mla,kda,hybrid]
        [--contexts 1024,...] [--layers 4] [--device-memory-gb G] [--max-batch N]

**Architectures** at one matched width (d_model 2048, 16 heads × 128, SwiGLU FFN 5632,
vocab 32768, **4 layers**), differing only in the token mixer:

* ``mha``    — ``SSSS``: softmax MHA, a K and a V per head and token (8 KB/token/layer in bf16);
* ``mla``    — ``MMMM``: MLA (latent 512 + shared rope key 64: 1.15 KB/token/layer), NoPE;
* ``kda``    — ``KKKK``: Kimi Delta Attention, a fixed fp32 state of 16 × 128 × 128 per layer;
* ``hybrid`` — ``KKKM``: Kimi Linear's 3:1 KDA:MLA interleave.

**Memory**: the decode cache is allocated at the target context (bf16 caches and conv
buffers, fp32 states) and its bytes are *measured* (the sum of the allocated leaves'
``nbytes``), then compared with :mod:`lineage_jax.accounting`'s prediction
``B · (cache_bytes_per_token · T + state_bytes + conv buffers)`` plus the ``int32`` fill
counters (one per growing cache and the decoder's own); the two must agree exactly.

**Latency**: prefilling 1M tokens is not cheap, and not needed — a decode step has no
data-dependent control flow, so its time does not depend on what the cache holds. The cache
is therefore built directly at the target context (zeros, with every fill counter set) and
jitted decode steps (cache donated, so updated in place) are timed: the median of
``steps`` wall-clock steps after ``warmup`` (each ``block_until_ready``). The library's
decode reads every slot of the preallocated cache under a mask, so a step costs the same
at any fill; the counters start at ``T − warmup − steps`` so the last timed token is the
``T``-th. Each architecture runs at **batch 1** and at the **batch that fills the device**:
the largest ``B`` with ``B · (cache bytes per sequence) ≤ fill_fraction · memory − weights``,
capped at ``max_batch`` (memory: the allocator's ``bytes_limit`` from
``memory_stats()``, else ``--device-memory-gb``; on GPUs JAX reserves 75 % of HBM unless
``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise). The step is then compiled ahead
(nothing allocated) and XLA's memory analysis gives its *workspace* — what the step
allocates beyond its arguments (scores, probabilities, the new cache row);
if cache + workspace do not fit,
the batch is cut until they do (``cache_fit_batch`` vs ``batch``; the row says why). A
context whose cache does not fit even at batch 1 is recorded as "does not fit". At the fill
batch the reported per-token time is the step time divided by the batch (inverse throughput).

**Layers unscanned** (``scan_layers=False``, every row): each layer keeps its cache in its own
buffer, as a serving stack does. With the layers scanned (the training default) the caches
are stacked along a layer axis and each decode step reads a layer's slice out of the stack
and writes it back whole — a copy of the cache per step that XLA does not remove (on the
H200, MHA at 1M tokens and batch 1 took 105.8 ms scanned; reading its 34 GB cache once takes
≈ 7 ms). On the CPU (2026-11-30, d 256, 4 heads × 64, bf16, 64K tokens, batch 1) unscanning
took MHA's step from 222 to 140 ms and MLA's from 18.3 to 13.9 ms; KDA's (0.95 → 1.11 ms) and
the hybrid's (3.2 ms) barely move.

**Read rate**: each measured point also reports ``read_gb_per_s`` = (the weights a step reads +
the whole cache) / step time — the least a step must read, so against the device's memory
bandwidth (H200: 4.8 TB/s) it says how close the step is to its roofline. A step reads every
weight but the untied embedding table, of which it gathers its batch's rows (the LM head is read
whole): :func:`weights_read`. ``--rederive RECORD.json ...`` recomputes a record's bytes read,
read rates and bytes-read ratios by this rule from its measured times.

**Kimi Linear's claim** (tech report, 2025): against full MLA attention at 1M tokens the 3:1
hybrid decodes with 6.3× lower time per output token when the freed memory is spent on
batch, and ≈2.2× at batch 1. Ours is printed next to it — at the longest context where both
architectures of a pair ran — for this script's 4-layer, dense, fp32-weight model (theirs: a
48B-parameter MoE, so weight reads dilute the cache's share).

**Budgets**: ``--quick``: d 64, 4 heads × 16, contexts 1K/4K/16K, batch 1 and a fill batch
capped at 4, 5 timed steps (CPU, ~1 min). Full: contexts 1K, 4K, 16K, 64K, 256K, 1M, fill
batch capped at 256, 20 timed steps — about 2–3 minutes on one H200 (≈ 40 small compiles;
the 1M MHA cache alone is 34 GB per sequence; if it and the decode's workspace do not fit,
the row says so). The "workspace/cache" column is the compiled step's temporaries against the
cache: softmax attention reads a bf16 cache without a float32 copy of it (``memory.cache_read``),
and in ``--quick`` on 2 CPU cores MHA's step takes 0.7–1.4× its cache in temporaries (XLA:CPU
computes bf16 dots in float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import common as C
from lineage_jax import accounting
from lineage_jax.memory import resolve_read
from lineage_jax.models import Decoder, ModelConfig, inference_steps

NAME = "decode_scaling"
# key -> (label, repeating unit of the layer pattern)
ARCHS = {
    "mha": ("MHA (softmax)", "S"),
    "mla": ("MLA", "M"),
    "kda": ("KDA", "K"),
    "hybrid": ("Kimi Linear 3:1 (KKKM)", "KKKM"),
}
MODES = ("batch1", "fill")
# Kimi Linear tech report: hybrid vs full-MLA time per output token at 1M tokens of context.
KIMI_REPORTED = {"batch1": 2.2, "fill": 6.3}


@dataclasses.dataclass(frozen=True)
class Budget:
    d_model: int
    num_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    ffn_hidden: int
    vocab: int
    layers: int
    contexts: tuple[int, ...]
    steps: int  # timed decode steps per point
    warmup: int
    max_batch: int  # cap of the device-filling batch
    fill_fraction: float  # of device memory (after the weights) the caches may take
    fallback_memory_gb: Optional[float]  # used when the backend reports no memory limit
    dtype: str = "bfloat16"  # activations and caches (weights stay float32, states float32)


QUICK = Budget(d_model=64, num_heads=4, head_dim=16, kv_lora_rank=32, qk_rope_head_dim=8, ffn_hidden=192, vocab=256,
               layers=4, contexts=(1 << 10, 1 << 12, 1 << 14), steps=5, warmup=2, max_batch=4, fill_fraction=0.9,
               fallback_memory_gb=2.0)
FULL = Budget(d_model=2048, num_heads=16, head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, ffn_hidden=5632,
              vocab=32768, layers=4, contexts=tuple(1 << e for e in range(10, 21, 2)), steps=20, warmup=3,
              max_batch=256, fill_fraction=0.9, fallback_memory_gb=None)


def make_budget(quick: bool, contexts=None, layers=None, steps=None, max_batch=None) -> Budget:
    b = QUICK if quick else FULL
    b = dataclasses.replace(b, contexts=tuple(int(c) for c in (contexts or b.contexts)), layers=layers or b.layers,
                            steps=steps or b.steps, max_batch=max_batch or b.max_batch)
    if b.layers % 4:
        raise ValueError(f"layers: must be a multiple of 4 (the hybrid's KKKM unit), got {b.layers}")
    if b.steps < 1 or b.max_batch < 1:
        raise ValueError(f"steps / max_batch: must be >= 1, got {b.steps} / {b.max_batch}")
    too_short = [c for c in b.contexts if c <= b.warmup + b.steps]
    if too_short or not b.contexts:
        raise ValueError(f"contexts: need at least one, each > warmup + steps = {b.warmup + b.steps} "
                         f"(the timed tokens fill the last slots), got {list(b.contexts)}")
    return dataclasses.replace(b, contexts=tuple(sorted(set(b.contexts))))


def model_config(key: str, b: Budget) -> ModelConfig:
    label, unit = ARCHS[key]
    return ModelConfig(name=label, vocab_size=b.vocab, d_model=b.d_model, pattern=unit * (b.layers // len(unit)),
                       num_heads=b.num_heads, head_dim=b.head_dim, ffn_hidden=b.ffn_hidden,
                       kv_lora_rank=b.kv_lora_rank, qk_nope_head_dim=b.head_dim, qk_rope_head_dim=b.qk_rope_head_dim,
                       v_head_dim=b.head_dim, dtype=b.dtype, max_seq_len=max(b.contexts),
                       scan_layers=False)  # per-layer cache buffers, as a server keeps them (module doc)


# ----------------------------------------------------------------------------
# Memory: measured and predicted.
# ----------------------------------------------------------------------------
def tree_bytes(tree) -> int:
    """Bytes held by the arrays of a pytree (sum of ``nbytes``)."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


def predicted_cache_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int) -> dict:
    """The decode cache of ``batch`` sequences with room for ``context`` tokens, from the accountant.

    ``growing``: K/V and MLA latents (``cache_bytes_per_token``); ``state``: fp32 recurrent
    states; ``conv``: the short-conv buffers (cache dtype); ``counters``: the int32 fill
    lengths (one per softmax / MLA layer, plus the decoder's) — bookkeeping the accountant
    leaves out.
    """
    conv = accounting.state_bytes(cfg, dtype_bytes, include_conv=True) - accounting.state_bytes(cfg, dtype_bytes)
    growing_layers = sum(ch in "SM" for ch in cfg.pattern)
    parts = {
        "growing": batch * context * accounting.cache_bytes_per_token(cfg, dtype_bytes),
        "state": batch * accounting.state_bytes(cfg, 4),
        "conv": batch * conv,
        "counters": batch * 4 * (growing_layers + 1),
    }
    return dict(parts, total=sum(parts.values()))


def device_memory(override_gb: Optional[float], b: Budget) -> tuple[float, str]:
    """Bytes one device may allocate, and where the number came from."""
    if override_gb is not None:
        if not override_gb > 0:
            raise ValueError(f"device_memory_gb: must be > 0, got {override_gb}")
        return override_gb * 1e9, "--device-memory-gb"
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"]), "memory_stats()['bytes_limit']"
    if b.fallback_memory_gb is not None:
        return b.fallback_memory_gb * 1e9, "quick default (backend reports no limit)"
    raise ValueError("device_memory_gb: this backend reports no memory limit (memory_stats() has no bytes_limit); "
                     "pass --device-memory-gb")


def fill_batch(per_sequence: int, budget_bytes: float, cap: int) -> int:
    """The largest batch whose caches fit in ``budget_bytes`` (0: not even one), at most ``cap``."""
    return int(min(cap, max(0.0, budget_bytes) // per_sequence))


# ----------------------------------------------------------------------------
# Timing.
# ----------------------------------------------------------------------------
def _is_length(path) -> bool:
    return getattr(path[-1], "name", None) == "length"


def filled_cache(model: Decoder, batch: int, context: int, filled: int, dtype):
    """A decode cache with room for ``context`` tokens whose fill counters all read ``filled``.

    Contents are zeros: decode time does not depend on them (see the module doc). Built
    under ``jit`` straight on the device, nothing materialized twice.
    """
    shapes = jax.eval_shape(lambda: model.init_cache(batch, context, dtype))
    return jax.jit(lambda: jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.full(s.shape, filled if _is_length(path) else 0, s.dtype), shapes))()


def time_steps(step, state, cache, batch: int, warmup: int, steps: int) -> float:
    """Median wall-clock ms of ``steps`` decode steps after ``warmup`` (cache carried and donated)."""
    token = jnp.zeros((batch,), jnp.int32)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits, cache = step(state, token, cache)
        jax.block_until_ready(logits)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


class Target:
    """One architecture under test: its model, weights and jitted decode step (cache donated), and
    the step's executables compiled ahead per cache shape."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.model = Decoder(cfg, rngs=nnx.Rngs(0))
        self.state, _, self.step = inference_steps(self.model)
        self.weight_bytes = tree_bytes(self.state)
        # the untied embedding table: a step gathers its batch's rows of it (tied, it is the LM head)
        self.table_bytes = 0 if cfg.tie_embeddings else tree_bytes(self.model.embed[...])
        self._executables: dict = {}

    def compile(self, batch: int, context: int, dtype):
        """The step compiled for this cache shape (nothing allocated), and its workspace: the bytes it
        allocates beyond its arguments (XLA's temporaries and non-aliased outputs; 0 if the backend
        does not say). Shapes that do not grow with context (a KDA state) compile once."""
        cache = jax.eval_shape(lambda: self.model.init_cache(batch, context, dtype))
        key = tuple((leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(cache))
        if key not in self._executables:
            compiled = self.step.lower(self.state, jax.ShapeDtypeStruct((batch,), jnp.int32), cache).compile()
            mem = compiled.memory_analysis()
            workspace = 0 if mem is None else int(
                mem.temp_size_in_bytes + max(0, mem.output_size_in_bytes - mem.alias_size_in_bytes))
            self._executables[key] = compiled, workspace
        return self._executables[key]


BYTES_READ_RULE = "every weight but the untied embedding table, of which the batch's rows; plus the whole cache"


def weights_read(weight_bytes: int, table_bytes: int, vocab: int, batch: int) -> int:
    """Weight bytes one decode step of ``batch`` sequences reads: every weight but the untied embedding
    table (``table_bytes``; 0 when tied, where it is the LM head and read whole), of which the step gathers
    ``batch`` rows of ``table_bytes / vocab``."""
    return weight_bytes - table_bytes + batch * (table_bytes // vocab)


def read_rate(bytes_read: int, ms: float) -> float:
    """GB/s of a step that reads ``bytes_read`` (weights + the whole cache: every slot is read
    under a mask) in ``ms`` — a lower bound on the memory traffic, so against the device's
    bandwidth it says how far a step is from its roofline (H200: 4.8 TB/s)."""
    return bytes_read / (ms * 1e-3) / 1e9


def _is_oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def measure(target: Target, batch: int, context: int, budget_bytes: float, b: Budget, done: dict) -> dict:
    """Fit, allocate, check and time one point, starting from the cache-only fit ``batch``.

    The batch is cut until the cache plus the compiled step's workspace fit in ``budget_bytes``
    (an out-of-memory error at run time — fragmentation — cuts it by a third). ``done`` maps
    batches already measured at this context to their results, which are reused.
    """
    dtype = jnp.dtype(b.dtype)
    cache_fit, notes = batch, []
    while batch >= 1:
        if batch in done:
            return dict(done[batch], cache_fit_batch=cache_fit, note="; ".join(notes))
        try:
            compiled, workspace = target.compile(batch, context, dtype)
        except Exception as err:  # noqa: BLE001 — only out-of-memory is handled
            if not _is_oom(err):  # the compiler's autotuner allocates scratch next to the weights
                raise
            notes.append(f"B={batch}: compiling ran out of memory")
            batch = batch * 2 // 3
            continue
        predicted = predicted_cache_bytes(target.cfg, batch, context, dtype.itemsize)
        need = predicted["total"] + workspace
        if need > budget_bytes:
            notes.append(f"B={batch} needs {C.fmt_bytes(need)} with the decode workspace")
            batch = min(batch - 1, int(budget_bytes // (need / batch)))
            continue
        cache = None
        try:
            cache = filled_cache(target.model, batch, context, context - b.warmup - b.steps, dtype)
            measured = tree_bytes(cache)
            ms = time_steps(compiled, target.state, cache, batch, b.warmup, b.steps)
        except Exception as err:  # noqa: BLE001 — only out-of-memory is handled
            if not _is_oom(err):
                raise
            notes.append(f"B={batch} ran out of memory")
            batch = batch * 2 // 3
            continue
        finally:
            del cache
        read = weights_read(target.weight_bytes, target.table_bytes, target.cfg.vocab_size, batch) + measured
        done[batch] = {"status": "ok", "batch": batch, "cache_bytes": measured, "predicted": predicted,
                       "matches_accounting": measured == predicted["total"], "workspace_bytes": workspace,
                       "ms_per_step": ms, "ms_per_token": ms / batch, "tokens_per_s": 1e3 * batch / ms,
                       "bytes_read": read,
                       "read_gb_per_s": read_rate(read, ms)}
        return dict(done[batch], cache_fit_batch=cache_fit, note="; ".join(notes))
    return {"status": "does not fit", "batch": 0, "cache_fit_batch": cache_fit, "note": "; ".join(notes)}


# ----------------------------------------------------------------------------
# The sweep.
# ----------------------------------------------------------------------------
def decode_reads(cfg: ModelConfig) -> dict:
    """How this backend's decode reads each cache kind of ``cfg`` (``cfg.decode_read`` resolved
    by ``memory.resolve_read``): ``"dot"`` (einsum) or ``"reduce"`` (multiply-and-reduce) —
    recorded because the two differ ~8x on the H200 (docs/results.md)."""
    reads = {}
    if "S" in cfg.pattern:
        reuse = cfg.num_heads // (cfg.num_kv_heads or cfg.num_heads)
        reads["softmax"] = resolve_read("decode_scaling", cfg.decode_read, reuse=reuse)
    if "M" in cfg.pattern:  # the latent and the shared rope key, both read by every head
        reads["mla_latent"] = resolve_read("decode_scaling", cfg.decode_read, reuse=cfg.num_heads)
    return reads


def run(quick: bool = False, out: str = "results", only: Optional[Sequence[str]] = None,
        contexts: Optional[Sequence[int]] = None, layers: Optional[int] = None, steps: Optional[int] = None,
        max_batch: Optional[int] = None, device_memory_gb: Optional[float] = None) -> dict:
    """Measure every architecture × context × batch mode (see the module doc)."""
    b = make_budget(quick, contexts, layers, steps, max_batch)
    keys = list(ARCHS) if only is None else list(only)
    unknown = sorted(set(keys) - set(ARCHS))
    if unknown or not keys:
        raise ValueError(f"only: unknown architecture(s) {unknown or keys}; valid: {','.join(ARCHS)}")
    memory, memory_source = device_memory(device_memory_gb, b)

    record = C.provenance(NAME, quick)
    record.update(budget=dataclasses.asdict(b), device_memory_bytes=memory, device_memory_source=memory_source,
                  kimi_reported=KIMI_REPORTED, bytes_read_rule=BYTES_READ_RULE)
    rows, arch_info = [], {}
    bar = C.progress(desc="decode", total=len(keys) * len(b.contexts) * len(MODES), unit="point")
    for key in keys:
        target = Target(model_config(key, b))
        cfg = target.cfg
        arch_info[key] = {"label": cfg.name, "pattern": cfg.pattern, "weight_bytes": target.weight_bytes,
                          "embedding_table_bytes": target.table_bytes,
                          "params": accounting.param_counts(cfg)["total"], "decode_reads": decode_reads(cfg)}
        budget_bytes = b.fill_fraction * memory - target.weight_bytes
        for context in b.contexts:
            per_sequence = predicted_cache_bytes(cfg, 1, context, jnp.dtype(b.dtype).itemsize)["total"]
            fill = fill_batch(per_sequence, budget_bytes, b.max_batch)
            batches = {"batch1": min(1, fill), "fill": fill}
            done = {}
            for mode in MODES:
                bar.set_postfix(arch=key, context=C.fmt_tokens(context), mode=mode)
                base = {"arch": key, "label": cfg.name, "context": context, "mode": mode,
                        "bytes_per_sequence": per_sequence}
                if batches[mode] == 0:
                    result = {"status": "does not fit", "batch": 0, "cache_fit_batch": 0,
                              "note": f"one sequence's cache needs {C.fmt_bytes(per_sequence)}; "
                                      f"{C.fmt_bytes(max(budget_bytes, 0))} free after the weights"}
                else:
                    result = measure(target, batches[mode], context, budget_bytes, b, done)
                rows.append(dict(base, **result))
                bar.update(1)
        del target  # frees the weights and executables before the next architecture
        # Written after every architecture: a run stopped early keeps what it measured.
        record.update(archs=arch_info, rows=rows, speedups=speedups(rows), complete=key == keys[-1])
        result = C.finish(record, NAME, out, plot(record))
    bar.close()
    return result


def _ok(rows, arch, context, mode) -> Optional[dict]:
    return next((r for r in rows if (r["arch"], r["context"], r["mode"]) == (arch, context, mode)
                 and r["status"] == "ok"), None)


PAIRS = {"hybrid_vs_mla": "hybrid vs MLA", "hybrid_vs_mha": "hybrid vs MHA", "mla_vs_mha": "MLA vs MHA",
         "kda_vs_mha": "KDA vs MHA"}


def speedups(rows: list[dict]) -> dict:
    """Baseline time / architecture time for every pair of :data:`PAIRS`.

    batch1 compares ms per step; fill compares ms per token (step / batch) at each one's own
    batch. ``per_context[context][mode][pair]`` (None where either did not run), and
    ``headline[pair][mode]``: the value at the longest context where both ran.
    ``bytes_per_context`` / ``bytes_headline``: the same pairs' ratio of bytes read per token
    (weights + cache, divided by the batch) — the speedup both would show at one read rate, i.e.
    at equal distance from the roofline (None for records without ``bytes_read``).
    """
    metric = {"batch1": "ms_per_step", "fill": "ms_per_token"}
    per_token_bytes = lambda r: r["bytes_read"] / r["batch"] if "bytes_read" in r else None  # noqa: E731
    per_context, bytes_per_context = {}, {}
    for context in sorted({r["context"] for r in rows}):
        per_context[str(context)] = {mode: {} for mode in MODES}
        bytes_per_context[str(context)] = {mode: {} for mode in MODES}
        for mode in MODES:
            for pair in PAIRS:
                fast, slow = (_ok(rows, arch, context, mode) for arch in pair.split("_vs_"))
                ratio = slow[metric[mode]] / fast[metric[mode]] if fast and slow else None
                per_context[str(context)][mode][pair] = ratio
                both = fast and slow and per_token_bytes(fast) and per_token_bytes(slow)
                bytes_per_context[str(context)][mode][pair] = (per_token_bytes(slow) / per_token_bytes(fast)
                                                               if both else None)

    def headline_of(table):
        return {pair: {mode: next(({"context": int(c), "speedup": v[mode][pair]}
                                   for c, v in reversed(table.items()) if v[mode][pair] is not None), None)
                       for mode in MODES} for pair in PAIRS}

    return {"per_context": per_context, "headline": headline_of(per_context),
            "bytes_per_context": bytes_per_context, "bytes_headline": headline_of(bytes_per_context)}


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------
def plot(record: dict):
    import matplotlib.pyplot as plt

    rows, b = record["rows"], record["budget"]
    contexts = b["contexts"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for i, (key, info) in enumerate(record["archs"].items()):
        color = f"C{i}"
        for ax, mode, metric in ((axes[0], "batch1", "ms_per_step"), (axes[1], "fill", "ms_per_token")):
            pts = [(r["context"], r[metric], r["batch"]) for r in rows
                   if r["arch"] == key and r["mode"] == mode and r["status"] == "ok"]
            if pts:
                x, y, batch = zip(*pts)
                ax.plot(x, y, "o-", color=color, label=info["label"])
                if mode == "fill":
                    for xi, yi, bi in pts:
                        ax.annotate(f"B={bi}", (xi, yi), fontsize=6, color=color, xytext=(3, 3),
                                    textcoords="offset points")
        predicted = [next(r["bytes_per_sequence"] for r in rows if r["arch"] == key and r["context"] == c)
                     for c in contexts]
        axes[2].plot(contexts, predicted, "-", color=color, label=f"{info['label']} (accounting)")
        meas = [(r["context"], r["cache_bytes"] / r["batch"]) for r in rows
                if r["arch"] == key and r["mode"] == "batch1" and r["status"] == "ok"]
        if meas:
            axes[2].plot(*zip(*meas), "o", color=color, mfc="none", ms=9)
    axes[2].axhline(record["device_memory_bytes"], color="k", ls="-.", lw=1,
                    label=f"device memory ({C.fmt_bytes(record['device_memory_bytes'])})")
    titles = ["decode latency, batch 1 (ms per step)",
              f"decode time per token at the device-filling batch (≤ {b['max_batch']})",
              "cache bytes per sequence (lines: accounting; circles: measured)"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(contexts, [C.fmt_tokens(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("ms")
    axes[1].set_ylabel("ms per token (step / batch)")
    axes[2].set_ylabel("bytes")
    for ax, size in ((axes[0], 8), (axes[2], 7)):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size)
    fig.suptitle(f"Decode scaling: d {b['d_model']}, {b['num_heads']}×{b['head_dim']} heads, {b['layers']} layers, "
                 f"{b['dtype']} caches; {record['device']['description']}")
    fig.tight_layout()
    return fig


def rederive(record: dict) -> dict:
    """``record`` with every measured point's ``bytes_read`` and ``read_gb_per_s``, and the bytes-read ratios
    of ``speedups``, recomputed from its measured times and cache bytes by :func:`weights_read`. A record
    without ``embedding_table_bytes`` (its models untied, float32 weights of ``weight_bytes / params`` bytes
    each) gets the table's size from its budget's vocabulary and width."""
    b, out = record["budget"], json.loads(json.dumps(record))
    for info in out["archs"].values():
        if "embedding_table_bytes" not in info:
            info["embedding_table_bytes"] = b["vocab"] * b["d_model"] * (info["weight_bytes"] // info["params"])
    for r in out["rows"]:
        if r["status"] == "ok":
            info = out["archs"][r["arch"]]
            r["bytes_read"] = weights_read(info["weight_bytes"], info["embedding_table_bytes"], b["vocab"],
                                           r["batch"]) + r["cache_bytes"]
            r["read_gb_per_s"] = read_rate(r["bytes_read"], r["ms_per_step"])
    out["speedups"] = speedups(out["rows"])
    out["bytes_read_rule"] = BYTES_READ_RULE
    return out


def _fmt_speedup(entry: Optional[dict]) -> str:
    return "-" if entry is None else f"{entry['speedup']:.2f}× @ {C.fmt_tokens(entry['context'])}"


def table(record: dict) -> str:
    rows, b = record["rows"], record["budget"]
    lines = []
    out_rows = []
    for r1 in (r for r in rows if r["mode"] == "batch1"):
        rf = next(r for r in rows if (r["arch"], r["context"], r["mode"]) == (r1["arch"], r1["context"], "fill"))
        ok1, okf = r1["status"] == "ok", rf["status"] == "ok"
        out_rows.append([
            r1["label"], C.fmt_tokens(r1["context"]),
            C.fmt_bytes(r1["bytes_per_sequence"]),
            (("exact" if r1["matches_accounting"] else f"MISMATCH {r1['cache_bytes']} vs {r1['predicted']['total']}")
             if ok1 else "-"),
            f"{r1['workspace_bytes'] / r1['cache_bytes']:.2g}×" if ok1 else "-",
            f"{r1['ms_per_step']:.3g}" if ok1 else r1["status"],
            f"{r1['read_gb_per_s']:.0f}" if ok1 and "read_gb_per_s" in r1 else "-",
            f"{rf['batch']} / {rf['cache_fit_batch']}" if okf else "-",
            f"{rf['ms_per_step']:.3g}" if okf else rf["status"],
            f"{rf['ms_per_token']:.3g}" if okf else "-",
            f"{rf['read_gb_per_s']:.0f}" if okf and "read_gb_per_s" in rf else "-",
        ])
    title = (f"Decode scaling ({'quick' if record['quick'] else 'full'}: d {b['d_model']}, {b['num_heads']}×"
             f"{b['head_dim']}, {b['layers']} layers, {b['dtype']} caches; median of {b['steps']} steps; device memory "
             f"{C.fmt_bytes(record['device_memory_bytes'])} from {record['device_memory_source']}; "
             f"{record['device']['description']})")
    lines.append(C.format_table(["architecture", "context", "cache/seq", "measured vs accounting", "workspace/cache",
                                 "B=1 ms/step", "B=1 GB/s read", "fill B / cache-fit B", "fill ms/step",
                                 "fill ms/token", "fill GB/s read"],
                                out_rows, title))
    notes = [f"  {r['label']} @ {C.fmt_tokens(r['context'])} {r['mode']}: {r['note']}" for r in rows if r.get("note")]
    if notes:
        lines += ["", "Notes:"] + list(dict.fromkeys(notes))
    lines += ["", "Speedups at the longest context where both ran (batch 1: ms/step; fill: ms/token at each one's "
                  "own batch), next to Kimi Linear's reported hybrid-vs-MLA TPOT at 1M:"]
    sp_rows = []
    by_bytes = record["speedups"].get("bytes_headline", {})
    for pair, name in PAIRS.items():
        cells = [_fmt_speedup(record["speedups"]["headline"][pair][mode]) for mode in MODES]
        cells += [_fmt_speedup(by_bytes.get(pair, {}).get(mode)) for mode in MODES]
        reported = f"{KIMI_REPORTED['batch1']}× / {KIMI_REPORTED['fill']}×" if pair == "hybrid_vs_mla" else ""
        sp_rows.append([name, *cells, reported])
    lines.append(C.format_table(["pair", "ours batch 1", "ours fill", "bytes read, batch 1", "bytes read, fill",
                                 "Kimi Linear (batch 1 / batched)"], sp_rows))
    lines.append("(bytes read: the ratio of bytes each must read per token — the speedup at equal read rates)")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv=None) -> dict:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--rederive", nargs="+", metavar="RECORD")
    known, _ = pre.parse_known_args(argv)
    if known.rederive:  # recompute saved records' read rates (module doc, "Read rate"); nothing is measured
        record = {}
        for path in known.rederive:
            text = pathlib.Path(path).read_text()
            record = rederive(json.loads(text))
            lines = text.splitlines()
            indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else 2  # keep the file's layout
            pathlib.Path(path).write_text(json.dumps(record, indent=indent or None) + "\n")
            print(f"{path}:\n{table(record)}\n")
        return record
    parser = C.make_parser(NAME, __doc__.splitlines()[0])
    parser.epilog = ("--rederive RECORD.json [...]: recompute saved records' bytes read, read rates and bytes-read "
                     "ratios by the current rule (weights_read), in place; nothing is measured")
    parser.add_argument("--only", type=lambda t: t.split(","), default=None,
                        help=f"comma-separated subset of: {','.join(ARCHS)}")
    parser.add_argument("--contexts", type=_ints, default=None, help="comma-separated context lengths in tokens")
    parser.add_argument("--layers", type=C.positive_int, default=None, help="layers per model (a multiple of 4)")
    parser.add_argument("--steps", type=C.positive_int, default=None, help="timed decode steps per point")
    parser.add_argument("--max-batch", type=C.positive_int, default=None, help="cap of the device-filling batch")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="device memory in GB (default: the backend's allocator limit)")
    return C.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
