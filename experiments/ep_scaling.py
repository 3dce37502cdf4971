"""Expert-parallel MoE training across devices: data parallel vs expert parallel, one process.

    python -m experiments.ep_scaling [--quick] [--out results] [--gpus 1,2,4,8] [--layouts dp,ep,dp2ep[,ep_rep,fsdp]]
        [--experts 64] [--top-k 4] [--d-model 2048] [--layers 8] [--seq 1024] [--batch 8] [--steps 30]
        [--dtype auto|float32|bfloat16] [--impl auto|ragged|dense|ragged_reference] [--budget-s 520]
        [--memory-backend xla|pallas]

**Model**: ``tiny_k3`` (KDA ×3 : MLA, bounded KDA gate, AttnRes blocks of 4, a dense first
layer, latent MoE with SiTU-GLU experts and two merged shared experts) widened: every
width scales with ``d_model`` as in ``tiny_k3`` (at ``d_model=64`` they are ``tiny_k3``'s
own: latent ``d/2``, routed hidden ``d/2``, shared hidden ``3d/4``, q-LoRA ``3d/8``,
kv-LoRA ``d/2``, dense FFN ``2d``; heads of 128 (of 16 below ``d=512``)), with
``--experts`` routed experts (default 64), ``--top-k`` (default 4), ``--layers`` layers
of the ``KKKM`` pattern. Default: ``d_model 2048``, 8 layers (7 MoE), 64 experts: about
1.6B parameters, 1.4B of them routed experts (the printed header gives the exact count);
float32 parameters + AdamW = 16 bytes/parameter ≈ 26 GB; global batch 8 × 1024 tokens (one
sequence per device on 8 GPUs). The batch is sized for the one-device baseline: the XLA
chunked KDA's per-channel sub-block scores (``[B, H, N, 4, 16, 16, 128]`` float32, 8.6 GB each
at batch 32) dominate its temporaries — XLA:CPU's memory analysis of the 1-device step gives
80 GB at batch 8 (+ 20 GB of arguments) against 280 GB at batch 32; the experts' grouped
matmuls never expand densely (``lineage_jax.layers.grouped``). Vocabulary 256
(bytes of the Python standard library's sources, ``lineage_jax.data``).

**Runs**: for each device count ``n`` of ``--gpus`` (default 1, 2, 4, 8 capped at
``jax.device_count()``) and each layout — ``dp``: mesh ``data=n`` (everything replicated);
``ep``: ``expert=n`` (experts split over all devices; tokens and the dense weights' width
also split over the expert axis, by the library's rules); ``dp2ep``: ``data=2,expert=n/2``
(n >= 4); opt-in: ``ep_rep``: ``expert=n`` with the dense weights *replicated* over the
expert axis (``parallel.without_mesh_axis("expert")``: classic data + expert parallelism;
``ep`` uses the expert axis as more FSDP for them, the library's default rules) and ``fsdp``:
``fsdp=n`` (every weight's model width split, no expert parallelism: ``ep``'s dense split
without the all-to-all) — train ``--steps`` steps of the library's training step
(``lineage_jax.train.step``: ``make_parallel``, ``init_state`` born sharded, one jitted
``jit_steps`` program per step, AdamW + clipping + router-bias updates) on the *same*
global batches (fixed ``--batch`` × ``--seq`` and seed). ``n = 1`` is the plain one-device
step (no mesh, the single-device ragged MoE). MoE dispatch is dropless (``ragged``), so
expert parallelism computes the same function and losses agree with ``n = 1`` up to
rounding; ``--impl`` picks the exchange (``auto``: ``ragged_all_to_all`` on TPU, the dense
``all_to_all`` elsewhere — on GPUs ``ragged_all_to_all``'s gradient was measured wrong, see
:mod:`lineage_jax.parallel.expert`). Float32 runs set ``jax.default_matmul_precision("highest")``
(GPUs otherwise multiply float32 in TF32, whose rounding differs between layouts).

**Measured per run**: per-step losses; compile time (AOT ``lower().compile()``); median
step time after ``--warmup`` steps (each step ``block_until_ready``, batches already on
the devices); tokens/s per device = global tokens / step time / n; memory per device:
*XLA*: the compiled step's arguments + outputs − donated aliases + temporaries
(``memory_analysis()``, per device for the SPMD program), and *measured*: the highest
``memory_stats()['peak_bytes_in_use']`` over the run's devices (None on CPU). The
allocator's peak is per process and never resets, so a run that stays below an earlier
run's peak on its devices cannot show its own; such values are marked ``<=`` (an upper
bound) — the XLA figure is the comparable one.

**All-to-all share** (``ep`` layouts): the expert-parallel exchange alone, timed as its own
jitted program on the same mesh: one MoE layer's dispatch -> combine through the library's
own :func:`lineage_jax.parallel.expert.ep_exchange` (what the step's MoE layers run, for the
chosen ``impl``: dense ``all_to_all`` of capacity-padded buffers, or the size/offset
``all_to_all``s and three ``ragged_all_to_all``s), same tokens, width and dtype, uniform
random top-k routing, with the expert MLP replaced by the identity; forward and its autodiff
backward (``value_and_grad``). share = (MoE layers × exchange time) / step time. It includes
the dispatch bookkeeping (sorting rows by destination), and XLA may overlap collectives with
compute inside the real step, so it is the share the exchange would take if nothing
overlapped it (an upper bound on its exposed cost). With weights ``1/k`` the identity
experts return every token unchanged, so the program checks its own round trip
(``roundtrip_ok``). ``dp`` layouts have no all-to-all (their gradient all-reduce is not
separated out).

**Loss agreement**: max |loss − loss(n=1)| over the first ``--compare-steps`` steps
(default 10) against 1e-4 (float32 activations) or 2e-2 (bfloat16): a larger value is
flagged in the table, not raised.

``--quick``: 8 experts, top-2, d 64, 2 layers, seq 64, batch 8, 6 steps, float32 (CPU,
fake devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``).
On a GPU set ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`` and ``NCCL_NVLS_ENABLE=0``
(NVLink multicast off); ``--budget-s`` skips runs that would not finish in time (the JSON
and PNG are rewritten after every run, so a cut call keeps what it finished).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common as C
from lineage_jax import accounting
from lineage_jax.models import ModelConfig, get_config

NAME = "ep_scaling"
LAYOUTS = ("dp", "ep", "dp2ep")
EXTRA_LAYOUTS = ("ep_rep", "fsdp")   # accepted by --layouts, not run by default
IMPLS = ("auto", "ragged", "dense", "ragged_reference")
DTYPES = ("auto", "float32", "bfloat16")
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
DATA = ("stdlib", "synthetic")
MEMORY_BACKENDS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Budget:
    experts: int
    top_k: int
    d_model: int
    layers: int
    moe_hidden: Optional[int]   # None: d_model // 2 (as tiny_k3)
    seq: int
    batch: int                  # global batch (sequences per step)
    steps: int
    warmup: int                 # steps left out of the median step time
    compare_steps: int          # steps of the loss comparison with n = 1
    dtype: str                  # "auto": bfloat16 on GPU/TPU, float32 on CPU
    lr: float
    a2a_reps: int               # timed repetitions of the all-to-all program
    data: str = "stdlib"
    memory_backend: str = "xla"  # the KDA layers' chunked form (ModelConfig.memory_backend)


QUICK = Budget(experts=8, top_k=2, d_model=64, layers=2, moe_hidden=None, seq=64, batch=8, steps=6, warmup=2,
               compare_steps=6, dtype="float32", lr=3e-3, a2a_reps=3)
FULL = Budget(experts=64, top_k=4, d_model=2048, layers=8, moe_hidden=None, seq=1024, batch=8, steps=30, warmup=5,
              compare_steps=10, dtype="auto", lr=1e-3, a2a_reps=10)


def make_budget(quick: bool, **overrides) -> Budget:
    b = QUICK if quick else FULL
    b = dataclasses.replace(b, **{k: v for k, v in overrides.items() if v is not None})
    for name in ("experts", "top_k", "d_model", "layers", "seq", "batch", "steps", "compare_steps", "a2a_reps"):
        v = getattr(b, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be a positive int, got {v!r}")
    if b.moe_hidden is not None and b.moe_hidden < 1:
        raise ValueError(f"--moe-hidden: must be a positive int, got {b.moe_hidden!r}")
    if not 0 <= b.warmup < b.steps:
        raise ValueError(f"--warmup: must be in [0, --steps={b.steps}), got {b.warmup}")
    if b.top_k > b.experts:
        raise ValueError(f"--top-k: must be <= --experts={b.experts}, got {b.top_k}")
    if b.d_model % 16 or (b.d_model >= 512 and b.d_model % 128):
        raise ValueError(f"--d-model: must be a multiple of 16 (of 128 from 512 on: heads of 128), got {b.d_model}")
    if b.dtype not in DTYPES:
        raise ValueError(f"--dtype: must be one of {DTYPES}, got {b.dtype!r}")
    if b.memory_backend not in MEMORY_BACKENDS:
        raise ValueError(f"--memory-backend: must be one of {MEMORY_BACKENDS}, got {b.memory_backend!r}")
    if b.data not in DATA:
        raise ValueError(f"--data: must be one of {DATA}, got {b.data!r}")
    if not b.lr > 0:
        raise ValueError(f"--lr: must be > 0, got {b.lr}")
    return b


def resolve_dtype(b: Budget) -> str:
    if b.dtype != "auto":
        return b.dtype
    return "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"


def model_config(b: Budget, dtype: str) -> ModelConfig:
    """``tiny_k3`` widened to ``b.d_model`` with ``b.experts`` experts (see the module doc)."""
    d = b.d_model
    head_dim = 128 if d >= 512 else 16
    pattern = ("KKKM" * b.layers)[:b.layers]
    base = get_config("tiny_k3")
    return base.replace(
        name=f"tiny_k3 widened: d{d}, {b.layers} layers, {b.experts} experts top-{b.top_k}",
        d_model=d, num_heads=d // head_dim, head_dim=head_dim, pattern=pattern, ffn_hidden=2 * d,
        num_experts=b.experts, top_k=b.top_k, moe_hidden=b.moe_hidden or d // 2, moe_latent_dim=d // 2,
        shared_hidden=3 * d // 4, q_lora_rank=3 * d // 8, kv_lora_rank=d // 2, qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim, chunk_size=min(64, b.seq),
        attnres_block=min(base.attnres_block, b.layers), first_dense_layers=min(1, b.layers - 1),
        max_seq_len=max(base.max_seq_len, b.seq), moe_dispatch="ragged", dtype=dtype,
        memory_backend=b.memory_backend)


# ----------------------------------------------------------------------------- data
def token_batches(b: Budget, seed: int) -> tuple[list[dict], str]:
    """``b.steps`` global batches ``{"tokens", "targets"} [batch, seq]`` int32, the same for every run:
    random windows (seeded) of the byte-tokenized standard-library corpus, or a synthetic stream;
    and a line saying which."""
    rng = np.random.default_rng(seed)
    need = b.steps * b.batch * (b.seq + 1)
    stream = None
    source = "synthetic"
    if b.data == "stdlib":
        try:  # lineage_jax.data imports grain (its pipeline): without it, fall back to the synthetic stream
            from lineage_jax.data import stdlib_corpus, tokenize_corpus

            corpus = stdlib_corpus("train")
            docs = max(8, min(len(corpus), need // 2000 + 8))
            stream = np.asarray(tokenize_corpus(corpus, "byte", max_documents=docs).tokens, np.int32)
            source = f"stdlib bytes ({docs} files, {len(stream)} tokens)"
        except (ImportError, ValueError) as err:
            source = f"synthetic (stdlib corpus unavailable: {type(err).__name__}: {err})"
    if stream is None or len(stream) < 4 * (b.seq + 1):
        # A deterministic stream with structure to learn: random walks over bytes.
        steps = rng.integers(-3, 4, size=max(need, 1 << 16))
        stream = (np.cumsum(steps) % 256).astype(np.int32)
        source = source if source.startswith("synthetic") else "synthetic (corpus too short)"
    starts = rng.integers(0, len(stream) - b.seq - 1, size=(b.steps, b.batch))
    window = np.arange(b.seq + 1)
    out = []
    for s in range(b.steps):
        w = stream[starts[s][:, None] + window[None, :]]
        out.append({"tokens": w[:, :-1], "targets": w[:, 1:]})
    return out, source


# ----------------------------------------------------------------------------- runs
def planned_runs(gpus: Sequence[int], layouts: Sequence[str], b: Budget) -> list[dict]:
    """``[{"n", "layout", "mesh"}]`` in run order (n = 1 once, first), after checking every input."""
    available = jax.device_count()
    if not gpus:
        raise ValueError("--gpus: give at least one device count")
    for n in gpus:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--gpus: device counts must be positive ints, got {n!r}")
        if n > available:
            raise ValueError(f"--gpus: {n} devices asked for, {available} available ({C.device_info()['description']})")
    bad = sorted(set(layouts) - set(LAYOUTS + EXTRA_LAYOUTS))
    if bad or not layouts:
        raise ValueError(f"--layouts: unknown layout(s) {bad or list(layouts)}; "
                         f"valid: {','.join(LAYOUTS + EXTRA_LAYOUTS)}")
    runs = []
    for n in sorted(set(gpus)):
        if n == 1:
            runs.append({"n": 1, "layout": "1 device", "mesh": "-"})
            continue
        for layout in layouts:
            if layout == "dp":
                sizes = {"data": n}
            elif layout in ("ep", "ep_rep"):  # ep_rep: the same mesh, other rules (see train_run)
                sizes = {"expert": n}
            elif layout == "fsdp":
                sizes = {"fsdp": n}
            else:
                if n < 4 or n % 2:
                    continue    # data=2 × expert=n/2 needs n >= 4 (n = 2 would be plain dp)
                sizes = {"data": 2, "expert": n // 2}
            ep = sizes.get("expert", 1)
            if b.experts % ep:
                raise ValueError(f"--experts={b.experts} is not divisible by the expert axis {ep} of layout {layout!r} "
                                 f"on {n} devices; use a multiple of {ep} (or drop {n} from --gpus)")
            if b.batch % n:
                raise ValueError(f"--batch={b.batch} does not split over {n} devices (layout {layout!r}); "
                                 f"use a multiple of {n}")
            runs.append({"n": n, "layout": layout, "mesh": ",".join(f"{k}={v}" for k, v in sizes.items())})
    return runs


def _memory_stats(devices) -> list[Optional[dict]]:
    out = []
    for d in devices:
        try:
            s = d.memory_stats()
        except Exception:  # noqa: BLE001 — backends without allocator statistics
            s = None
        out.append(None if not s else {k: int(s[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
                                        if k in s})
    return out


def _xla_memory(compiled) -> Optional[dict]:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        m = None
    if m is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes")
    d = {k: int(getattr(m, k, 0) or 0) for k in keys}
    d["per_device_bytes"] = (d["argument_size_in_bytes"] + d["output_size_in_bytes"] - d["alias_size_in_bytes"]
                             + d["temp_size_in_bytes"])
    return d


def _count_collectives(hlo: str) -> dict:
    return {"all_to_all": hlo.count(" all-to-all("), "ragged_all_to_all": hlo.count(" ragged-all-to-all("),
            "all_reduce": hlo.count(" all-reduce("), "all_gather": hlo.count(" all-gather("),
            "reduce_scatter": hlo.count(" reduce-scatter(")}


def train_run(spec: dict, cfg: ModelConfig, b: Budget, batches: list[dict], impl: str, seed: int, bar) -> dict:
    """Train ``b.steps`` steps on ``spec``'s mesh; losses, timings, memory, compile time."""
    from lineage_jax.train.config import TrainConfig
    from lineage_jax.train.step import init_state, jit_steps, make_parallel

    n = spec["n"]
    devices = jax.devices()[:n]
    tcfg = TrainConfig(steps=b.steps, batch_size=b.batch, seq_len=b.seq, lr=b.lr, warmup_steps=min(10, b.steps // 3),
                       seed=seed, mesh="" if n == 1 else spec["mesh"], progress=False)
    parallel = None if n == 1 else make_parallel(cfg, spec["mesh"], devices=devices, batch_size=b.batch)
    if spec["layout"] == "ep_rep":      # dense weights replicated over the expert axis (DP + EP)
        from lineage_jax.parallel import without_mesh_axis

        rules = without_mesh_axis("expert")
        parallel = dataclasses.replace(parallel, rules=rules,
                                       expert_parallel=dataclasses.replace(parallel.expert_parallel, rules=rules))
    if parallel is not None and parallel.expert_parallel is not None and impl != "auto":
        parallel = dataclasses.replace(parallel, expert_parallel=dataclasses.replace(parallel.expert_parallel,
                                                                                     impl=impl))
    ep = None if parallel is None else parallel.expert_parallel
    t0 = time.perf_counter()
    with jax.default_device(devices[0]):
        graphdef, state, tx = init_state(cfg, tcfg, parallel)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    train_step, _ = jit_steps(graphdef, tx, tcfg, state, parallel)
    place = parallel.shard_batch if parallel is not None else (lambda x: jax.device_put(x, devices[0]))
    placed = [place(bt) for bt in batches]
    jax.block_until_ready(placed)

    t0 = time.perf_counter()
    compiled = train_step.lower(state, placed[0]).compile()
    compile_s = time.perf_counter() - t0
    xla_mem = _xla_memory(compiled)
    try:
        collectives = _count_collectives(compiled.as_text())
    except Exception:  # noqa: BLE001
        collectives = None
    before = _memory_stats(devices)

    losses, times, dropped = [], [], 0
    for i, batch in enumerate(placed):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        metrics = jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
        dropped += int(metrics.get("moe_tokens_dropped", 0))
        bar.update(1)
        bar.set_postfix(run=f"n={n} {spec['layout']}", loss=f"{losses[-1]:.3f}")
    after = _memory_stats(devices)
    del state, placed, compiled
    gc.collect()

    step_s = float(np.median(times[b.warmup:]))
    tokens = b.batch * b.seq
    peaks = [(a or {}).get("peak_bytes_in_use") for a in after]
    rose = [a is not None and bb is not None and a.get("peak_bytes_in_use", 0) > bb.get("peak_bytes_in_use", 0)
            for a, bb in zip(after, before)]
    measured_peak = max((p for p in peaks if p is not None), default=None)
    return dict(spec, expert_parallel=ep is not None, impl=None if ep is None else ep.resolved_impl(),
                losses=losses, step_times_s=times, step_ms=1e3 * step_s, tokens_per_step=tokens,
                tokens_per_s=tokens / step_s, tokens_per_s_per_device=tokens / step_s / n,
                compile_s=compile_s, init_s=init_s, xla_memory=xla_mem,
                xla_bytes_per_device=None if xla_mem is None else xla_mem["per_device_bytes"],
                measured_peak_bytes_per_device=measured_peak,
                measured_peak_is_own=None if measured_peak is None else all(rose),
                memory_stats_before=before, memory_stats_after=after, collectives_in_step=collectives,
                tokens_dropped=dropped, _parallel=parallel)


# ----------------------------------------------------------------------------- the all-to-all alone
def exchange_program(ep, cfg: ModelConfig, tokens: int, seed: int):
    """The expert-parallel exchange of one MoE layer, forward + backward, as a jitted program.

    The library's own dispatch -> combine (:func:`lineage_jax.parallel.expert.ep_exchange`, what
    every MoE layer's experts run through, for ``ep.resolved_impl()``, dropless) on the same
    mesh, token count, width and dtype as the step, with the expert MLP replaced by the identity
    (a mask of the empty slots): routing is uniform random top-k with weights ``1/k``, so the
    output must equal the input — the program checks its own round trip. Returns
    ``(fn, args, info)``; ``fn(*args)`` -> ``(loss, dz)``.
    """
    from jax.sharding import NamedSharding, PartitionSpec as P

    from lineage_jax.parallel import expert as EPm
    from lineage_jax.parallel.mesh import mesh_shape
    from lineage_jax.parallel.rules import mesh_axes_of

    mesh, impl = ep.mesh, ep.resolved_impl()
    sizes = mesh_shape(mesh)
    ep_axis, ep_size = ep.expert_axis, ep.expert_size
    token_axes = tuple(mesh_axes_of("batch", ep.rules))          # as the library: size-1 axes kept
    ways = math.prod(sizes.get(a, 1) for a in token_axes)
    if tokens % ways:
        raise ValueError(f"exchange: {tokens} tokens do not split over {ways} devices")
    n, k, e = tokens // ways, cfg.top_k, cfg.num_experts
    e_loc = e // ep_size
    cap = n * min(k, e_loc)                                        # dropless, as the library
    width = cfg.moe_latent_dim or cfg.d_model
    dt = jnp.dtype(cfg.dtype)
    tok = P(token_axes, None)
    rng = np.random.default_rng(seed)
    expert_idx = np.argsort(rng.random((tokens, e), dtype=np.float32), axis=1)[:, :k].astype(np.int32)

    def identity(rows, local_expert):
        return jnp.where((local_expert >= 0)[:, None], rows, jnp.zeros((), rows.dtype))

    def shard(z, idx, w):
        routed, _ = EPm.ep_exchange(z, idx, w, identity, e_loc=e_loc, ep_axis=ep_axis, ep=ep_size,
                                    token_axes=token_axes, capacity_factor=None, impl=impl)
        return routed

    mapped = jax.shard_map(shard, mesh=mesh, in_specs=(tok, tok, tok), out_specs=tok)

    def loss(z, idx, w, r):
        routed = mapped(z, idx, w)
        return jnp.sum(routed * r), routed

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    sh = NamedSharding(mesh, tok)
    keys = jax.random.split(jax.random.key(seed), 2)
    z = jax.device_put(jax.random.normal(keys[0], (tokens, width), jnp.float32).astype(dt), sh)
    r = jax.device_put(jax.random.normal(keys[1], (tokens, width), jnp.float32), sh)
    idx = jax.device_put(jnp.asarray(expert_idx), sh)
    w = jax.device_put(jnp.full((tokens, k), 1.0 / k, jnp.float32), sh)
    row_bytes = width * dt.itemsize
    info = {"impl": impl, "tokens_per_device": n, "top_k": k, "experts_per_device": e_loc, "capacity_C": cap,
            "width": width, "dtype": dt.name,
            "bytes_sent_per_device_forward": (ep_size * cap if impl == "dense" else k * n) * row_bytes * 2,
            "routing": "uniform random top-k, weights 1/k"}
    return fn, (z, idx, w, r), info


def time_exchange(ep, cfg: ModelConfig, tokens: int, reps: int, seed: int) -> dict:
    fn, args, info = exchange_program(ep, cfg, tokens, seed)
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    try:
        collectives = _count_collectives(compiled.as_text())
    except Exception:  # noqa: BLE001
        collectives = None
    (_, routed), _ = jax.block_until_ready(compiled(*args))
    z = np.asarray(args[0], np.float32)
    roundtrip = bool(np.allclose(np.asarray(routed, np.float32), z, rtol=1e-6, atol=0))  # every row there and back
    times = C.timed_calls(compiled, args, reps, warmup=2)
    del args, routed
    return dict(info, ms=1e3 * float(np.median(times)), times_s=times, compile_s=compile_s, roundtrip_ok=roundtrip,
                collectives=collectives)


# ----------------------------------------------------------------------------- the sweep
def run(quick: bool = False, out: str = "results", gpus: Optional[Sequence[int]] = None,
        layouts: Optional[Sequence[str]] = None, experts: Optional[int] = None, top_k: Optional[int] = None,
        d_model: Optional[int] = None, layers: Optional[int] = None, moe_hidden: Optional[int] = None,
        seq: Optional[int] = None, batch: Optional[int] = None, steps: Optional[int] = None,
        warmup: Optional[int] = None, compare_steps: Optional[int] = None, dtype: Optional[str] = None,
        lr: Optional[float] = None, a2a_reps: Optional[int] = None, data: Optional[str] = None,
        memory_backend: Optional[str] = None, impl: str = "auto", budget_s: Optional[float] = None,
        seed: int = 0) -> dict:
    """Every device count × layout (module doc); returns the JSON-able record."""
    start = time.perf_counter()
    b = make_budget(quick, experts=experts, top_k=top_k, d_model=d_model, layers=layers, moe_hidden=moe_hidden,
                    seq=seq, batch=batch, steps=steps, warmup=warmup, compare_steps=compare_steps, dtype=dtype, lr=lr,
                    a2a_reps=a2a_reps, data=data, memory_backend=memory_backend)
    if impl not in IMPLS:
        raise ValueError(f"--impl: must be one of {IMPLS}, got {impl!r}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"--budget-s: must be > 0, got {budget_s}")
    if gpus is None:
        gpus = [n for n in (1, 2, 4, 8) if n <= jax.device_count()]
    if jax.device_count() == 1:
        print(f"{NAME}: one device visible, so only the one-device baseline runs; on a CPU, "
              "XLA_FLAGS=--xla_force_host_platform_device_count=4 gives the script 4 devices", file=sys.stderr)
    runs = planned_runs(list(gpus), list(layouts or LAYOUTS), b)
    act = resolve_dtype(b)
    try:
        cfg = model_config(b, act)
    except ValueError as err:
        raise ValueError(f"model config from --d-model/--layers/--experts/--top-k: {err}") from None
    counts = accounting.param_counts(cfg)
    comps = accounting.component_counts(cfg)
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    batches, data_source = token_batches(b, seed)

    record = C.provenance(NAME, quick)
    record.update(
        budget=dataclasses.asdict(b), data_source=data_source, activation_dtype=act, impl_requested=impl, seed=seed,
        model={"name": cfg.name, "pattern": cfg.pattern, "params_total": counts["total"],
               "params_active": counts["active"], "params_routed_experts": comps.get("routed_experts", 0),
               "moe_layers": moe_layers, "config": dataclasses.asdict(cfg)},
        tolerance=TOLERANCE[act], env={k: os.environ.get(k) for k in ("XLA_FLAGS", "NCCL_NVLS_ENABLE")},
        methods={
            "step_time": f"median of steps {b.warmup + 1}..{b.steps} (each block_until_ready; batches pre-placed)",
            "xla_memory": "compiled step memory_analysis(): arguments + outputs - aliased + temporaries, per device",
            "measured_peak": "max memory_stats()['peak_bytes_in_use'] over the run's devices; per-process and "
                             "never reset: when it did not rise during the run it is only an upper bound ('<=')",
            "all_to_all_share": "MoE layers x (forward+backward of parallel.expert.ep_exchange alone, same mesh/"
                                "shapes/impl, identity experts) / step time; ignores overlap",
            "loss_agreement": f"max |loss - loss(n=1)| over the first {b.compare_steps} steps; tolerance "
                              f"{TOLERANCE[act]} ({act} activations)",
        })
    print(f"{cfg.name}: {counts['total'] / 1e6:.1f}M parameters ({comps.get('routed_experts', 0) / 1e6:.1f}M in "
          f"routed experts, {counts['active'] / 1e6:.1f}M active), {moe_layers} MoE layers, {act} activations; "
          f"global batch {b.batch} x {b.seq} tokens; {len(runs)} runs on {C.device_info()['description']}",
          flush=True)
    bar = C.progress(desc="ep_scaling", total=len(runs) * b.steps, unit="step")
    # float32 runs check exactness: on GPUs XLA's default float32 matmul is TF32 (10-bit mantissa),
    # whose rounding differs between layouts; bfloat16 runs keep the default.
    record["matmul_precision"] = "highest" if act == "float32" else "default"
    with jax.default_matmul_precision(record["matmul_precision"]):
        _sweep(runs, record, cfg, b, batches, impl, seed, bar, budget_s, start, moe_layers, act, out)
    bar.close()
    rows = record.setdefault("rows", [])
    compare_losses(rows, b.compare_steps, TOLERANCE[act])
    record.update(rows=rows, wall_s=time.perf_counter() - start)
    return C.finish(record, NAME, out, plot(record))


def _sweep(runs, record, cfg, b, batches, impl, seed, bar, budget_s, start, moe_layers, act, out) -> None:
    """Every planned run in turn; ``record['rows']`` and the files are rewritten after each."""
    rows = record.setdefault("rows", [])
    longest = 0.0
    for spec in runs:
        elapsed = time.perf_counter() - start
        if budget_s is not None and elapsed + longest > budget_s:
            rows.append(dict(spec, status="skipped", note=f"time budget: {elapsed:.0f} s used, a run takes up to "
                                                          f"{longest:.0f} s, --budget-s {budget_s:g}"))
            bar.update(b.steps)
            continue
        t_run = time.perf_counter()
        try:
            row = train_run(spec, cfg, b, batches, impl, seed, bar)
            parallel = row.pop("_parallel")
            row["status"] = "ok"
            if parallel is not None and parallel.expert_parallel is not None:
                bar.set_postfix(run=f"n={spec['n']} {spec['layout']}", phase="all-to-all")
                ex = time_exchange(parallel.expert_parallel, cfg, b.batch * b.seq, b.a2a_reps, seed)
                row["exchange"] = ex
                row["a2a_ms_per_step"] = moe_layers * ex["ms"]
                row["a2a_share"] = row["a2a_ms_per_step"] / row["step_ms"]
            else:
                row["a2a_share"] = None
            del parallel
        except Exception as err:  # noqa: BLE001 — inputs were checked up front; one failed run must not lose the others
            row = dict(spec, status="failed", note=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
        row["wall_s"] = time.perf_counter() - t_run
        longest = max(longest, row["wall_s"])
        rows.append(row)
        compare_losses(rows, b.compare_steps, TOLERANCE[act])
        record.update(rows=rows, wall_s=time.perf_counter() - start)
        C.finish(record, NAME, out, plot(record))         # rewritten after every run: a cut call keeps them


def compare_losses(rows: list[dict], compare_steps: int, tol: float) -> None:
    """Add ``max_abs_dloss`` (first ``compare_steps``), ``max_abs_dloss_all`` and ``loss_ok`` vs the n = 1 run."""
    base = next((r for r in rows if r["n"] == 1 and r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status") != "ok" or base is None:
            r.update(max_abs_dloss=None, max_abs_dloss_all=None, loss_ok=None)
            continue
        a, ref = np.asarray(r["losses"]), np.asarray(base["losses"])
        r["max_abs_dloss"] = float(np.max(np.abs(a[:compare_steps] - ref[:compare_steps])))
        r["max_abs_dloss_all"] = float(np.max(np.abs(a - ref)))
        r["loss_ok"] = bool(r["max_abs_dloss"] <= tol)


# ----------------------------------------------------------------------------- reporting
def plot(record: dict):
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if r.get("status") == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    base = next((r for r in rows if r["n"] == 1), None)
    for i, layout in enumerate(LAYOUTS):
        pts = sorted((r["n"], r["tokens_per_s_per_device"]) for r in rows if r["layout"] == layout)
        if base is not None:
            pts = [(1, base["tokens_per_s_per_device"])] + pts
        if len(pts) > (1 if base is not None else 0):
            axes[0].plot(*zip(*pts), "o-", color=f"C{i}", label=layout)
    if base is not None:
        axes[0].axhline(base["tokens_per_s_per_device"], color="k", ls=":", lw=1, label="1 device")
    ns = sorted({r["n"] for r in rows}) or [1]
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(ns, [str(n) for n in ns])
    axes[0].set_xlabel("devices")
    axes[0].set_ylabel("tokens / s / device")
    axes[0].set_title("throughput per device (median step)", fontsize=10)
    for j, r in enumerate(rows):
        label = f"n={r['n']} {r['layout']}" if r["n"] > 1 else "1 device"
        style = "-" if r["n"] == 1 else ("--" if r["layout"] == "dp" else ":")
        axes[1].plot(range(1, len(r["losses"]) + 1), r["losses"], style, color=f"C{j % 10}", label=label)
        if base is not None and r is not base:
            d = np.abs(np.asarray(r["losses"]) - np.asarray(base["losses"]))
            axes[2].plot(range(1, len(d) + 1), np.maximum(d, 1e-9), style, color=f"C{j % 10}", label=label)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("training loss")
    axes[1].set_title("loss curves (same global batches)", fontsize=10)
    axes[2].axhline(record["tolerance"], color="r", lw=1, label=f"tolerance {record['tolerance']:g}")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("|loss - loss(1 device)|")
    axes[2].set_title("loss difference vs 1 device", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    m = record["model"]
    fig.suptitle(f"EP scaling: {m['name']} ({m['params_total'] / 1e6:.1f}M params), {record['activation_dtype']}; "
                 f"{record['device']['description']}", fontsize=10)
    fig.tight_layout()
    return fig


def _mem(r: dict) -> str:
    v = r.get("measured_peak_bytes_per_device")
    if v is None:
        return "-"
    return ("" if r.get("measured_peak_is_own") else "<=") + C.fmt_bytes(v)


def table(record: dict) -> str:
    b, m = record["budget"], record["model"]
    out_rows = []
    for r in record["rows"]:
        if r.get("status") != "ok":
            out_rows.append([r["n"], r["layout"], r["mesh"], r.get("status"), "-", "-", "-", "-", "-", "-", "-",
                             r.get("note", "")])
            continue
        share = "-" if r["a2a_share"] is None else f"{100 * r['a2a_share']:.1f}%"
        dl = r.get("max_abs_dloss")
        flag = "" if r.get("loss_ok") in (True, None) else "EXCEEDS TOL"
        out_rows.append([r["n"], r["layout"], r["mesh"], f"{r['step_ms']:.4g}", f"{r['tokens_per_s_per_device']:.4g}",
                         share, "-" if r.get("impl") is None else r["impl"],
                         "-" if r["xla_bytes_per_device"] is None else C.fmt_bytes(r["xla_bytes_per_device"]), _mem(r),
                         f"{r['compile_s']:.1f}", "-" if dl is None else f"{dl:.2g}", flag])
    title = (f"EP scaling ({'quick' if record['quick'] else 'full'}): {m['name']}, {m['params_total'] / 1e6:.1f}M "
             f"params ({m['params_routed_experts'] / 1e6:.1f}M routed), {m['moe_layers']} MoE layers, "
             f"{record['activation_dtype']}; batch {b['batch']} x {b['seq']}, {b['steps']} steps (median after "
             f"{b['warmup']}); {record['device']['description']}; commit {(record.get('git_commit') or '?')[:10]}; "
             f"{record['date']}")
    lines = [C.format_table(["n", "layout", "mesh", "step ms", "tok/s/dev", "a2a share", "a2a impl", "XLA mem/dev",
                             "peak/dev", "compile s", f"max|dloss| (first {b['compare_steps']})", "flag"],
                            out_rows, title)]
    ex = [r for r in record["rows"] if r.get("exchange")]
    if ex:
        lines.append("")
        lines.append("all-to-all: " + "; ".join(
            f"n={r['n']} {r['layout']}: {r['exchange']['ms']:.3g} ms/layer x {m['moe_layers']} "
            f"({r['exchange']['impl']}, {C.fmt_bytes(r['exchange']['bytes_sent_per_device_forward'])} sent/dev/fwd"
            f"{'' if r['exchange']['roundtrip_ok'] else ', ROUND TRIP WRONG'})" for r in ex))
    lines.append(f"tolerance {record['tolerance']:g}; peak '<=': an earlier run's (per-process) peak, an upper bound")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv=None) -> dict:
    parser = C.make_parser(NAME, __doc__.splitlines()[0])
    parser.add_argument("--gpus", type=_ints, default=None,
                        help="comma-separated device counts (default: 1,2,4,8 up to jax.device_count())")
    parser.add_argument("--layouts", type=lambda t: [v for v in t.split(",") if v], default=None,
                        help=f"comma-separated subset of {','.join(LAYOUTS + EXTRA_LAYOUTS)} "
                             f"(default: {','.join(LAYOUTS)}; {','.join(EXTRA_LAYOUTS)} run only when named)")
    parser.add_argument("--experts", type=C.positive_int, default=None, help="routed experts (default 64; quick 8)")
    parser.add_argument("--top-k", type=C.positive_int, default=None, help="experts per token (default 4; quick 2)")
    parser.add_argument("--d-model", type=C.positive_int, default=None, help="model width (default 2048; quick 64)")
    parser.add_argument("--layers", type=C.positive_int, default=None, help="layers of KKKM... (default 8; quick 2)")
    parser.add_argument("--moe-hidden", type=C.positive_int, default=None, help="routed-expert hidden (d_model/2)")
    parser.add_argument("--seq", type=C.positive_int, default=None, help="sequence length (default 1024; quick 64)")
    parser.add_argument("--batch", type=C.positive_int, default=None, help="global batch (default 8; quick 8)")
    parser.add_argument("--steps", type=C.positive_int, default=None, help="training steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 5)")
    parser.add_argument("--compare-steps", type=C.positive_int, default=None,
                        help="first steps of the loss comparison (default 10)")
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="activations (auto: bf16 on GPU, f32 on CPU)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    parser.add_argument("--a2a-reps", type=C.positive_int, default=None, help="timed all-to-all repetitions")
    parser.add_argument("--data", default=None, choices=DATA, help="token stream (default stdlib bytes)")
    parser.add_argument("--impl", default="auto", choices=IMPLS, help="expert-parallel exchange")
    parser.add_argument("--memory-backend", default=None, choices=MEMORY_BACKENDS,
                        help="KDA chunked form: xla (default) or pallas (the kernels.delta kernels; avoids the XLA "
                             "form's [B,H,N,4,16,16,K] float32 sub-block scores, untested under sharded layouts)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip runs that would end past this many seconds (e.g. a job time limit)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return C.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
