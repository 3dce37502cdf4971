"""Benchmark the chunked delta-rule kernels on one GPU, side by side in one process.

Methods (bf16 q/k/v, H=16, D=K=V=128; fwd and fwd+bwd):

* ``pallas``  — our Pallas kernels (``kernels.delta``: ``chunk_kda``, ``chunk_delta_rule``,
  ``chunk_gated_delta_rule`` — what ``lineage_jax.memory``'s ``backend="pallas"`` calls; called
  directly so that ``--pallas_chunk`` can set their chunk size);
* ``xla``     — our XLA chunked form (``backend="xla"``: ``lineage_jax.memory.core.chunked``);
* ``fla``     — flash-linear-attention's Triton kernels (``chunk_kda``, ``chunk_delta_rule``,
  ``chunk_gated_delta_rule``; GDN forward only: its backward miscompiles on Triton 3.6 + Hopper);
* ``cudnn``   — causal softmax attention, ``jax.nn.dot_product_attention(implementation="cudnn")``.

Rules: ``kda`` (exact per-channel gate), ``kdab`` (KDA with bounded gates: ours with
``gate_lower_bound=-5``, fla with ``safe_gate=True``; the XLA form is plain KDA), ``delta``
(DeltaNet), ``gdn`` (Gated DeltaNet: ours runs the scalar-gate kernels). The benchmark gates
are ``-0.2·σ(z) >= -0.2`` (inside the bound).

Timing, the same way on both sides: the steady state — the median over 5 rounds of ``--reps``
(default 20) calls enqueued back to back and synchronized once (``block_until_ready`` /
``torch.cuda.synchronize``), in ms per call, so host dispatch overlaps the GPU's work as in a
training loop (:func:`time_jax`, :func:`time_torch`). ``--parts bench`` also records each call
synchronized alone (``ms_sync``: dispatch and synchronization latency included), and ``--parts
profile`` the GPU time of each kernel.
FLOPs and minimal HBM bytes are counted analytically (see :func:`delta_flops`); the roofline
(bf16 matmul rate, copy bandwidth) is measured in the same process.

Correctness is read from the timed functions themselves: each fwd+bwd jit returns
``(o, S, grads)`` and the Pallas results are compared with the XLA chunked form at the
benchmark shape (``check_at_bench_shape`` in the JSON, bf16 tolerance 1e-2). One jit per
(rule, method, mode) keeps Triton compiles (tens of seconds each) to a minimum. ``--parts check`` adds a small-shape f32/bf16 check with resets and an initial
state; ``--parts stages`` times the five Pallas kernels one by one (at ``--stages_shapes``, default
(2, 8192); state passes as the rule runs them, split where ``state_split`` says); ``--parts mosaic`` times the
Mosaic GPU state passes (``kernels.delta.mosaic_gpu``) beside the Triton ones and compares them;
``--parts ab --ab KNOBS`` times the Pallas kernels with ``--pallas_tuning`` (A) against the same with
``KNOBS`` changed (B) in one process, in alternating rounds, and reports each round's ratio B / A
(paired: drift of the GPU's clocks between processes does not enter it); ``--parts profile`` lists
the GPU time of every kernel inside one whole call, ours (``jax.profiler``, read by
``experiments.op_profile``) beside fla's (torch's profiler), at ``--shapes``.

Usage (on a GPU host; the ``fla`` method needs torch and flash-linear-attention (fla-core) importable)::

    python -m experiments.kernel_bench --budget_s 400                # roofline + bench
    python -m experiments.kernel_bench --parts check,stages          # subsets
    python -m experiments.kernel_bench --rules gdn,kdab --pallas_chunk 64   # a subset, 64-token chunks
    python -m experiments.kernel_bench --methods pallas,fla --fla_cache fla_cache   # fla's autotuning kept
    python -m experiments.kernel_bench --parts ab --ab fuse_output=0 --rules delta,gdn   # a knob, paired
    python -m experiments.kernel_bench --parts ab --ab chunk_size=64,num_warps_fwd=8 --ab_modes fwd   # C = 64, paired
    python -m experiments.kernel_bench --parts ab --shapes 1,32768 --pallas_tuning state_split=1 \
        --ab state_split=8,bv=128,num_warps_state=8                        # split state passes, paired
    python -m experiments.kernel_bench --parts profile --shapes 2,8192 --methods pallas,fla   # kernel by kernel
    python -m experiments.kernel_bench --parts ab --ab_ref OTHER/kernels/delta --ab_dtype f32   # two trees, f32 inputs
    python -m experiments.kernel_bench --parts profile --shapes 2,8192 --methods pallas --profile_dtype f32   # f32

Writes ``<out>/kernel_bench/kernel_bench.json`` (``--out``, default ``results``; the same record as
``kernel_bench.partial.json`` after each part, so a run cut short keeps what it measured) and
``kernel_bench.png``, a figure of what the parts timed: the bench's ms per call, the ``ab`` ratios,
the ``profile``'s GPU time per call and the ``stages``' per-kernel times. There is no ``--quick``:
the parts time GPU kernels (the tests run them on the CPU at tiny sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common as C  # noqa: E402

SHAPES = ((2, 8192), (8, 2048), (1, 32768))
H, D, CHUNK = 16, 128, 64
RULES = ("kda", "kdab", "delta", "gdn")
METHODS = ("pallas", "xla", "fla", "cudnn")
NAME = "kernel_bench"
PARTS = ("roofline", "check", "bench", "stages", "mosaic", "ab", "profile")
AB_ROUNDS = 5  # --parts ab: alternating rounds of A and B
GATE_BOUND = -5.0  # kdab: K3's bounded gate
PALLAS_TUNING = {}  # --pallas_tuning, e.g. {"bv": 32, "num_warps": 8, "num_warps_state": 8}
WARPS = tuple(int(w) for w in os.environ.get("BENCH_WARPS", "4").split(","))


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------
def delta_flops(B, T, H, D, C=CHUNK):
    """Matmul FLOPs of the chunked WY/UT form, per direction (dense tiles counted in full).

    Forward per chunk: A and M (2·2C²D), the solve applied to [V | K] (2C²·2D),
    Ũ = U − WS and S += k_outᵀŨ and q_in S (3·2CD²), MŨ (2C²D): 10C²D + 6CD².
    Backward: 22C²D + 12CD² (state pass 3 CD² products + MᵀdO; dq_in, dW, dk_out;
    dM, recomputed A, the transposed solve, dA, and the four score gradients).
    """
    n = B * H * (T // C)
    fwd = n * (10 * C * C * D + 6 * C * D * D)
    bwd = n * (22 * C * C * D + 12 * C * D * D)
    return fwd, fwd + bwd


def delta_bytes(B, T, H, D, rule):
    """Fewest HBM bytes: inputs read once, outputs written once (bf16 q/k/v/o, f32 g)."""
    tok = B * T * H
    g_bytes = 4 * D if rule in ("kda", "kdab") else (4 if rule == "gdn" else 0)
    fwd = tok * (3 * 2 * D + g_bytes + 2 + 2 * D)
    bwd = tok * (3 * 2 * D + g_bytes + 2 + 2 * D) + tok * (3 * 2 * D + g_bytes + 2)  # + dO read, grads written
    return fwd, fwd + bwd


def attn_flops(B, T, H, D):
    fwd = 2 * B * H * T * T * D  # causal: half of 4·T²·D
    return fwd, int(3.5 * fwd)


def attn_bytes(B, T, H, D):
    tok = B * T * H
    return tok * 4 * 2 * D, tok * 4 * 2 * D + tok * 4 * 2 * D


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------
ROUNDS = 5


def time_jax(f, *args, reps=20, warmup=3, rounds=ROUNDS):
    """ms per call in steady state: the median over ``rounds`` of ``reps`` calls enqueued back to back
    and synchronized once (host dispatch overlaps the GPU's work, as in a training loop), after one
    compiling and ``warmup`` calls."""
    jax.block_until_ready(f(*args))
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(ts)


def time_jax_sync(f, *args, reps=20, warmup=3):
    """Median wall-clock ms of ``reps`` calls, each synchronized (dispatch and sync latency included)."""
    jax.block_until_ready(f(*args))
    return 1e3 * statistics.median(C.timed_calls(f, args, reps, warmup))


def time_torch(fn, reps=20, warmup=3, rounds=ROUNDS):
    """:func:`time_jax`'s steady state for a torch callable (``torch.cuda.synchronize`` once a round)."""
    import torch
    fn()
    torch.cuda.synchronize()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(ts)


def time_torch_sync(fn, reps=20, warmup=3):
    """:func:`time_jax_sync` for a torch callable."""
    import torch
    for _ in range(warmup + 1):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def measure_roofline():
    n = 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    mmf = jax.jit(lambda a, b: a @ b)
    ms = time_jax(mmf, a, b, reps=10)
    tflops = 2 * n ** 3 / (ms * 1e-3) / 1e12
    x = jax.random.normal(jax.random.PRNGKey(2), (1024, 1024, 1024), jnp.bfloat16)  # 2 GiB
    cp = jax.jit(lambda x: x + 1)
    ms2 = time_jax(cp, x, reps=10)
    tbs = 2 * x.size * 2 / (ms2 * 1e-3) / 1e12
    del a, b, x
    return {"bf16_matmul_tflops": tflops, "copy_tbs": tbs}


# ---------------------------------------------------------------------------
# Inputs and functions
# ---------------------------------------------------------------------------
def make_inputs(B, T, dtype=jnp.bfloat16, seed=0, gate_scale=1.0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, H, D), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, D), jnp.float32)
    # KDA-style bounded gates in (-5 ... 0) scaled down: -gate_scale * sigmoid(z) * small
    g = -gate_scale * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, D))) * 0.2
    gs = -gate_scale * jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))) * 0.2
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, H)))
    do = jax.random.normal(ks[6], (B, T, H, D), jnp.float32)
    c = lambda x: x.astype(dtype)  # noqa: E731
    return dict(q=c(q), k=c(k), v=c(v), g=g, gs=gs, beta=c(beta), do=c(do))


def rule_fn(rule, backend, chunk_size=None, tuning=None, kd=None, **kw):
    """``tuning``: the Pallas launch knobs (default ``--pallas_tuning``); ``kd``: the kernel package
    (default this tree's ``kernels.delta``; :func:`load_kernels` loads another checkout's)."""
    from lineage_jax import memory as M

    if backend == "pallas":
        if kd is None:
            from kernels import delta as kd
        kw = dict(kw, chunk_size=chunk_size)
        kw.update(PALLAS_TUNING if tuning is None else tuning)  # a chunk_size knob (--ab) overrides
        if rule == "kda":
            return lambda q, k, v, g, gs, beta: kd.chunk_kda(q, k, v, g, beta, **kw)
        if rule == "kdab":
            return lambda q, k, v, g, gs, beta: kd.chunk_kda(q, k, v, g, beta, gate_lower_bound=GATE_BOUND, **kw)
        if rule == "gdn":
            return lambda q, k, v, g, gs, beta: kd.chunk_gated_delta_rule(q, k, v, gs, beta, **kw)
        return lambda q, k, v, g, gs, beta: kd.chunk_delta_rule(q, k, v, beta, **kw)
    if rule in ("kda", "kdab"):
        return lambda q, k, v, g, gs, beta: M.kda(q, k, v, g, beta, backend=backend, **kw)
    if rule == "gdn":
        return lambda q, k, v, g, gs, beta: M.gated_delta_rule(q, k, v, gs, beta, backend=backend, **kw)
    return lambda q, k, v, g, gs, beta: M.delta_rule(q, k, v, beta, backend=backend, **kw)


def jax_fwd(fn):
    return jax.jit(lambda q, k, v, g, gs, beta: fn(q, k, v, g, gs, beta)[0])


# The inputs each rule reads, by position in ``INPUT_NAMES``: fla's call takes these (in this order),
# and our fwd+bwd call takes gradients of these only, as fla's does (a zero gradient of an unread
# [B, T, H, K] gate would be written to memory on every call).
INPUT_NAMES = ("q", "k", "v", "g", "gs", "beta")
RULE_ARGS = {"kda": (0, 1, 2, 3, 5), "kdab": (0, 1, 2, 3, 5), "gdn": (0, 1, 2, 4, 5), "delta": (0, 1, 2, 5)}


def jax_fwdbwd(fn, wrt=tuple(range(6))):
    """One jit: forward and the vjp w.r.t. the inputs at positions ``wrt``; returns ``(o, S, grads)``
    (the check reads them, timing too)."""
    def f(q, k, v, g, gs, beta, do):
        args = [q, k, v, g, gs, beta]

        def part(*diff):
            full = list(args)
            for i, a in zip(wrt, diff):
                full[i] = a
            return fn(*full)

        (o, S), pull = jax.vjp(part, *(args[i] for i in wrt))
        return o, S, pull((do, jnp.zeros_like(S)))
    return jax.jit(f)


def rule_call(fn, mode, x, rule):
    """``(jitted call, its arguments)``: ``fn`` (a :func:`rule_fn` of ``rule``) as a forward
    (``mode="fwd"``) or forward and vjp w.r.t. the rule's inputs (``"fwdbwd"``) on
    :func:`make_inputs`' arrays ``x``."""
    a6 = (x["q"], x["k"], x["v"], x["g"], x["gs"], x["beta"])
    return (jax_fwd(fn), a6) if mode == "fwd" else (jax_fwdbwd(fn, RULE_ARGS[rule]), (*a6, x["do"]))


# ---------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------
def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dgs", "dbeta")


def compare(out_p, out_x, tol, wrt=tuple(range(6))):
    """Relative errors of ``o``, the final state and the gradients w.r.t. the inputs at ``wrt``."""
    o1, s1, g1 = out_p
    o0, s0, g0 = out_x
    e = {"o": rel(o1, o0), "S": rel(s1, s0)}
    for nm, a, b in zip([GRAD_NAMES[i] for i in wrt], g1, g0):
        if float(jnp.max(jnp.abs(jnp.asarray(b, jnp.float32)))) > 0:
            e[nm] = rel(a, b)
    e["pass"] = all(v <= tol for v in e.values() if isinstance(v, float))
    return e


def part_check(results, rules=RULES, chunk_size=None):
    """Small-shape check with resets + initial state + odd T (pallas vs XLA chunked)."""
    out = {}
    B, T = 2, 300
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
        x = make_inputs(B, T, dtype, seed=1, gate_scale=5.0)
        seg = jnp.asarray(np.repeat(np.array([[0] * 97 + [1] * 120 + [2] * 83]), B, 0), jnp.int32)
        S0 = 0.5 * jax.random.normal(jax.random.PRNGKey(9), (B, H, D, D), jnp.float32)
        args = (x["q"], x["k"], x["v"], x["g"], x["gs"], x["beta"])
        for rule in rules:
            name = f"{rule}/{jnp.dtype(dtype).name}"
            try:
                outs = {}
                for backend in ("xla", "pallas"):
                    fn = rule_fn(rule, backend, chunk_size=chunk_size if backend == "pallas" else None,
                                 initial_state=S0, segment_ids=seg)
                    # the reference runs on f32 copies of the same (rounded) inputs: f32 gradients, and
                    # f32 products (on GPUs the default float32 matmul is TF32, ~1e-3 off)
                    a = tuple(t.astype(jnp.float32) for t in args) if backend == "xla" else args
                    with jax.default_matmul_precision("highest" if backend == "xla" else None):
                        do = x["do"].astype(jnp.float32 if backend == "xla" else dtype)
                        outs[backend] = jax_fwdbwd(fn, RULE_ARGS[rule])(*a, do)
                out[name] = compare(outs["pallas"], outs["xla"], tol, RULE_ARGS[rule])
                log("check", name, out[name])
            except Exception as ex:  # noqa: BLE001
                traceback.print_exc()
                out[name] = {"error": repr(ex)[:2000], "pass": False}
    results["check"] = out
    return all(v.get("pass") for v in out.values())


def part_stages(results, B=2, T=8192, rules=RULES, chunk_size=None, key="stages"):
    """Per-kernel times of the Pallas kernels at one shape, into ``results[key]``."""
    from kernels.delta import api
    out = {}
    x = make_inputs(B, T)
    for rule in rules:
        for nw in WARPS:
            try:
                g = {"kda": x["g"], "kdab": x["g"], "gdn": x["gs"]}.get(rule)
                extra = {"gate_lower_bound": GATE_BOUND} if rule == "kdab" else {}
                tuning = dict(PALLAS_TUNING, num_warps=nw, chunk_size=chunk_size, **extra)
                s, args = api._debug_spec(x["q"], x["k"], x["v"], g, x["beta"], **tuning)
                s = api._train_spec(s)  # the kernels as a differentiated call runs them (qk_arrays="auto")
                q, k, v, g, beta, doc, h0 = args
                f1 = jax.jit(lambda *a: api._intra_fwd(s, *a))
                t1 = time_jax(f1, q, k, v, g, beta, doc)
                W, U, M, qin, kout, dend, KK = f1(q, k, v, g, beta, doc)
                qk = api._qk(s, q, k, qin, kout)  # DeltaNet, GDN: q, k (and their row factors)
                # the state passes as the rule runs them (split into segments where Spec.state_split > 1)
                f2 = jax.jit(lambda *a: api._state_forward(s, *a))
                t2 = time_jax(f2, W, U, qk, dend, h0)
                (h, ut, sT), A = f2(W, U, qk, dend, h0)
                f3 = jax.jit(lambda *a: api._output(s, *a, q.dtype))
                t3 = time_jax(f3, qk.arrays(s, s.store_dtype)[0], h, M, ut)
                # the forward state pass taking the output (Spec.fuse_output): with h (training) and without
                f23 = jax.jit(lambda *a: api._state_forward(s, *a, out_dtype=q.dtype))
                t23 = time_jax(f23, W, U, qk, dend, h0, M)
                f23n = jax.jit(lambda *a: api._state_forward(s, *a, out_dtype=q.dtype, store_h=False))
                t23n = time_jax(f23n, W, U, qk, dend, h0, M)
                do = x["do"]
                f4 = jax.jit(lambda *a: api._state_backward(s, *a))
                t4 = time_jax(f4, A, M, do, qk, W, dend, sT)
                dh, dut, dh0 = f4(A, M, do, qk, W, dend, sT)
                f5 = jax.jit(lambda *a: api._intra_bwd(s, *a))
                t5 = time_jax(f5, q, k, v, g, beta, doc, KK, ut, dut, do, h, dh)
                r = {"intra_fwd": t1, "state_fwd": t2, "output": t3, "state_fwd_output": t23,
                     "state_fwd_output_no_h": t23n, "state_bwd": t4, "intra_bwd": t5}
                out[f"{rule}/warps{nw}"] = r
                log("stages", rule, "warps", nw, {k: round(v, 3) for k, v in r.items()})
            except Exception as ex:  # noqa: BLE001
                traceback.print_exc()
                out[f"{rule}/warps{nw}"] = {"error": repr(ex)[:2000]}
    results[key] = out


def part_mosaic(results, shapes, reps):
    """The Mosaic GPU state passes (``kernels.delta.mosaic_gpu``) beside the Triton ones on the same
    laid-out inputs (bf16, DeltaNet-style per-key decays ``d = e^{-u}``, ``u ~ U(0, 1)``): the largest
    relative difference of each output and the time of each pass."""
    from kernels.delta import api
    from kernels.delta import mosaic_gpu as mg
    out = {}
    for B, T in shapes:
        try:
            C = api.default_chunk("gpu")
            N = T // C
            ks = jax.random.split(jax.random.key(0), 9)
            r = lambda i, shape: jax.random.uniform(ks[i], shape, minval=-0.1, maxval=0.1).astype(jnp.bfloat16)  # noqa: E731
            W, U, ko, qi, do = (r(i, (B, T, H, D)) for i in range(5))
            M = r(5, (B, T, H, C))
            d = jnp.exp(-jax.random.uniform(ks[6], (B, N, H, D, 1)))
            h0 = jax.random.normal(ks[7], (B, H, D, D))
            z = jnp.zeros((B, T, H, D), jnp.bfloat16)
            # per-channel gates: the Triton passes take q_in and k_out as arrays, as the Mosaic GPU ones do
            # unsplit passes, and the Triton backward pass in the Triton column (its default, state_bwd="auto",
            # takes the Mosaic GPU pass at 256 programs or more)
            s, _ = api._debug_spec(z, z, z, z.astype(jnp.float32), z[..., 0], state_split=1, state_bwd="triton")
            it = s.interpret  # the CPU: both in their interpreters
            fns = {"mosaic fwd": jax.jit(lambda: mg.state_fwd(W, U, ko, d, h0, chunk=C, interpret=it)),
                   "triton fwd": jax.jit(lambda: api._state_fwd(s, W, U, api._QK(None, ko), d, h0)),
                   "mosaic bwd": jax.jit(lambda: mg.state_bwd(M, do, ko, qi, W, d, h0, chunk=C, interpret=it)),
                   "triton bwd": jax.jit(lambda: api._state_bwd(s, M, do, api._QK(qi, ko), W, d, h0))}
            res = {name: jax.block_until_ready(f()) for name, f in fns.items()}

            r_ = {f"{m}_ms": time_jax(f, reps=reps) for m, f in fns.items()}
            for x in ("fwd", "bwd"):
                r_[f"{x}_rel_diff"] = [rel(a, b) for a, b in zip(res[f"mosaic {x}"], res[f"triton {x}"])]
            out[f"{B}x{T}"] = r_
            log("mosaic", B, T, {k: (round(v, 3) if isinstance(v, float) else [f"{e:.1e}" for e in v])
                                 for k, v in r_.items()})
        except Exception as ex:  # noqa: BLE001
            traceback.print_exc()
            out[f"{B}x{T}"] = {"error": repr(ex)[:2000]}
    results["mosaic"] = out


def use_fla_cache(path: str) -> None:
    """Point Triton's cache (compiled kernels and, with ``TRITON_CACHE_AUTOTUNING``, the autotuner's
    timings) at ``path`` before fla imports Triton, so that a later call with the same directory
    reuses fla's autotuning instead of compiling and timing every configuration again."""
    os.makedirs(path, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = os.path.abspath(path)
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"


def load_fla():
    """fla's chunked kernels by rule name, or ``None`` (logged) where fla is not importable."""
    try:
        from fla.ops.delta_rule import chunk_delta_rule as fla_delta
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
        from fla.ops.kda import chunk_kda as fla_kda
    except Exception as ex:  # noqa: BLE001
        log("fla unavailable:", repr(ex)[:300])
        return None
    return dict(kda=fla_kda, delta=fla_delta, gdn=fla_gdn,
                kdab=lambda *a: fla_kda(*a, safe_gate=True, lower_bound=GATE_BOUND))


def torch_inputs(x):
    """torch copies (on the same GPU) of :func:`make_inputs`' arrays."""
    from torch.utils import dlpack as tdl
    return {n: tdl.from_dlpack(jax.block_until_ready(a)).clone() for n, a in x.items()}


def fla_call(fla, rule, mode, tx):
    """One fla call of ``rule`` as a closure: the forward under ``no_grad``, or forward and backward."""
    import torch
    ins = [tx[INPUT_NAMES[i]] for i in RULE_ARGS[rule]]  # fla's argument order: q, k, v[, gate], beta
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fla[rule](*ins)
        return run
    ins = [t.detach().clone().requires_grad_(True) for t in ins]

    def run_bwd():
        o = fla[rule](*ins)[0]
        o.backward(tx["do"])
        for t in ins:
            t.grad = None
    return run_bwd


def part_bench(results, shapes, reps, methods, pallas_ok, over=lambda: False, rules=RULES, chunk_size=None):
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        have_torch = False
    fla = load_fla() if have_torch and "fla" in methods else None
    rows = results.setdefault("bench", [])
    for (B, T) in shapes:
        x = make_inputs(B, T)
        for rule in rules:
            fl_f, fl_fb = delta_flops(B, T, H, D)
            by_f, by_fb = delta_bytes(B, T, H, D, rule)
            outs = {}
            for method in ("pallas", "xla"):
                if method not in methods:
                    continue
                fn = rule_fn(rule, method, chunk_size=chunk_size if method == "pallas" else None)
                for mode in ("fwdbwd", "fwd"):
                    if mode == "fwdbwd" and rule == "gdn" and method == "pallas" and over():
                        continue
                    ms_sync = None
                    try:
                        f, args = rule_call(fn, mode, x, rule)
                        if mode == "fwdbwd":
                            outs[method] = f(*args)
                        ms = time_jax(f, *args, reps=reps)
                        ms_sync = time_jax_sync(f, *args, reps=reps)
                    except Exception as ex:  # noqa: BLE001
                        traceback.print_exc()
                        ms = None
                        log("FAIL", method, rule, mode, repr(ex)[:300])
                    rows.append(dict(B=B, T=T, rule=rule, method=method, mode=mode, ms=ms, ms_sync=ms_sync,
                                     flops=fl_f if mode == "fwd" else fl_fb, bytes=by_f if mode == "fwd" else by_fb))
                    log("bench", B, T, rule, method, mode, ms)
            if "pallas" in outs and "xla" in outs:
                e = compare(outs["pallas"], outs["xla"], 1e-2, RULE_ARGS[rule])
                results.setdefault("check_at_bench_shape", {})[f"{rule}/({B},{T})/bf16"] = e
                log("check", rule, (B, T), e)
            outs.clear()
            if fla is not None and not over():
                tx = None
                for mode in ("fwd", "fwdbwd"):
                    if rule == "gdn" and mode == "fwdbwd":
                        continue  # fla's GDN backward miscompiles on Triton 3.6 + Hopper
                    ms_sync = None
                    try:
                        tx = torch_inputs(x) if tx is None else tx
                        run = fla_call(fla, rule, mode, tx)
                        ms = time_torch(run, reps=reps)
                        ms_sync = time_torch_sync(run, reps=reps)
                    except Exception as ex:  # noqa: BLE001
                        traceback.print_exc()
                        ms = None
                        log("FAIL fla", rule, mode, repr(ex)[:300])
                    rows.append(dict(B=B, T=T, rule=rule, method="fla", mode=mode, ms=ms, ms_sync=ms_sync,
                                     flops=fl_f if mode == "fwd" else fl_fb, bytes=by_f if mode == "fwd" else by_fb))
                    log("bench", B, T, rule, "fla", mode, ms)
        if "cudnn" in methods and not over():
            af, afb = attn_flops(B, T, H, D)
            ab, abb = attn_bytes(B, T, H, D)
            att = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
            for mode in ("fwd", "fwdbwd"):
                try:
                    if mode == "fwd":
                        ms = time_jax(jax.jit(att), x["q"], x["k"], x["v"], reps=reps)
                    else:
                        f = jax.jit(lambda q, k, v, do: jax.vjp(att, q, k, v)[1](do))
                        ms = time_jax(f, x["q"], x["k"], x["v"], x["do"], reps=reps)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                    ms = None
                rows.append(dict(B=B, T=T, rule="attention", method="cudnn", mode=mode, ms=ms,
                                 flops=af if mode == "fwd" else afb, bytes=ab if mode == "fwd" else abb))
                log("bench", B, T, "attention cudnn", mode, ms)
        del x


PROFILE_CALLS = 5


def torch_profile(run, calls=PROFILE_CALLS, top=20) -> dict:
    """GPU time per call of each CUDA kernel ``run()`` launches (torch's profiler), largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((e.key, us / 1e3 / calls, e.count / calls))
    rows.sort(key=lambda r: -r[1])
    return {"busy_ms_per_call": sum(r[1] for r in rows),
            "top": [{"name": n[:160], "ms_per_call": ms, "launches_per_call": c} for n, ms, c in rows[:top]]}


def part_profile(results, shapes, rules=RULES, methods=("pallas", "fla"), chunk_size=None, over=lambda: False,
                 dtype="bf16"):
    """Per-kernel GPU time inside one whole call, ours (the Pallas kernels and XLA's own ops, from
    ``jax.profiler``'s trace: ``experiments.op_profile``) beside fla's (torch's profiler), per
    (shape, rule, mode); into ``results["profile"]``. ``dtype`` (``--profile_dtype``, a key of ``AB_DTYPES``):
    q, k, v and β in bf16 (the benchmark's) or f32; f32 keys end in `` f32``."""
    from experiments import op_profile
    fla = None
    if "fla" in methods:
        try:
            import torch
            fla = load_fla() if torch.cuda.is_available() else None
        except Exception:  # noqa: BLE001
            fla = None
    out = results.setdefault("profile", {})
    tag = "" if dtype == "bf16" else f" {dtype}"
    keys = {(B, T): [(rule, mode, f"({B}, {T}) {rule} {mode}{tag}") for rule in rules for mode in ("fwd", "fwdbwd")]
            for (B, T) in shapes}
    # all of ours first, at every shape: once torch's profiler has subscribed to CUPTI, jax.profiler's tracer cannot
    for (B, T) in shapes if "pallas" in methods else ():
        if over():
            log("budget reached: skipping profile", (B, T))
            continue
        x = make_inputs(B, T, AB_DTYPES[dtype])
        for rule, mode, key in keys[B, T]:
            try:
                f, args = rule_call(rule_fn(rule, "pallas", chunk_size=chunk_size), mode, x, rule)
                jax.block_until_ready(f(*args))
                s = op_profile.profile(lambda: f(*args), calls=PROFILE_CALLS, top=20)
                out[key + " pallas"] = {"busy_ms_per_call": s["busy_ms_per_call"], "source": s["source"],
                                        "top": s["top"]}
            except Exception as ex:  # noqa: BLE001
                traceback.print_exc()
                out[key + " pallas"] = {"error": repr(ex)[:2000]}
        del x
    for (B, T) in shapes if fla is not None else ():
        if over():
            log("budget reached: skipping fla profile", (B, T))
            continue
        tx = None
        for rule, mode, key in keys[B, T]:
            if rule == "gdn" and mode == "fwdbwd":
                continue  # fla's GDN backward miscompiles on Triton 3.6 + Hopper
            try:
                tx = torch_inputs(make_inputs(B, T, AB_DTYPES[dtype])) if tx is None else tx
                out[key + " fla"] = torch_profile(fla_call(fla, rule, mode, tx))
            except Exception as ex:  # noqa: BLE001
                traceback.print_exc()
                out[key + " fla"] = {"error": repr(ex)[:2000]}
        del tx
    for key in (key for shape_keys in keys.values() for _, _, key in shape_keys):
        table = profile_table(results, key)
        if table:
            log(table)


def profile_table(results, key) -> str:
    """The kernels of ``key`` (``"(B, T) rule mode"``) per method, ms per call."""
    lines = []
    for method in ("pallas", "fla"):
        r = results.get("profile", {}).get(f"{key} {method}")
        if r is None:
            continue
        if "error" in r:
            lines.append(f"profile {key} {method}: {r['error'][:200]}")
            continue
        lines.append(f"profile {key} {method}: busy {r['busy_ms_per_call']:.3f} ms per call")
        lines += [f"    {t['ms_per_call']:7.3f} ms x{t['launches_per_call']:g}  {t['name'][:100]}" for t in r["top"]]
    return "\n".join(lines)


AB_MODES = ("fwdbwd", "fwd")


def load_kernels(path):
    """The kernel package ``kernels/delta`` of another checkout (``path``: its folder, e.g. from ``git
    worktree add DIR COMMIT``: ``DIR/kernels/delta``), imported beside this tree's as
    ``kernels.delta_ref`` (it imports itself relatively)."""
    import importlib.util
    import sys
    init = os.path.join(path, "__init__.py")
    if not os.path.isfile(init):
        raise FileNotFoundError(f"--ab_ref: no kernel package at {path!r} (expected {init})")
    spec = importlib.util.spec_from_file_location("kernels.delta_ref", init, submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kernels.delta_ref"] = mod
    spec.loader.exec_module(mod)
    return mod


AB_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def part_ab(results, shapes, reps, knobs_b, rules=RULES, chunk_size=None, over=lambda: False, modes=AB_MODES,
            ref=None, gate_scale=1.0, dtype="bf16"):
    """Pallas with ``--pallas_tuning`` (A) against the same with ``knobs_b`` changed (B), paired: per
    (shape, rule, mode) both are compiled, then timed in ``AB_ROUNDS`` alternating rounds of ``reps``
    calls (A B, B A, ...); the row keeps each round's medians and the median of the rounds' B / A.
    ``ref`` (``--ab_ref``: a kernel package from :func:`load_kernels`): A runs that package's kernels,
    B this tree's — two versions of the code paired in one process. ``gate_scale`` (``--ab_gate_scale``)
    multiplies the benchmark's log-decays (default in (−0.2, 0) per token; 400 puts every 16-token tile's
    gate sum far below −64, so no exact-gate KDA tile can be anchored). ``dtype`` (``--ab_dtype``, a key of
    ``AB_DTYPES``): q, k, v and β in bf16 (the benchmark's) or f32 (the kernels' f32-accurate paths)."""
    tun_a = dict(PALLAS_TUNING)
    tun_b = dict(PALLAS_TUNING, **knobs_b)
    rows = results.setdefault("ab", [])
    for (B, T) in shapes:
        if over():
            log("budget reached: skipping ab", (B, T))
            continue
        x = make_inputs(B, T, AB_DTYPES[dtype], gate_scale=gate_scale)
        for rule in rules:
            for mode in modes:
                fs = []
                ta, tb = [], []
                try:
                    for tun, kd in ((tun_a, ref), (tun_b, None)):
                        f, args = rule_call(rule_fn(rule, "pallas", chunk_size=chunk_size, tuning=tun, kd=kd), mode,
                                            x, rule)
                        jax.block_until_ready(f(*args))  # compile
                        fs.append(f)
                    for i in range(AB_ROUNDS):
                        order = (0, 1) if i % 2 == 0 else (1, 0)
                        for j in order:
                            (ta if j == 0 else tb).append(time_jax(fs[j], *args, reps=reps, rounds=1))
                except Exception as ex:  # noqa: BLE001  (one failing pair: recorded, the others still run)
                    traceback.print_exc()
                    side = "B" if len(fs) == 1 else "A" if not fs else "timing"
                    rows.append(dict(B=B, T=T, rule=rule, mode=mode, a=tun_a, b=tun_b, a_ref=ref is not None,
                                     gate_scale=gate_scale, dtype=dtype, error=f"{side}: {ex!r}"[:2000]))
                    log("FAIL ab", B, T, rule, mode, dtype, side, repr(ex)[:300])
                    continue
                ratios = [b / a for a, b in zip(ta, tb)]
                row = dict(B=B, T=T, rule=rule, mode=mode, a=tun_a, b=tun_b, a_ms=ta, b_ms=tb, a_ref=ref is not None,
                           gate_scale=gate_scale, dtype=dtype,
                           a_median=statistics.median(ta), b_median=statistics.median(tb),
                           b_over_a=statistics.median(ratios), b_over_a_range=[min(ratios), max(ratios)])
                rows.append(row)
                log("ab", B, T, rule, mode, dtype, f"A {row['a_median']:.3f} ms  B {row['b_median']:.3f} ms  "
                    f"B/A {row['b_over_a']:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")


def ab_table(results) -> str:
    lines = ["| (B, T) | rule | mode | A ms | B ms | B / A (median of rounds) | range |", "|---|---|---|---|---|---|---|"]
    for r in results.get("ab", []):
        if "error" in r:
            lines.append(f"| ({r['B']}, {r['T']}) | {r['rule']} | {r['mode']} | failed: {r['error'][:120]} | | | |")
            continue
        lines.append(f"| ({r['B']}, {r['T']}) | {r['rule']} | {r['mode']} | {r['a_median']:.2f} | "
                     f"{r['b_median']:.2f} | {r['b_over_a']:.3f} | {r['b_over_a_range'][0]:.3f}–"
                     f"{r['b_over_a_range'][1]:.3f} |")
    return "\n".join(lines)


def summarize(results):
    roof = results.get("roofline", {})
    peak_f = roof.get("bf16_matmul_tflops", 790.0) * 1e12
    peak_b = roof.get("copy_tbs", 4.3) * 1e12
    rows = results.get("bench", [])
    idx = {(r["B"], r["T"], r["rule"], r["method"], r["mode"]): r["ms"] for r in rows}
    sync = {(r["B"], r["T"], r["rule"], r["method"], r["mode"]): r.get("ms_sync") for r in rows}
    for r in rows:
        if r["ms"]:
            floor = max(r["flops"] / peak_f, r["bytes"] / peak_b) * 1e3
            r["pct_roofline"] = 100 * floor / r["ms"]
            r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
    lines = ["| (B, T) | rule | mode | pallas ms | xla ms | fla ms | cudnn attn ms | xla/pallas | pallas/fla | "
             "pallas % roofline | synchronized calls: pallas / fla ms |", "|---" * 11 + "|"]
    for (B, T) in sorted({(r["B"], r["T"]) for r in rows}, key=lambda s: s[1]):
        for rule in RULES:
            for mode in ("fwd", "fwdbwd"):
                p = idx.get((B, T, rule, "pallas", mode))
                xl = idx.get((B, T, rule, "xla", mode))
                fl = idx.get((B, T, rule, "fla", mode))
                cu = idx.get((B, T, "attention", "cudnn", mode))
                pr = next((r.get("pct_roofline") for r in rows if (r["B"], r["T"], r["rule"], r["method"], r["mode"])
                           == (B, T, rule, "pallas", mode)), None)
                f = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
                ratio = lambda a, b: "—" if (a is None or b is None) else f"{a / b:.2f}×"  # noqa: E731
                ps, fs = sync.get((B, T, rule, "pallas", mode)), sync.get((B, T, rule, "fla", mode))
                lines.append(f"| ({B}, {T}) | {rule} | {mode} | {f(p)} | {f(xl)} | {f(fl)} | {f(cu)} | "
                             f"{ratio(xl, p)} | {ratio(p, fl)} | {f(pr)} | {f(ps)} / {f(fs)} ({ratio(ps, fs)}) |")
    results["table"] = "\n".join(lines)
    return results["table"]


def plot(results):
    """A figure of what the parts timed: per mode the bench's ms per call (log scale), the ``ab`` rows'
    B / A (median and range of the rounds), the ``profile``'s GPU time per call and the ``stages``'
    per-kernel times; a note where no part timed anything."""
    import matplotlib.pyplot as plt

    bench = [r for r in results.get("bench", []) if r["ms"]]
    ab = [r for r in results.get("ab", []) if "error" not in r]
    prof = {k: r for k, r in results.get("profile", {}).items() if "busy_ms_per_call" in r}
    stages = {f"{key} {name}": r for key, part in results.items() if key.startswith("stages") and isinstance(part, dict)
              for name, r in part.items() if "error" not in r}
    panels = [(n, h) for n, h, on in (("ab", 0.3 * len(ab) + 1.2, ab), ("profile", 0.3 * len(prof) + 1.2, prof),
                                       ("stages", 0.3 * len(stages) + 1.5, stages)) if on]
    heights = ([4.5] if bench else []) + [h for _, h in panels]
    if not heights:
        fig, ax = plt.subplots(figsize=(7, 1.5))
        ax.axis("off")
        roof = results.get("roofline")
        ax.text(0.5, 0.5, f"nothing timed to plot (parts: {results.get('parts')})"
                + (f"\nroofline: {roof}" if roof else ""), ha="center", va="center", fontsize=8, wrap=True)
        return fig
    fig = plt.figure(figsize=(13, sum(heights) + 0.5))
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    row = 0
    if bench:
        shapes = sorted({(r["B"], r["T"]) for r in bench}, key=lambda s: s[1])
        for col, mode in enumerate(("fwd", "fwdbwd")):
            ax = fig.add_subplot(grid[0, col])
            keys = sorted({(r["rule"], r["method"]) for r in bench if r["mode"] == mode})
            w = 0.8 / max(len(keys), 1)
            for i, key in enumerate(keys):
                ms = [next((r["ms"] for r in bench if (r["B"], r["T"], r["rule"], r["method"], r["mode"])
                            == (B, T, key[0], key[1], mode)), np.nan) for (B, T) in shapes]
                ax.bar(np.arange(len(shapes)) + i * w, ms, w, label=f"{key[1]} {key[0]}")
            ax.set_xticks(np.arange(len(shapes)) + 0.4 - w / 2)
            ax.set_xticklabels([f"B={B}, T={T}" for B, T in shapes])
            ax.set_yscale("log")
            ax.set_ylabel("ms (median)")
            ax.set_title(f"bench {mode}, H={H}, D={D}, bf16")
            if keys:
                ax.legend(fontsize=6, ncol=2)
            else:
                ax.text(0.5, 0.5, f"no {mode} row timed", ha="center", va="center", transform=ax.transAxes)
        row = 1
    for name, _ in panels:
        ax = fig.add_subplot(grid[row, :])
        row += 1
        if name == "ab":
            labels = [f"({r['B']}, {r['T']}) {r['rule']} {r['mode']}" for r in ab]
            mid = [r["b_over_a"] for r in ab]
            err = [[m - r["b_over_a_range"][0] for m, r in zip(mid, ab)],
                   [r["b_over_a_range"][1] - m for m, r in zip(mid, ab)]]
            ax.barh(range(len(ab)), mid, xerr=err, color="C2")
            ax.axvline(1.0, color="k", lw=0.8)
            ax.set_xlabel("B / A time (median of the paired rounds; bars: their range); below 1: B is faster")
            ref = " (A: --ab_ref)" if results.get("ab_ref") else ""
            ax.set_title(f"ab: B = A with {results.get('ab_knobs')}{ref}")
        elif name == "profile":
            labels = list(prof)
            ax.barh(range(len(labels)), [prof[k]["busy_ms_per_call"] for k in labels],
                    color=["C1" if k.endswith(" fla") else "C0" for k in labels])
            ax.set_xlabel("GPU time per call, ms (sum of its kernels)")
            ax.set_title("profile: one whole call per (shape, rule, mode, method)")
        else:
            labels = list(stages)
            kernels = list(dict.fromkeys(k for r in stages.values() for k in r))
            w = 0.8 / len(kernels)
            for i, k in enumerate(kernels):
                ax.barh(np.arange(len(labels)) + i * w, [stages[s].get(k, np.nan) for s in labels], w, label=k)
            ax.set_xlabel("ms per call of each kernel, timed alone")
            ax.set_title("stages: the Pallas kernels one by one")
            ax.legend(fontsize=6, ncol=4)
            ax.set_yticks(np.arange(len(labels)) + 0.4 - w / 2, labels, fontsize=7)
            ax.invert_yaxis()
            continue
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
    fig.tight_layout()
    return fig


def parse_tuning(ap, flag, text) -> dict:
    """``knob=value,...`` of the Pallas launch knobs, validated (``ap.error`` naming ``flag``)."""
    from kernels.delta.api import (ANCHORED_BWD, ANCHORED_FWD, GRID_ORDERS, INTRAS, INVERSES, STATE_BWD,
                                   STATE_DOTS, TRANSPOSED_PASSES)
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        if not sep:
            ap.error(f"{flag}: expected knob=value items, got {item!r}")
        choices = {"anchored_bwd": ANCHORED_BWD, "anchored_fwd": ANCHORED_FWD, "state_bwd": STATE_BWD,
                   "inverse": ("auto",) + INVERSES,
                   "grid_order": GRID_ORDERS, "intra": INTRAS, "state_dot": STATE_DOTS}
        if key in choices:
            if val not in choices[key]:
                ap.error(f"{flag}: {key} must be one of {choices[key]}, got {val!r}")
            out[key] = val
        elif key == "transposed_state" and val not in ("0", "1"):  # passes, e.g. fwd+bwd (or "none")
            passes = () if val == "none" else tuple(val.split("+"))
            if not set(passes) <= set(TRANSPOSED_PASSES):
                ap.error(f"{flag}: transposed_state must be 0, 1, none or passes from {TRANSPOSED_PASSES} "
                         f"joined by '+', got {val!r}")
            out[key] = passes
        elif key in ("fuse_output", "qk_arrays", "state_pairs", "transposed_state"):
            if val not in ("0", "1"):
                ap.error(f"{flag}: {key} must be 0 or 1, got {val!r}")
            out[key] = val == "1"
        elif key in ("state_split", "chunks_per_program") and val == "auto":
            out[key] = val
        elif key in ("bv", "num_warps", "num_warps_state", "num_stages_state", "num_warps_scores", "num_warps_fwd",
                     "num_warps_solve", "state_split", "chunks_per_program", "chunk_size", "fixup_chunks"):
            try:
                out[key] = int(val)
            except ValueError:
                ap.error(f"{flag}: {key} must be an integer, got {val!r}")
        else:
            ap.error(f"{flag}: unknown knob {key!r}")
    return out


def parse_shapes(ap, flag, text) -> list:
    """``"B,T;B,T"`` -> ``[(B, T), ...]`` (positive integers; ``ap.error`` naming ``flag`` otherwise)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        parts = [p.strip() for p in item.split(",")]
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            ap.error(f"{flag}: {item!r} is not B,T (two positive integers joined by ','; shapes joined by ';')")
        out.append((int(parts[0]), int(parts[1])))
    if not out:
        ap.error(f"{flag}: no shape given")
    return out


def parse_names(ap, flag, text, valid) -> tuple:
    """Comma-separated names, each one of ``valid`` (``ap.error`` naming ``flag`` otherwise)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in valid:
            ap.error(f"{flag}: unknown {flag.strip('-').rstrip('s')} {n!r} (choose from {', '.join(valid)})")
    if not names:
        ap.error(f"{flag}: give at least one of {', '.join(valid)}")
    return names


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog=f"python -m experiments.{NAME}", description=__doc__.split("\n")[0])
    C.add_out(ap, NAME)
    ap.add_argument("--parts", default="roofline,bench",
                    help="comma-separated subset of " + ",".join(PARTS) + " (default: %(default)s)")
    ap.add_argument("--shapes", default=";".join(f"{b},{t}" for b, t in SHAPES), metavar="B,T[;B,T...]",
                    help="the (batch, tokens) shapes of bench, mosaic, profile and ab, ';'-separated; bench times "
                         "the first before the other parts (default: %(default)s)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated subset of " + ",".join(METHODS) + " (bench; profile reads pallas and fla) "
                         "(default: %(default)s)")
    ap.add_argument("--reps", type=C.positive_int, default=20,
                    help="calls per timing round (bench, mosaic, ab; the roofline runs 10) (default: %(default)s)")
    ap.add_argument("--budget_s", type=float, default=1e9, help="start no new part/shape after this many seconds")
    ap.add_argument("--fla_cache", default=None, metavar="DIR",
                    help="Triton cache directory for fla's kernels and its autotuning results (kept on disk): a "
                         "later call with the same DIR skips fla's autotuning (default: Triton's own cache, "
                         "autotuning results kept in memory only)")
    ap.add_argument("--rules", default=",".join(RULES), help="comma-separated subset of " + ",".join(RULES))
    ap.add_argument("--pallas_chunk", type=C.positive_int, default=None,
                    help="Pallas chunk size (default: the kernels' own)")
    ap.add_argument("--stages_shapes", default="2,8192", metavar="B,T[;B,T...]",
                    help="--parts stages: the (B,T) shapes, ';'-separated (default: %(default)s)")
    ap.add_argument("--ab", default="", metavar="KNOBS",
                    help="--parts ab: the launch knobs B changes against --pallas_tuning (A), e.g. fuse_output=0")
    ap.add_argument("--ab_ref", default=None, metavar="DIR",
                    help="--parts ab: A runs the kernel package in DIR (another checkout's kernels/delta, e.g. from "
                         "`git worktree add`), B this tree's; --ab may then be empty")
    ap.add_argument("--ab_modes", default=",".join(AB_MODES),
                    help="--parts ab: which of " + ",".join(AB_MODES) + " to time (comma-separated)")
    ap.add_argument("--ab_gate_scale", type=float, default=1.0,
                    help="--parts ab: multiply the log-decay gates by this (> 0; e.g. 400: no KDA tile anchorable)")
    ap.add_argument("--ab_dtype", default="bf16", choices=tuple(AB_DTYPES),
                    help="--parts ab: the dtype of q, k, v and beta (gates stay f32)")
    ap.add_argument("--profile_dtype", default="bf16", choices=tuple(AB_DTYPES),
                    help="--parts profile: the dtype of q, k, v and beta (gates stay f32)")
    ap.add_argument("--pallas_tuning", default="",
                    help="launch knobs of the Pallas kernels, e.g. bv=32,num_warps=8,num_warps_state=8,anchored_bwd=scores,"
                         "fuse_output=0,state_bwd=triton,inverse=loop,state_split=8 (or auto),grid_order=nbh")
    args = ap.parse_args(argv)
    # Every option is checked here, before anything is created or run.
    parts = parse_names(ap, "--parts", args.parts, PARTS)
    rules = parse_names(ap, "--rules", args.rules, RULES)
    methods = parse_names(ap, "--methods", args.methods, METHODS)
    shapes = parse_shapes(ap, "--shapes", args.shapes)
    stages_shapes = parse_shapes(ap, "--stages_shapes", args.stages_shapes)
    pc = args.pallas_chunk
    PALLAS_TUNING.update(parse_tuning(ap, "--pallas_tuning", args.pallas_tuning))
    knobs_b = parse_tuning(ap, "--ab", args.ab)
    ab_modes = tuple(filter(None, args.ab_modes.split(",")))
    for m in ab_modes:
        if m not in AB_MODES:
            ap.error(f"--ab_modes: unknown mode {m!r} (one of {', '.join(AB_MODES)})")
    if "ab" in parts and not ab_modes:
        ap.error(f"--ab_modes: no mode given (one or more of {', '.join(AB_MODES)})")
    if not (args.budget_s >= 0 and not math.isnan(args.budget_s)):
        ap.error(f"--budget_s must be a number of seconds >= 0, got {args.budget_s}")
    if "ab" in parts and not knobs_b and not args.ab_ref:
        ap.error("--parts ab needs --ab knob=value[,knob=value] (the B side's changed launch knobs) or --ab_ref DIR")
    if not (args.ab_gate_scale > 0 and math.isfinite(args.ab_gate_scale)):
        ap.error(f"--ab_gate_scale must be > 0 and finite, got {args.ab_gate_scale}")
    ref = None
    if args.ab_ref is not None:
        try:
            ref = load_kernels(args.ab_ref)
        except FileNotFoundError as ex:
            ap.error(str(ex))
    if args.fla_cache:
        use_fla_cache(args.fla_cache)
    t_start = time.time()
    results = dict(C.provenance(NAME, False), parts=parts, H=H, D=D, chunk=CHUNK, pallas_chunk=pc,
                   pallas_tuning=dict(PALLAS_TUNING), ab_knobs=knobs_b, ab_ref=args.ab_ref, rules=rules,
                   methods=methods, shapes=shapes, reps=args.reps, profile_dtype=args.profile_dtype)

    def save():
        C.save_partial(_plain(results), NAME, args.out)

    log("device", results["device"]["description"], "jax", jax.__version__)
    over = lambda: time.time() - t_start > args.budget_s  # noqa: E731
    ours = [m for m in methods if m != "fla"]
    reps = args.reps
    units = (("roofline" in parts) + ("check" in parts) + ("mosaic" in parts) + ("profile" in parts)
             + ("ab" in parts) + ("stages" in parts) * len(stages_shapes)
             + ("bench" in parts) * len(shapes) * (1 + ("fla" in methods)))
    with C.progress(total=units, desc=NAME, unit="part") as bar:
        def step(label):
            bar.set_postfix_str(label)

        def done(ran=True):
            if ran:
                bar.update(1)
            else:  # skipped (--budget_s): not counted as done
                bar.total -= 1
                bar.refresh()

        if "roofline" in parts:
            step("roofline")
            results["roofline"] = measure_roofline()
            log("roofline", results["roofline"])
            save()
            done()
        pallas_ok = True
        t0 = time.time()
        if "check" in parts:
            step("check")
            pallas_ok = part_check(results, rules, pc)
            log("check took", round(time.time() - t0, 1), "s")
            log("check passed:", pallas_ok)
            save()
            done()
        if "bench" in parts:
            step(f"bench {shapes[0]}")
            ran = not over()
            if ran:
                part_bench(results, shapes[:1], reps, ours, pallas_ok, over, rules, pc)
                save()
            done(ran)
        if "stages" in parts:
            for i, (b, t) in enumerate(stages_shapes):  # the first under "stages", then "stages_B_T"
                step(f"stages {(b, t)}")
                ran = not over()
                if ran:
                    part_stages(results, b, t, rules=rules, chunk_size=pc,
                                key="stages" if i == 0 else f"stages_{b}_{t}")
                    save()
                done(ran)
        if "mosaic" in parts:
            step("mosaic")
            ran = not over()
            if ran:
                part_mosaic(results, shapes, reps)
                save()
            done(ran)
        if "profile" in parts:
            step("profile")
            part_profile(results, shapes, rules, methods, pc, over, dtype=args.profile_dtype)
            save()
            done()
        if "ab" in parts:
            step("ab")
            part_ab(results, shapes, reps, knobs_b, rules, pc, over, ab_modes, ref=ref,
                    gate_scale=args.ab_gate_scale, dtype=args.ab_dtype)
            results["ab_table"] = ab_table(results)
            log(results["ab_table"])
            save()
            done()
        if "bench" in parts:
            for shape in shapes[1:]:
                step(f"bench {shape}")
                if over():
                    log("budget reached: skipping", shape)
                    done(False)
                    continue
                part_bench(results, [shape], reps, ours, pallas_ok, over, rules, pc)
                save()
                done()
            if "fla" in methods:  # last: its autotuning compiles many configs
                for shape in shapes:
                    step(f"bench fla {shape}")
                    if over():
                        log("budget reached: skipping fla", shape)
                        done(False)
                        continue
                    part_bench(results, [shape], reps, ["fla"], pallas_ok, over, rules)
                    save()
                    done()
            log(summarize(results))
    record = C.finish(_plain(results), NAME, args.out, plot(results))
    log(f"wrote {record['files']['json']} and {record['files']['png']}")
    return record


def _plain(results: dict) -> dict:
    """``results`` as plain JSON values (anything else as its ``str``)."""
    return json.loads(json.dumps(C.to_jsonable(results), default=str))


if __name__ == "__main__":
    main()
