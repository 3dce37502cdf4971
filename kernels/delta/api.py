"""Public API, layouts and the ``custom_vjp`` of the chunked delta-rule kernels.

GPU lowering: the Pallas **Triton** lowering runs the intra-chunk kernels and the forward state
pass; the backward state pass runs on **Mosaic GPU** (:mod:`kernels.delta.mosaic_gpu`) where that is
faster; both state passes exist on both lowerings, with the same arguments and results, and are
tested against each other.

The choice, and the evidence (one H200, bf16, H 16, D 128; docs/kernels.md, "Mosaic GPU state
passes" and the ``state_bwd`` knob). JAX 0.11 deprecates the Triton lowering in favour of Mosaic GPU
(wgmma, TMA, warp specialisation). The Triton lowering takes ordinary ``jnp``/``lax`` bodies
(``where``, ``exp``, reductions, small ``dot_general`` calls, ``fori_loop``): the tile math of
:mod:`kernels.delta.tiles`, shared verbatim with the TPU kernels and run with ``interpret=True`` on a
CPU. Mosaic GPU has no ``dot_general``: its kernels are written at the warpgroup level (SMEM tiles,
TMA copies, barriers, 64-row ``wgmma`` tiles) and cannot share a body with the TPU kernels. The state
passes, the latency-bound loops where wgmma and TMA should pay most, are therefore written for both.
Timed alone (ms, Mosaic GPU / Triton, the training forward's passes): forward 0.295 / 0.257 at
(2, 8192) and 0.175 / 0.308 at (8, 2048); backward 0.390 / 0.370 at (2, 8192). Paired in whole
fwd+bwd calls, Triton / Mosaic GPU backward pass: 0.96–0.99 at 128 programs ((4, 4096)), 0.98–1.01
at 256 ((8, 2048)), 1.06–1.09 at 512 ((16, 1024)); so on Hopper GPUs the backward pass runs on
Mosaic GPU from ``MOSAIC_BWD_PROGRAMS`` = 256 programs (``state_bwd="auto"``; ``"triton"`` /
``"mosaic"`` force one). The forward pass stays on Triton because it also takes the output
(``Spec.fuse_output``), which the Mosaic GPU pass does not. If the Triton lowering is removed, the
state passes keep running on Mosaic GPU; the intra-chunk kernels would need the same port.

GPU chunks are 32 tokens (two 16-row tiles), up to ``GPU_MAX_CHUNK`` = 64: at 64 the state passes
take about half their time, but the forward's intra-chunk kernel 2.8–6.7× its own (:func:`default_chunk`,
:func:`default_intra`; docs/kernels.md, "Why C = 32"). Speed against flash-linear-attention's Triton
kernels in the same process: docs/benchmarks.md.

TPU: Mosaic. Tensors go head-major ``[B, H, T, D]`` so every block's last two
dims are ``(C, 128·m)`` (chunk rows × lanes; K and V are padded to 128) or equal
the array's, per-token scalars ride as ``[.., T, 1]`` columns, and the sequential
passes put the chunk axis last in the grid (``"arbitrary"``) with the state in a
VMEM scratch buffer. No cumsum or triangular solve is lowered: prefix sums are
triangle matmuls and the solve is forward substitution on 16×16 tiles.

Gate kinds (:class:`~kernels.delta.tiles.Cfg` ``gate``): "none" (DeltaNet); "scalar" (Gated
DeltaNet: every score's decay is an ``exp`` of differences of the gate's chunk-local prefix sums,
which the 16-bit whole-chunk kernels read from XLA, :func:`_gate_in`; the gate's gradient is row sums
and ``Σ S ⊙ dS`` in the backward's scores kernel, then the in-chunk prefix sums in XLA,
:func:`_gate_grad`); "channel" (KDA: a diagonal tile, or with 16-bit inputs in the forward the whole
chunk, is one matmul anchored at its middle row when its gates' span allows it — always with
``gate_lower_bound``; with exact gates on GPUs the backward's kernels decide it per tile at run time
(``tiles.Chunk.anchor_safe``, a ``lax.cond``) and run an exact 16-step loop on the tiles whose gates
are steeper, and the forward runs the anchored kernel on every chunk, then the per-tile kernel on the
chunks it flags, ``ANCHORED_FWD``).

Entry points: :func:`chunk_delta_rule`, :func:`chunk_gated_delta_rule`,
:func:`chunk_kda` — ``[B, T, H, D]`` in, ``(o [B, T, H, V], S [B, H, K, V] f32)``
out, differentiable in ``q, k, v, g, beta, initial_state`` by Pallas kernels
(``jax.custom_vjp``; nothing is differentiated through ``pallas_call``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from . import kernels as kn
from .tiles import BF16X6, F32, INTRAS, INVERSES, STATE_DOTS, Cfg

try:  # both exist in jax 0.10 / 0.11
    from jax.experimental.pallas import triton as pltriton
except Exception:  # pragma: no cover
    pltriton = None
try:
    from jax.experimental.pallas import tpu as pltpu
except Exception:  # pragma: no cover
    pltpu = None

Array = jax.Array
TARGETS = ("gpu", "tpu")
# KDA backward: whether the intra-chunk backward's scores kernel (dq, dk, dg) anchors its diagonal tiles
# at the middle row (one matmul: always with bounded gates, where the tile's gates allow it with exact
# gates on GPUs) — "scores", the default — or runs the exact 16-step loop on every one ("none"). Same
# residuals, same gradients up to rounding. The back-solve (dv, dβ, the dKK hand-off) has no diagonal
# tiles to compute: it starts from the forward kernel's decayed scores KK (a residual).
ANCHORED_BWD = ("none", "scores")
# KDA forward with exact gates on GPUs: "fixup" (default) — the bounded-gate kernel (every tile
# anchored, none of the 16-step loop's code: ptxas, bf16, 4 warps, 224 B of spill stores per thread
# against the fused kernel's 380 B; ``triton_compile_check --gate kda``) runs on
# every chunk and flags the chunks holding a tile whose gates span too far to anchor
# (``tiles.Chunk.span_safe``), then the "fused" kernel runs on those chunks alone, writing over the
# first pass's outputs (``kernels.intra_fwd_fixup``; its other programs return at once) — or "fused":
# one intra-chunk kernel that decides per diagonal tile at run time between the anchored matmul and
# the exact loop (``tiles.Chunk.diag_tile``). Same outputs up to rounding. Paired on one H200 (bf16,
# gates in (−0.2, 0), no chunk flagged), fixup / fused: forward 0.80–0.83, fwd+bwd 0.90–0.92 at
# (2, 8192), (8, 2048), (1, 32768); with every chunk flagged the second pass reruns the whole forward
# (``kernel_bench --ab_gate_scale``; docs/kernels.md, "Launch knobs").
ANCHORED_FWD = ("fused", "fixup")
# GPU state passes: Triton software-pipelines the loads of the next chunks (W, U, k, the decay) under
# the current chunk's matmuls. On one H200 (bf16, (2, 8192), H 16, D 128, bv 32) state fwd + bwd
# 1.83 ms with 1 stage (no pipelining), 1.33 with 2, 1.07 with 3.
STATE_STAGES = 3
STATE_PROGRAMS = 128  # default_bv: fewest programs a state pass should launch before narrowing bv to 16
RESIDUALS = "delta_rule_residuals"  # checkpoint_name of the forward kernels' outputs kept for the backward
# GPU backward state pass: the Triton loop or the Mosaic GPU kernel (:mod:`kernels.delta.mosaic_gpu`: TMA
# ring, wgmma with dS as the accumulator, one warpgroup per 64 value columns). "auto": default_state_bwd,
# with the threshold below (the measurements behind it: this module's docstring).
STATE_BWD = ("auto", "triton", "mosaic")
# The parallel kernels' grid (batch, head, chunk) in launch order: on GPUs the first axis is the
# fastest-varying launch index (Triton's program id 0, CUDA's x), on TPUs the outermost loop. The
# kernels read their blocks through index maps, so any order gives the same results.
GRID_ORDERS = ("bhn", "bnh", "hbn", "hnb", "nbh", "nhb")
MOSAIC_BWD_PROGRAMS = 256
# GPU state passes that may carry the transposed state (``transposed_state``): the forward that stores no
# per-chunk state (an undifferentiated call's), the training forward (storing h and Ũ), the backward.
TRANSPOSED_PASSES = ("fwd", "train", "bwd")
# GPU state passes on few long sequences (default_state_split): where unsplit they would launch fewer
# than STATE_PROGRAMS programs of 32 value columns, split each sequence into segments until there are
# SPLIT_SEQUENCES segments × heads, keeping SPLIT_MIN_CHUNKS chunks a segment, and run them SPLIT_BV
# value columns wide (one program holds the whole 128 × 128 state, 8 warps: default_warps_state).
SPLIT_SEQUENCES = 128
SPLIT_MIN_CHUNKS = 32
SPLIT_BV = 128
# GPU backward intra-chunk kernels (chunks_per_program="auto": default_chunks_per_program): each program
# loops over PROGRAM_CHUNKS chunks, its loads pipelined in PROGRAM_STAGES stages.
PROGRAM_CHUNKS = 2
PROGRAM_STAGES = 2
GPU_MAX_CHUNK = 64  # the largest chunk_size of the GPU kernels (their [C, C] blocks live in registers)
MIN_GATE_BOUND = -8.0  # bounded-gate KDA: factors e^{±8·8} = e^{±64} leave ~1e-10 of float32 range for the
                       # values they scale before products go subnormal (flushed on tensor cores)
# f32 inputs: log-decay gates below GATE_FLOOR are raised to it before the kernels. The kernels form a decay
# e^{Σ g} as a difference of prefix sums over a 16-row tile (or a chunk), so a gate G there costs about
# |G|·6e-8 of relative precision in every decay after it (the f32 spacing at |G|): 2e-5 – 1e-3 of the outputs
# at G = −1e3 … −1e4, against 1e-7 for the XLA chunked form. Any decay through a gate at or below −110 is 0 in
# f32 either way (e^{−110} ≈ 1.7e-48 rounds to 0), so the floor changes no result beyond rounding; a decay
# after such gates loses ~7e-6 per gate in the tile. Its gradient there is 0, as e^{g}·(…) rounds to.
# 16-bit inputs (bf16 rounding, 4e-3) keep their gates.
GATE_FLOOR = -110.0


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything static about one call (hashable: a ``custom_vjp`` nondiff arg)."""

    cfg: Cfg
    target: str          # "gpu" (Triton flavour) or "tpu" (Mosaic flavour)
    interpret: bool
    B: int
    H: int
    N: int               # chunks
    K: int               # padded key dim
    V: int               # padded value dim
    bv: int              # value block of the sequential passes
    store_dtype: Any     # dtype of stored per-token intermediates (W, U, M, Ũ, ...)
    state_dtype: Any     # dtype of stored per-chunk states (h, dh)
    num_warps: int
    num_warps_state: int
    num_stages_state: int = STATE_STAGES  # GPU: Triton software-pipelining stages of the state passes' loop
    num_warps_scores: int = 4  # GPU: warps of the backward's scores kernel (``default_warps_scores``)
    num_warps_fwd: int = 4  # GPU: warps of the forward's intra-chunk kernel (``default_warps_fwd``)
    num_warps_solve: int = 4  # GPU: warps of the backward's solve kernel (``default_warps_solve``)
    anchored_bwd: str = "scores"  # per-channel gates: whether the backward's scores kernel anchors (ANCHORED_BWD)
    anchored_fwd: str = "fixup"  # exact per-channel gates, GPU: two intra-chunk forward passes or one (ANCHORED_FWD)
    fuse_output: bool = True  # the forward state pass takes the output (no output kernel; see _state_fwd)
    state_bwd: str = "triton"  # GPU: lowering of the backward state pass, "triton" or "mosaic" (STATE_BWD)
    state_split: int = 1  # segments the state passes split each sequence into (_state_forward); B, N, bv
                          # and state_bwd above describe the whole sequence, the passes run on B·P, N / P
    grid_order: str = "bhn"  # launch order of the intra-chunk and output kernels' grid (GRID_ORDERS)
    chunks_per_program: int = 1  # GPU: chunks each program of the backward's scores kernel loops over (_grouped)
    solve_chunks: int = 1  # GPU: the same for the backward's solve kernel (default_chunks_per_program)
    state_pairs: bool = False  # GPU: the forward state pass takes two chunks a step (kernels._pair_step)
    transposed_state: tuple = ()  # GPU: the state passes that carry Sᵀ (TRANSPOSED_PASSES; default_transposed_state)
    train_qk_arrays: bool = False  # cfg.qk_arrays of a differentiated call (_train_spec; cfg: undifferentiated)
    fixup_chunks: int = 1  # GPU, anchored_fwd="fixup": chunks each program of the second forward pass checks


# ---------------------------------------------------------------------------
# Layouts: token arrays are [B, T, H, D] (gpu) or [B, H, T, D] (tpu); chunk
# arrays [B, N, H, R, D] / [B, H, N, R, D]; states [B, H, K, V] always.
# ---------------------------------------------------------------------------
def _tok_shape(s: Spec, D, H=None):
    H = s.H if H is None else H
    T = s.N * s.cfg.chunk
    return (s.B, T, H, D) if s.target == "gpu" else (s.B, H, T, D)


def _chk_shape(s: Spec, R, D):
    return (s.B, s.N, s.H, R, D) if s.target == "gpu" else (s.B, s.H, s.N, R, D)


def _tok_spec(s: Spec, rows, cols, f):
    """Block of ``rows`` tokens × ``cols``; ``f(*grid) -> (b, t_block, h, d_block)``."""
    if s.target == "gpu":
        return pl.BlockSpec((None, rows, None, cols), lambda *i: _perm_gpu(f(*i)))
    return pl.BlockSpec((None, None, rows, cols), lambda *i: _perm_tpu(f(*i)))


def _perm_gpu(t):
    b, tb, h, db = t
    return (b, tb, h, db)


def _perm_tpu(t):
    b, tb, h, db = t
    return (b, h, tb, db)


def _chk_spec(s: Spec, nrows, R, cols, f):
    """Chunk-array block (``nrows`` None: one chunk, squeezed); ``f -> (b, n_block, h, d_block)``."""
    if s.target == "gpu":
        return pl.BlockSpec((None, nrows, None, R, cols), lambda *i: (lambda b, n, h, d: (b, n, h, 0, d))(*f(*i)))
    return pl.BlockSpec((None, None, nrows, R, cols), lambda *i: (lambda b, n, h, d: (b, h, n, 0, d))(*f(*i)))


def _state_spec(s: Spec, cols, f):
    return pl.BlockSpec((None, None, s.K, cols), lambda *i: (lambda b, h, d: (b, h, 0, d))(*f(*i)))


def _pass_specs(s: Spec, N: int, C: int, K: int, bv: int):
    """The GPU state passes' whole-sequence blocks over their ``(b, h, value block j)`` grid: ``[T, K]``,
    ``[T, C]`` and ``[T, bv]`` token arrays, the ``[N, K, 1]`` chunk decays, the ``[K, bv]`` state and the
    ``[N, K, bv]`` per-chunk states."""
    T = N * C
    return (_tok_spec(s, T, K, lambda b, h, j: (b, 0, h, 0)), _tok_spec(s, T, C, lambda b, h, j: (b, 0, h, 0)),
            _tok_spec(s, T, bv, lambda b, h, j: (b, 0, h, j)), _chk_spec(s, N, K, 1, lambda b, h, j: (b, 0, h, 0)),
            _state_spec(s, bv, lambda b, h, j: (b, h, j)), _chk_spec(s, N, K, bv, lambda b, h, j: (b, 0, h, j)))


def _params(s: Spec, semantics, state=False, warps=None, stages=None):
    if s.target == "gpu":
        if pltriton is None:
            return None
        if state:
            return pltriton.CompilerParams(num_warps=s.num_warps_state, num_stages=s.num_stages_state)
        return pltriton.CompilerParams(num_warps=s.num_warps if warps is None else warps, num_stages=stages or 1)
    if pltpu is None:
        return None
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _reorder(s: Spec, grid, in_specs, out_specs):
    """A ``(b, h, n)`` grid and its block specs launched in ``s.grid_order`` (:data:`GRID_ORDERS`)."""
    perm = tuple("bhn".index(a) for a in s.grid_order)   # launch axis j runs (b, h, n)[perm[j]]
    pos = tuple(s.grid_order.index(a) for a in "bhn")    # (b, h, n)[i] is launch axis pos[i]

    def spec(bs):
        f = bs.index_map
        return pl.BlockSpec(bs.block_shape, lambda *ids: f(*(ids[pos[i]] for i in range(3))))

    outs = [spec(b) for b in out_specs] if isinstance(out_specs, (list, tuple)) else spec(out_specs)
    return tuple(grid[p] for p in perm), [spec(b) for b in in_specs], outs


def _grouped(s: Spec, G: int, body, grid, in_specs, out_specs):
    """The ``(b, h, n)`` parallel grid of an intra-chunk kernel with G chunks per program (the backward's:
    ``s.solve_chunks``, ``s.chunks_per_program``; exact KDA's second forward pass: ``s.fixup_chunks``):
    blocks of G chunks, the body run on each in a loop (``kernels.ChunkView``), so that Triton's pipeliner
    loads a chunk's inputs while the previous one computes (and fewer programs start where most chunks have
    nothing to do)."""
    C = s.cfg.chunk

    def spec(bs):
        shape = list(bs.block_shape)
        if len(shape) == 4:    # token block (None, C, None, cols)
            shape[1] = G * C
        else:                  # chunk block (None, None, None, R, cols)
            shape[1] = G
        return pl.BlockSpec(tuple(shape), bs.index_map)

    specs_in = [spec(b) for b in in_specs]
    specs_out = [spec(b) for b in out_specs] if isinstance(out_specs, (list, tuple)) else spec(out_specs)
    rows = [C if len(b.block_shape) == 4 else None for b in list(in_specs) + list(
        out_specs if isinstance(out_specs, (list, tuple)) else [out_specs])]

    def grouped(*refs):
        def one(g, carry):
            body(*(kn.ChunkView(r, g, n) for r, n in zip(refs, rows)))
            return carry
        lax.fori_loop(0, G, one, 0)

    # the kernel's name (profiles, triton_compile_check): the body's, marked as looped
    grouped.__name__ = f"{getattr(body, 'func', body).__name__}_grouped"
    return grouped, (grid[0], grid[1], grid[2] // G), specs_in, specs_out


def _call(s: Spec, body, *, grid, in_specs, out_specs, out_shape, semantics, state=False, scratch=(), warps=None,
          group=1, aliases=None):
    """``group``: chunks each program of an intra-chunk kernel loops over (:func:`_grouped`; 1: one a
    program); ``aliases``: ``{input index: output index}`` (the output starts as that input's buffer)."""
    kw = {}
    if scratch:
        kw["scratch_shapes"] = list(scratch)
    if aliases:
        kw["input_output_aliases"] = dict(aliases)
    stages = None
    if semantics == ("parallel",) * 3 and not state:  # the (b, h, n) parallel grids
        if group > 1:
            body, grid, in_specs, out_specs = _grouped(s, group, body, grid, in_specs, out_specs)
            stages = PROGRAM_STAGES
        if s.grid_order != "bhn":
            grid, in_specs, out_specs = _reorder(s, grid, in_specs, out_specs)
    return pl.pallas_call(
        body, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params(s, semantics, state, warps, stages), interpret=s.interpret, **kw)


# ---------------------------------------------------------------------------
# The five pallas_calls.
# ---------------------------------------------------------------------------
def _gate_in(s: Spec, g):
    """The gate as the intra-chunk kernels read it: ``g``, or (:func:`kernels.delta.kernels.gate_prefix`)
    its chunk-local inclusive prefix sums in f32 (one XLA scan)."""
    if g is None or not kn.gate_prefix(s.cfg):
        return g
    ax = 1 if s.target == "gpu" else 2  # the token axis of the laid-out arrays
    C = s.cfg.chunk
    x = g.astype(F32)
    x = x.reshape(x.shape[:ax] + (x.shape[ax] // C, C) + x.shape[ax + 1:])
    return lax.cumsum(x, axis=ax + 1).reshape(g.shape)


def _chunk_inputs(s: Spec, q, k, v, g, beta, doc):
    C, K, V = s.cfg.chunk, s.K, s.V
    g = _gate_in(s, g)
    tk = _tok_spec(s, C, K, lambda b, h, n: (b, n, h, 0))
    tv = _tok_spec(s, C, V, lambda b, h, n: (b, n, h, 0))
    t1 = _tok_spec(s, C, 1, lambda b, h, n: (b, n, h, 0))
    td = _tok_spec(s, C, 1, lambda b, h, n: (b, n, 0, 0))
    args, specs = [q, k, v], [tk, tk, tv]
    if g is not None:
        args.append(g)
        specs.append(tk if s.cfg.channel else t1)
    args.append(beta)
    specs.append(t1)
    if doc is not None:
        args.append(doc)
        specs.append(td)
    return args, specs


# The forward launches run inside a ``jit`` each: JAX never dead-code-eliminates a bare
# ``pallas_call`` (a kernel may have effects it cannot see), but it drops a ``jit`` none of whose
# outputs is used. Under a remat policy that saves the named residuals, the backward pass stages a
# recomputation of every forward kernel whose raw outputs were not saved and then uses none of it:
# bare, those launches ran anyway (twice the forward kernels per training step on an H200 profile).
_dce_able = functools.partial(jax.jit, static_argnums=(0,))


@functools.partial(_dce_able, static_argnames=("residuals",))
def _intra_fwd(s: Spec, q, k, v, g, beta, doc, *, residuals=True):
    """``(W, U, M, q_in, k_out, d_end, KK)`` — without per-channel gates ``q_in`` and ``k_out`` are their
    ``[T, 1]`` row factors ``ein``, ``eout``, or None (:func:`kernels.delta.kernels.row_factors`,
    :class:`_QK`); ``residuals=False`` (an undifferentiated call): ``KK`` None.
    In a ``jit`` of its own (``_dce_able``, above)."""
    C, K, V = s.cfg.chunk, s.K, s.V
    args, specs = _chunk_inputs(s, q, k, v, g, beta, doc)
    tk = _tok_spec(s, C, K, lambda b, h, n: (b, n, h, 0))
    tv = _tok_spec(s, C, V, lambda b, h, n: (b, n, h, 0))
    tc = _tok_spec(s, C, C, lambda b, h, n: (b, n, h, 0))
    cd = _chk_spec(s, None, K, 1, lambda b, h, n: (b, n, h, 0))
    sd = s.store_dtype
    rows = kn.row_factors(s.cfg)
    qk_shape = (jax.ShapeDtypeStruct(_tok_shape(s, K), sd) if rows == "arrays"
                else jax.ShapeDtypeStruct(_tok_shape(s, 1), F32))
    tqk = tk if rows == "arrays" else _tok_spec(s, C, 1, lambda b, h, n: (b, n, h, 0))
    out_shape = [jax.ShapeDtypeStruct(_tok_shape(s, K), sd),   # W
                 jax.ShapeDtypeStruct(_tok_shape(s, V), sd),   # U
                 jax.ShapeDtypeStruct(_tok_shape(s, C), sd),   # M
                 qk_shape,                                     # q_in (per-channel gates) or its row factors ein
                 qk_shape,                                     # k_out, or eout
                 jax.ShapeDtypeStruct(_chk_shape(s, K, 1), F32),  # d_end
                 jax.ShapeDtypeStruct(_tok_shape(s, C), F32)]     # KK (decayed, strictly lower), for the backward
    out_specs = [tk, tv, tc, tqk, tqk, cd, tc]
    keep = [True, True, True, rows != "scale", rows != "scale", True, residuals]
    out_shape = [x for x, k_ in zip(out_shape, keep) if k_]
    out_specs = [x for x, k_ in zip(out_specs, keep) if k_]
    par = ("parallel", "parallel", "parallel")
    if _fixup_fwd(s):
        # first pass: the bounded-gate kernel on every chunk, and a [C, 1] column per chunk that is 1 where
        # a diagonal tile's gates span too far to anchor; second pass: the exact kernel on those chunks
        cfg_a = dataclasses.replace(s.cfg, gate_bound=MIN_GATE_BOUND, anchor_when_safe=False)
        first_body = kn.intra_fwd_whole if s.cfg.intra == "whole" else kn.intra_fwd
        t1 = _tok_spec(s, C, 1, lambda b, h, n: (b, n, h, 0))
        *first, unsafe = _call(s, functools.partial(first_body, cfg_a, residuals=residuals, flag=True),
                               grid=(s.B, s.H, s.N), in_specs=specs, out_specs=out_specs + [t1],
                               out_shape=out_shape + [jax.ShapeDtypeStruct(_tok_shape(s, 1), F32)],
                               semantics=par, warps=s.num_warps_fwd)(*args)
        n_in = len(args) + 1
        outs = _call(s, functools.partial(kn.intra_fwd_fixup, s.cfg, n_in, residuals=residuals),
                     grid=(s.B, s.H, s.N), in_specs=specs + [t1] + out_specs, out_specs=out_specs,
                     out_shape=out_shape, semantics=par, warps=s.num_warps_fwd, group=s.fixup_chunks,
                     aliases={n_in + i: i for i in range(len(out_shape))})(*args, unsafe, *first)
    else:
        body = {"whole": kn.intra_fwd_whole, "halves": kn.intra_fwd_halves}.get(s.cfg.intra, kn.intra_fwd)
        outs = _call(s, functools.partial(body, s.cfg, residuals=residuals), grid=(s.B, s.H, s.N),
                     in_specs=specs, out_specs=out_specs, out_shape=out_shape, semantics=par,
                     warps=s.num_warps_fwd)(*args)
    res = iter(outs)
    return tuple(next(res) if k_ else None for k_ in keep)


def _fixup_fwd(s: Spec) -> bool:
    """Whether the forward's intra-chunk kernel runs as two passes (``anchored_fwd="fixup"``: exact
    per-channel gates on GPUs, ``ANCHORED_FWD``)."""
    return s.anchored_fwd == "fixup" and s.cfg.channel and s.cfg.anchor_when_safe and s.cfg.gate_bound is None


class _QK(NamedTuple):
    """What the state passes read as ``q_in = q ⊙ E_in`` and ``k_out = k ⊙ E_out``
    (:func:`kernels.delta.kernels.row_factors`): the arrays themselves (per-channel gates), or ``q``
    and ``k`` with the ``[T, 1]`` row factors ``ein`` (``scale`` folded in) and ``eout`` (scalar
    gates, documents), or ``q`` and ``k`` alone (DeltaNet: ``E_in = scale``, ``E_out = 1``)."""

    qin: Any
    kout: Any
    ein: Any = None
    eout: Any = None

    def arrays(self, s: "Spec", dtype):
        """``(q_in, k_out)`` as arrays in ``dtype`` (for the kernels that take them whole)."""
        rows = kn.row_factors(s.cfg)
        if rows == "arrays":
            return self.qin, self.kout
        if rows == "scale":
            return (self.qin.astype(F32) * s.cfg.scale).astype(dtype), self.kout
        return ((self.qin.astype(F32) * self.ein).astype(dtype), (self.kout.astype(F32) * self.eout).astype(dtype))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("out_dtype", "store_h", "final_only"))
def _state_fwd(s: Spec, W, U, qk: _QK, dend, h0, M=None, *, out_dtype=None, store_h=True, final_only=False):
    """The forward state pass: ``(h, Ũ, final state)``; with ``M`` it also takes the output (the
    output kernel's work, fused: ``(h, Ũ, final state, o)`` in ``out_dtype``), and then
    ``store_h=False`` drops ``h`` and ``Ũ`` (``None`` in their places: a forward no backward reads);
    ``final_only`` (no ``M``) stores the final state alone: ``(None, None, final state)``.
    Runs on the whole sequence as ``s`` lays it out (:func:`_state_forward` splits it).
    In a ``jit`` of its own, as the forward kernels are (``_dce_able``)."""
    C, K, V, N, bv = s.cfg.chunk, s.K, s.V, s.N, s.bv
    nv = V // bv
    out = kn.StateOut(h=store_h and not final_only, o=M is not None,
                      ut=(store_h or M is None) and not final_only)
    cols = kn.row_factors(s.cfg) == "columns"
    kout, qin = qk.kout, qk.qin
    out_shape = [jax.ShapeDtypeStruct(_chk_shape(s, K, V), s.state_dtype),  # h
                 jax.ShapeDtypeStruct(_tok_shape(s, V), s.store_dtype),     # Ũ
                 jax.ShapeDtypeStruct((s.B, s.H, K, V), F32),               # final state
                 jax.ShapeDtypeStruct(_tok_shape(s, V), out_dtype or s.store_dtype)]  # o
    args = [W, U, kout, dend, h0] + ([qin, M] if out.o else [])
    if s.target == "gpu":
        T = N * C
        fk, fc, fv, fd, st, fh = _pass_specs(s, N, C, K, bv)
        in_specs, out_specs = [fk, fv, fk, fd, st, fk, fc], [fh, fv, st, fv]
        f1 = _tok_spec(s, T, 1, lambda b, h, j: (b, 0, h, 0))
        body = functools.partial(kn.state_fwd_loop, s.cfg, N, out, pairs=s.state_pairs,
                                 transposed=_transposed(s, out))
        grid, semantics, scratch = (s.B, s.H, nv), None, ()
    else:
        ck = _tok_spec(s, C, K, lambda b, h, j, n: (b, n, h, 0))
        cc = _tok_spec(s, C, C, lambda b, h, j, n: (b, n, h, 0))
        cv = _tok_spec(s, C, bv, lambda b, h, j, n: (b, n, h, j))
        cd = _chk_spec(s, None, K, 1, lambda b, h, j, n: (b, n, h, 0))
        st = _state_spec(s, bv, lambda b, h, j, n: (b, h, j))
        ch = _chk_spec(s, None, K, bv, lambda b, h, j, n: (b, n, h, j))
        in_specs, out_specs = [ck, cv, ck, cd, st, ck, cc], [ch, cv, st, cv]
        f1 = _tok_spec(s, C, 1, lambda b, h, j, n: (b, n, h, 0))
        body, grid = functools.partial(kn.state_fwd_grid, s.cfg, out), (s.B, s.H, nv, N)
        semantics, scratch = ("parallel", "parallel", "parallel", "arbitrary"), [pltpu.VMEM((K, bv), F32)]
    keep_in = [True] * 5 + [out.o] * 2
    if cols:  # the row factors ein (for the output) and eout
        eout, f_eout = qk.eout, f1
        if s.target == "gpu" and _transposed(s, out):
            eout, f_eout = _eout_rows(s, eout)
        args = args + ([qk.ein] if out.o else []) + [eout]
        in_specs, keep_in = in_specs + [f1, f_eout], keep_in + [out.o, True]
    keep_out = [out.h, out.ut, True, out.o]
    res = _call(s, body, grid=grid, in_specs=[x for x, k_ in zip(in_specs, keep_in) if k_],
                out_specs=[x for x, k_ in zip(out_specs, keep_out) if k_],
                out_shape=[x for x, k_ in zip(out_shape, keep_out) if k_],
                semantics=semantics, state=True, scratch=scratch)(*args)
    it = iter(res)
    full = [next(it) if k_ else None for k_ in keep_out]
    return tuple(full) if out.o else tuple(full[:3])


def _transposed(s: Spec, out=None) -> bool:
    """Whether a GPU state pass carries the transposed state (``Spec.transposed_state``): the forward pass
    with outputs ``out`` (:class:`kernels.delta.kernels.StateOut`; "fwd" where it stores neither ``h`` nor
    ``Ũ``, else "train"; not with ``state_pairs``), or the backward pass (``out=None``: "bwd"). Row-factor
    columns then reach the loop with ``eout`` as rows (:func:`_eout_rows`). A pass over one chunk stays
    untransposed: interpreted on a CPU, XLA drops the one-step loop and folds its transposes into bf16
    dots that its CPU runtime does not run (jax 0.10.2)."""
    if s.N == 1:
        return False
    if out is None:
        return "bwd" in s.transposed_state
    return ("train" if out.h or out.ut else "fwd") in s.transposed_state and not s.state_pairs


def _eout_rows(s: Spec, eout):
    """``eout [B, T, H, 1]`` laid out as a ``[1, C]`` row per chunk (one XLA transpose) and its GPU block
    spec: a transposed state pass scales the columns of ``Ũᵀ`` / ``dŨᵀ`` with it."""
    N, C = s.N, s.cfg.chunk
    rows = jnp.transpose(eout.reshape(s.B, N, C, s.H), (0, 1, 3, 2)).reshape(_chk_shape(s, 1, C))
    return rows, _chk_spec(s, N, 1, C, lambda b, h, j: (b, 0, h, 0))


@functools.partial(jax.jit, static_argnums=(0, 5))
def _output(s: Spec, qin, h, M, ut, out_dtype):
    C, K, V = s.cfg.chunk, s.K, s.V
    tk = _tok_spec(s, C, K, lambda b, h_, n: (b, n, h_, 0))
    tv = _tok_spec(s, C, V, lambda b, h_, n: (b, n, h_, 0))
    tc = _tok_spec(s, C, C, lambda b, h_, n: (b, n, h_, 0))
    chv = _chk_spec(s, None, K, V, lambda b, h_, n: (b, n, h_, 0))
    return _call(s, functools.partial(kn.output, s.cfg), grid=(s.B, s.H, s.N), in_specs=[tk, chv, tc, tv],
                 out_specs=tv, out_shape=jax.ShapeDtypeStruct(_tok_shape(s, V), out_dtype),
                 semantics=("parallel", "parallel", "parallel"))(qin, h, M, ut)


def _state_bwd(s: Spec, M, do, qk: _QK, W, dend, dsT, *, stores=True):
    """The backward state pass over the whole sequence as ``s`` lays it out: ``(dh, dŨ, dh0)``;
    ``stores=False``: ``dh0`` alone (Triton or Mosaic TPU; :func:`_state_backward` splits it)."""
    C, K, V, N, bv = s.cfg.chunk, s.K, s.V, s.N, s.bv
    if s.state_bwd == "mosaic" and stores:
        from . import mosaic_gpu
        qin, kout = qk.arrays(s, s.store_dtype)
        return mosaic_gpu.state_bwd(M, do, kout, qin, W, dend, dsT, chunk=C, state_dtype=s.state_dtype,
                                    interpret=s.interpret, block_v=64)
    cols = kn.row_factors(s.cfg) == "columns"
    args = [M, do, qk.kout, qk.qin, W, dend, dsT] + ([qk.ein, qk.eout] if cols else [])
    nv = V // bv
    out_shape = [jax.ShapeDtypeStruct(_chk_shape(s, K, V), s.state_dtype),  # dh (grad of state after chunk n)
                 jax.ShapeDtypeStruct(_tok_shape(s, V), s.store_dtype),     # dŨ
                 jax.ShapeDtypeStruct((s.B, s.H, K, V), F32)]               # dh0
    keep = slice(None) if stores else slice(2, 3)
    if s.target == "gpu":
        T = N * C
        fk, fc, fv, fd, st, fh = _pass_specs(s, N, C, K, bv)
        f1 = [_tok_spec(s, T, 1, lambda b, h, j: (b, 0, h, 0))] * (2 if cols else 0)
        if cols and _transposed(s):
            args[-1], f1[1] = _eout_rows(s, args[-1])
        res = _call(s, functools.partial(kn.state_bwd_loop, s.cfg, N, stores=stores, transposed=_transposed(s)),
                    grid=(s.B, s.H, nv),
                    in_specs=[fc, fv, fk, fk, fk, fd, st] + f1, out_specs=[fh, fv, st][keep],
                    out_shape=out_shape[keep], semantics=None, state=True)(*args)
        return tuple(res) if stores else (None, None, res[0])
    rev = lambda n: N - 1 - n  # noqa: E731
    ck = _tok_spec(s, C, K, lambda b, h, j, n: (b, rev(n), h, 0))
    cc = _tok_spec(s, C, C, lambda b, h, j, n: (b, rev(n), h, 0))
    cv = _tok_spec(s, C, bv, lambda b, h, j, n: (b, rev(n), h, j))
    cd = _chk_spec(s, None, K, 1, lambda b, h, j, n: (b, rev(n), h, 0))
    st = _state_spec(s, bv, lambda b, h, j, n: (b, h, j))
    ch = _chk_spec(s, None, K, bv, lambda b, h, j, n: (b, rev(n), h, j))
    c1 = [_tok_spec(s, C, 1, lambda b, h, j, n: (b, rev(n), h, 0))] * (2 if cols else 0)
    res = _call(s, functools.partial(kn.state_bwd_grid, s.cfg, stores=stores), grid=(s.B, s.H, nv, N),
                in_specs=[cc, cv, ck, ck, ck, cd, st] + c1, out_specs=[ch, cv, st][keep],
                out_shape=out_shape[keep], semantics=("parallel", "parallel", "parallel", "arbitrary"),
                scratch=[pltpu.VMEM((K, bv), F32)])(*args)
    return tuple(res) if stores else (None, None, res[0])


# ---------------------------------------------------------------------------
# Split sequences: the state passes on P segments of every sequence at once.
# ---------------------------------------------------------------------------
# A state pass carries one state per (batch, head, value block) through all N chunks in order, so a
# few long sequences leave most of the GPU idle while each program walks N dependent steps. The
# state's chunk update is affine in the state, S ↦ A S + B (A: K×K, acting on the key rows of every
# value column alike), so P segments can run at once: a first pass finds, from each segment's own
# inputs, the state it ends in from zero (S_loc) and the map A of its start — the same kernel run
# from the zero state beside the identity, with U beside zeros — then P small f32 products chain
# the segments' true starts, and the ordinary pass runs on B·P sequences of N / P chunks from
# them. The backward mirrors it with Aᵀ: each segment's gradient of its start from its own outputs,
# chained from the last segment back, then the ordinary backward pass from the true terminal
# gradients. The first passes store nothing but their final states; the forward's A is a residual.
def _seg_spec(s: Spec) -> Spec:
    """The spec the state passes run under: ``B·P`` sequences of ``N / P`` chunks."""
    P = s.state_split
    return dataclasses.replace(s, B=s.B * P, N=s.N // P, state_split=1)


def _segs(s: Spec, x):
    """A token (``[B, T, H, D]``) or chunk (``[B, N, H, R, D]``) array — head-major on TPUs — as
    ``P`` segments of its sequence: ``[B·P, T / P, …]`` (a free reshape in the GPU layout)."""
    P = s.state_split
    if x is None or P == 1:
        return x
    if s.target == "gpu":
        return x.reshape((x.shape[0] * P, x.shape[1] // P) + x.shape[2:])
    B, H, L = x.shape[:3]
    x = jnp.moveaxis(x.reshape((B, H, P, L // P) + x.shape[3:]), 2, 1)
    return x.reshape((B * P, H, L // P) + x.shape[4:])


def _unsegs(s: Spec, x):
    """The inverse of :func:`_segs`."""
    P = s.state_split
    if x is None or P == 1:
        return x
    if s.target == "gpu":
        return x.reshape((x.shape[0] // P, x.shape[1] * P) + x.shape[2:])
    BP, H, L = x.shape[:3]
    x = jnp.moveaxis(x.reshape((BP // P, P, H, L) + x.shape[3:]), 1, 2)
    return x.reshape((BP // P, H, P * L) + x.shape[4:])


def _seg_qk(s: Spec, qk: _QK) -> _QK:
    return _QK(*(_segs(s, a) for a in qk))


def _seg_maps(s: Spec, ss: Spec, W, U, qk: _QK, dend):
    """Per segment (inputs already split): ``A [B, P, H, K, K]`` and ``S_loc [B, P, H, K, V]`` with
    ``S_end = A S_start + S_loc`` — one final-state-only pass over ``V + K`` value columns: ``U``
    beside zeros, from the zero state beside the identity."""
    K, V, P = s.K, s.V, s.state_split
    U1 = jnp.concatenate([U, jnp.zeros(U.shape[:-1] + (K,), U.dtype)], axis=-1)
    h01 = jnp.concatenate([jnp.zeros((ss.B, s.H, K, V), F32),
                           jnp.broadcast_to(jnp.eye(K, dtype=F32), (ss.B, s.H, K, K))], axis=-1)
    s1 = dataclasses.replace(ss, V=V + K, bv=math.gcd(ss.bv, K))
    fin = _state_fwd(s1, W, U1, qk, dend, h01, final_only=True)[2].reshape(s.B, P, s.H, K, V + K)
    return fin[..., V:], fin[..., :V]


def _hmm(a, b, transpose_a=False):
    """``a b`` (``aᵀ b``) over ``[B, H, K, ·]`` blocks, float32 products."""
    return jnp.einsum("bhji,bhjv->bhiv" if transpose_a else "bhij,bhjv->bhiv", a, b,
                      precision=lax.Precision.HIGHEST)


def _state_forward(s: Spec, W, U, qk: _QK, dend, h0, M=None, *, out_dtype=None, store_h=True):
    """:func:`_state_fwd` on the whole sequences, split into ``Spec.state_split`` segments where that
    is more than one (above). Returns ``(_state_fwd's tuple, A)``, ``A`` the segments' maps (a
    residual of the backward) or None."""
    P = s.state_split
    if P == 1:
        return _state_fwd(s, W, U, qk, dend, h0, M, out_dtype=out_dtype, store_h=store_h), None
    ss = _seg_spec(s)
    W, U, M, dend = (_segs(s, a) for a in (W, U, M, dend))
    qk = _seg_qk(s, qk)
    A, S_loc = _seg_maps(s, ss, W, U, qk, dend)

    def chain(S, x):  # S_{p+1} = A_p S_p + S_loc_p; emits S_p
        a, sl = x
        return _hmm(a, S) + sl, S

    _, starts = lax.scan(chain, h0, (jnp.moveaxis(A, 1, 0), jnp.moveaxis(S_loc, 1, 0)))
    starts = jnp.moveaxis(starts, 0, 1).reshape(ss.B, s.H, s.K, s.V)
    res = _state_fwd(ss, W, U, qk, dend, starts, M, out_dtype=out_dtype, store_h=store_h)
    final = res[2].reshape(s.B, P, s.H, s.K, s.V)[:, -1]
    return (_unsegs(s, res[0]), _unsegs(s, res[1]), final) + tuple(_unsegs(s, o) for o in res[3:]), A


def _state_backward(s: Spec, A, M, do, qk: _QK, W, dend, dsT):
    """:func:`_state_bwd` on the whole sequences, split as the forward was (``A``: its maps)."""
    P = s.state_split
    if P == 1:
        return _state_bwd(s, M, do, qk, W, dend, dsT)
    ss = _seg_spec(s)
    M, do, W, dend = (_segs(s, a) for a in (M, do, W, dend))
    qk = _seg_qk(s, qk)
    zero = jnp.zeros((ss.B, s.H, s.K, s.V), F32)
    d_loc = _state_bwd(ss, M, do, qk, W, dend, zero, stores=False)[2].reshape(s.B, P, s.H, s.K, s.V)

    def chain(G, x):  # G: the gradient of segment p's end state; emits it, carries segment p-1's
        a, dl = x
        return dl + _hmm(a, G, transpose_a=True), G

    _, ends = lax.scan(chain, dsT, (jnp.moveaxis(A, 1, 0), jnp.moveaxis(d_loc, 1, 0)), reverse=True)
    ends = jnp.moveaxis(ends, 0, 1).reshape(ss.B, s.H, s.K, s.V)
    dh, dut, dh0 = _state_bwd(ss, M, do, qk, W, dend, ends)
    return _unsegs(s, dh), _unsegs(s, dut), dh0.reshape(s.B, P, s.H, s.K, s.V)[:, 0]


def _intra_bwd(s: Spec, q, k, v, g, beta, doc, KK, ut, dut, do, h, dh):
    """``dq, dk, dv, dβ[, dg]``. GPU: two pallas_calls, ``intra_bwd_solve_whole`` (``dv``, and a hand-off
    ``dKK [C, C]`` and partial ``dβ [C, 1]`` in f32 and ``dR_u [C, V]`` in the bulk matmuls' operand
    dtype — its one use, ``dR_w = −dR_u Sᵀ``, rounds it to that — so ``4·(C + 1) + 2·V`` bytes per
    token·head for 16-bit inputs, written, then read) and ``intra_bwd_scores`` (``dq, dk, dβ, dg``) — each holds about half the
    fused kernel's tiles, which spilled registers in every variant. TPU: the fused ``intra_bwd``.
    (Neither needs ``W`` or ``U``: see :func:`kernels.delta.kernels._bwd_solve`.)"""
    C, K, V = s.cfg.chunk, s.K, s.V
    args, specs = _chunk_inputs(s, q, k, v, g, beta, doc)
    tk = _tok_spec(s, C, K, lambda b, h_, n: (b, n, h_, 0))
    tv = _tok_spec(s, C, V, lambda b, h_, n: (b, n, h_, 0))
    tc = _tok_spec(s, C, C, lambda b, h_, n: (b, n, h_, 0))
    t1 = _tok_spec(s, C, 1, lambda b, h_, n: (b, n, h_, 0))
    chv = _chk_spec(s, None, K, V, lambda b, h_, n: (b, n, h_, 0))
    par = ("parallel", "parallel", "parallel")
    grid = (s.B, s.H, s.N)
    sh = lambda D, dt: jax.ShapeDtypeStruct(_tok_shape(s, D), dt)  # noqa: E731
    outs, out_specs = [sh(K, q.dtype), sh(K, k.dtype), sh(1, beta.dtype)], [tk, tk, t1]   # dq, dk, dβ[, dg]
    if g is not None:  # the gate's gradient, or (scalar gates) its two per-row parts (_gate_grad)
        outs += [sh(K, g.dtype)] if s.cfg.channel else [sh(1, F32), sh(1, F32)]
        out_specs += [tk] if s.cfg.channel else [t1, t1]
    cfg = s.cfg if s.anchored_bwd == "scores" else dataclasses.replace(s.cfg, gate_bound=None,
                                                                         anchor_when_safe=False)
    if s.target == "tpu":
        dq, dk, dv, dbeta, *dg = _call(
            s, functools.partial(kn.intra_bwd, cfg), grid=grid,
            in_specs=specs + [tc, tv, tv, tv, chv, chv], out_specs=out_specs[:2] + [tv] + out_specs[2:],
            out_shape=outs[:2] + [sh(V, v.dtype)] + outs[2:], semantics=par)(*args, KK, ut, dut, do, h, dh)
        return (dq, dk, dv, dbeta, *_gate_grad(s, dg, g))
    sargs, sspecs = [v, beta], [tv, t1]
    if doc is not None:
        sargs.append(doc)
        sspecs.append(_tok_spec(s, C, 1, lambda b, h_, n: (b, n, 0, 0)))
    whole = s.cfg.intra in ("whole", "halves") and not s.cfg.channel
    dv, dbp, dkk, dru = _call(
        s, functools.partial(kn.intra_bwd_solve_whole, s.cfg), grid=grid,
        in_specs=sspecs + [tc, tv, tv],
        out_specs=[tv, t1, tc, tv], out_shape=[sh(V, v.dtype), sh(1, F32), sh(C, F32), sh(V, s.cfg.mm_dtype)],
        semantics=par, group=s.solve_chunks, warps=s.num_warps_solve)(*sargs, KK, ut, dut)
    dq, dk, dbeta, *dg = _call(
        s, functools.partial(kn.intra_bwd_scores_whole if whole else kn.intra_bwd_scores, cfg), grid=grid,
        in_specs=specs + [tv, tv, chv, chv, tc, tv, t1], out_specs=out_specs, out_shape=outs, semantics=par,
        group=s.chunks_per_program, warps=s.num_warps_scores,
    )(*args, ut, do, h, dh, dkk, dru, dbp)
    return (dq, dk, dv, dbeta, *_gate_grad(s, dg, g))


def _gate_grad(s: Spec, parts, g):
    """``(dg,)`` from the scores kernel's gate outputs (``()`` ungated). Per-channel gates: the kernel's
    ``dg``. Scalar gates: the kernel stores the per-row parts ``dG`` (``dG_C`` in each chunk's last row)
    and ``dE`` (:func:`kernels.delta.kernels._store_dg`); here ``dg_s = Σ_{i >= s} dG_i + Σ_{i < s} dE_i``
    within each chunk, in f32."""
    if g is None or s.cfg.channel:
        return tuple(parts)
    dG, dE = parts
    ax = 1 if s.target == "gpu" else 2  # the token axis of the laid-out arrays
    C = s.cfg.chunk

    def chunked(x):
        return x.reshape(x.shape[:ax] + (x.shape[ax] // C, C) + x.shape[ax + 1:])

    shape = dG.shape
    dG, dE = chunked(dG), chunked(dE)
    rev = lax.cumsum(dG, axis=ax + 1, reverse=True)
    fwd = lax.cumsum(dE, axis=ax + 1)
    pad = [(0, 0)] * fwd.ndim
    pad[ax + 1] = (1, 0)
    excl = lax.slice_in_dim(jnp.pad(fwd, pad), 0, C, axis=ax + 1)
    return ((rev + excl).reshape(shape).astype(g.dtype),)


# ---------------------------------------------------------------------------
# custom_vjp over the laid-out, padded arrays.
# ---------------------------------------------------------------------------
def _qk(s: Spec, q, k, qin, kout) -> _QK:
    """The state passes' ``q_in``/``k_out`` from the intra-chunk kernel's outputs (:class:`_QK`)."""
    return _QK(qin, kout) if kn.row_factors(s.cfg) == "arrays" else _QK(q, k, qin, kout)


def _forward(s: Spec, q, k, v, g, beta, doc, h0):
    """The undifferentiated call: no residuals — no ``KK``, and the state pass stores neither ``h`` nor
    ``Ũ`` when it takes the output (``Spec.fuse_output``)."""
    W, U, M, qin, kout, dend, _ = _intra_fwd(s, q, k, v, g, beta, doc, residuals=False)
    qk = _qk(s, q, k, qin, kout)
    if s.fuse_output:
        (_, _, sT, o), _ = _state_forward(s, W, U, qk, dend, h0, M, out_dtype=q.dtype, store_h=False)
    else:
        (h, ut, sT), _ = _state_forward(s, W, U, qk, dend, h0)
        o = _output(s, qk.arrays(s, s.store_dtype)[0], h, M, ut, q.dtype)
    return o, sT


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(s: Spec, q, k, v, g, beta, doc, h0):
    return _forward(s, q, k, v, g, beta, doc, h0)


def _train_spec(s: Spec) -> Spec:
    """The spec of a differentiated call: ``cfg.qk_arrays`` as ``Spec.train_qk_arrays`` says
    (:func:`default_qk_arrays`); the forward and backward halves of the ``custom_vjp`` both take it."""
    if s.cfg.qk_arrays == s.train_qk_arrays:
        return s
    return dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, qk_arrays=s.train_qk_arrays))


def _chunked_fwd(s, q, k, v, g, beta, doc, h0):
    s = _train_spec(s)
    # The kernels' residuals carry a name, so a remat policy can keep them instead of running the
    # forward kernels again in the backward pass (``save_only_these_names``). The kernel that takes
    # the output (the state pass, or the output kernel) reads the *named* values, and ``o`` is named
    # too: a policy recomputes what it does not save, and ``o`` rebuilt from the unnamed values would
    # rerun the whole forward chain.
    W, U, M, qin, kout, dend, KK = _intra_fwd(s, q, k, v, g, beta, doc)
    W, M, qin, kout, dend, KK = (checkpoint_name(a, RESIDUALS) for a in (W, M, qin, kout, dend, KK))
    qk = _qk(s, q, k, qin, kout)
    if s.fuse_output:
        (h, ut, sT, o), A = _state_forward(s, W, U, qk, dend, h0, M, out_dtype=q.dtype)
        h, ut, o = (checkpoint_name(a, RESIDUALS) for a in (h, ut, o))
    else:
        (h, ut, sT), A = _state_forward(s, W, U, qk, dend, h0)
        h, ut = (checkpoint_name(a, RESIDUALS) for a in (h, ut))
        o = checkpoint_name(_output(s, qk.arrays(s, s.store_dtype)[0], h, M, ut, q.dtype), RESIDUALS)
    A = None if A is None else checkpoint_name(A, RESIDUALS)
    return (o, sT), (q, k, v, g, beta, doc, W, M, qin, kout, dend, KK, h, ut, A)  # U: not needed backward


def _chunked_bwd(s, res, cts):
    s = _train_spec(s)
    q, k, v, g, beta, doc, W, M, qin, kout, dend, KK, h, ut, A = res
    do, dsT = cts
    do = do.astype(q.dtype)
    dh, dut, dh0 = _state_backward(s, A, M, do, _qk(s, q, k, qin, kout), W, dend, dsT.astype(F32))
    grads = _intra_bwd(s, q, k, v, g, beta, doc, KK, ut, dut, do, h, dh)
    dq, dk, dv, dbeta = grads[:4]
    dg = grads[4] if g is not None else None
    ddoc = None if doc is None else jnp.zeros_like(doc)
    return dq, dk, dv, dg, dbeta, ddoc, dh0


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ---------------------------------------------------------------------------
# Public entry points.
# ---------------------------------------------------------------------------
def default_target() -> str:
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def _next_pow2(n):
    p = 1
    while p < n:
        p *= 2
    return p


def _pad_dim(n, target):
    if target == "tpu":
        return -(-n // 128) * 128
    return max(16, _next_pow2(n))


def default_chunk(target: str) -> int:
    """Tokens per chunk. GPU: 32 — two 16-row tiles keep the Triton kernels small (compile
    time grows steeply with the unrolled tile pairs: ~9 s at 32 vs ~45 s at 64 per config)
    and registers in range; forward calls at 64 took 2.3–3.4× with the tile kernels, 1.9–2.1× with the
    whole-chunk ones and, with the two-halves forward kernel (:func:`default_intra`), 0.945× for DeltaNet at
    (2, 8192) but 1.10–1.42× for GDN and at (8, 2048) and (1, 32768), on one H200 (docs/kernels.md);
    TPU: 64 (MXU-sized tiles, Mosaic compiles the unrolled code)."""
    return 64 if target == "tpu" else 32


def default_bv(BH: int, V: int) -> int:
    """GPU: width of the value blocks the sequential state passes split V into (one program each).
    The passes are latency-bound loops over chunks, so more programs help until the GPU is full:
    32-wide blocks, or 16-wide where that leaves fewer than ``STATE_PROGRAMS`` programs. Measured
    on one H200 (state fwd + bwd, bf16, H 16, D 128, 3 stages; docs/kernels.md): at (2, 8192)
    bv 32 1.07 ms against 1.31 (16) and 1.75 (64); at (1, 32768) bv 16 2.92 ms against 3.12 (32)."""
    bv = min(V, 32)
    while bv > 16 and BH * (V // bv) < STATE_PROGRAMS:
        bv //= 2
    return bv


def default_chunks_per_program(target: str, gate: str, N: int, C: int = 32, low: bool = True,
                               kernel: str = "scores") -> int:
    """Chunks per program of the backward's intra-chunk kernels (``chunks_per_program="auto"``; ``kernel``:
    "scores" or "solve"): on GPUs ``PROGRAM_CHUNKS`` where it divides the chunk count, except for the
    scores kernel of scalar gates (GDN), which took longer looping (paired, one H200: DeltaNet and KDA
    fwd+bwd 0.88–0.96×, GDN 1.05× with the tile kernels, 1.007–1.014× with the whole-chunk ones, 1.016–1.026×
    at commit 1233476; ``docs/kernels.md``). The solve kernel is the same gate-free kernel for every rule
    and loops for GDN too: its fwd+bwd took 0.990 at (2, 8192) and 0.986 at (8, 2048) (commit 2007b45
    against a copy looping it; ``knobs_h200.json``, ``paired.gdn_solve_chunks``). Except also
    where the looped scores kernels' pipelined loads do not fit a Hopper GPU's 227 KB of shared memory
    (Triton 3.6, K = V = 128): chunks above 32 tokens (bf16, C = 64: 408 KB for DeltaNet's whole-chunk
    kernel, 288 KB for KDA's) and f32 inputs (``low=False``; C = 32: 339 KB for DeltaNet's, 484 KB for
    KDA's — the launch failed on an H200); 1 on TPUs."""
    if kernel not in ("scores", "solve"):
        raise ValueError(f"`kernel` must be 'scores' or 'solve', got {kernel!r}")
    if target != "gpu" or (gate == "scalar" and kernel == "scores") or N % PROGRAM_CHUNKS or C > 32 or not low:
        return 1
    return PROGRAM_CHUNKS


def default_state_split(target: str, BH: int, N: int, V: int) -> int:
    """Segments the state passes split every sequence into (``state_split="auto"``; the mechanism:
    :func:`_state_forward`). GPU, where the unsplit passes would launch fewer than ``STATE_PROGRAMS``
    programs of 32 value columns (few long sequences): doubling until ``SPLIT_SEQUENCES`` segments ×
    heads, while every segment keeps ``SPLIT_MIN_CHUNKS`` chunks and P divides the chunk count; the
    split passes then run ``SPLIT_BV``-wide value blocks (:func:`_prepare`). Elsewhere, and on TPUs, 1.
    Paired on one H200 at (1, 32768), H 16 (bf16, fwd+bwd, split / unsplit): P = 8 with 128-wide
    blocks 0.92 (DeltaNet), 0.89 (GDN), 0.95 (KDA exact and bounded); P = 16 0.97, P = 4 1.00; P = 8
    with 32-wide blocks 1.00. Splitting (2, 8192) was slower (P = 4: 1.09–1.17)."""
    if target != "gpu" or BH * max(V // 32, 1) >= STATE_PROGRAMS:
        return 1
    P = 1
    while BH * P < SPLIT_SEQUENCES and N % (2 * P) == 0 and N // (2 * P) >= SPLIT_MIN_CHUNKS:
        P *= 2
    return P


def split_bv(C: int, low: bool = True) -> int:
    """GPU: the value blocks of split state passes (:func:`default_state_split`): ``SPLIT_BV``, or 64 for
    chunks above 32 tokens and for f32 inputs (``low=False``), whose pipelined loads at 128 columns do not
    fit a Hopper GPU's 227 KB of shared memory (Triton 3.6, K = 128: bf16 at C = 64 the forward pass 248 KB
    at 128 columns, 208 KB at 64; f32 at C = 32 233 KB at 128 columns, 169 KB at 64)."""
    return SPLIT_BV if C <= 32 and low else min(SPLIT_BV, 64)


def default_transposed_state(target: str, gate=None, programs=None, bv=None, low: bool = True) -> tuple:
    """``transposed_state="auto"``: the GPU state passes that carry the transposed state ``Sᵀ [bv, K]``
    (``TRANSPOSED_PASSES``; :func:`kernels.delta.kernels.state_fwd_loop`, ``state_bwd_loop``): the forward
    that stores no per-chunk state ("fwd": an undifferentiated call's) and the Triton backward ("bwd")
    always, the training forward ("train": ``h`` and ``Ũ`` stored transposed back) too unless the gate is
    scalar (GDN) — whose training forward is transposed only with 16-bit inputs where its pass launches
    at most ``STATE_PROGRAMS`` programs (``programs``) of at most 32 value columns (``bv``): one narrow
    program an SM, where the loop's latency shows. Every product of a step then has ``bv`` rows: Triton
    puts its warps over the columns (``mma.sync``, ``v2[1,4]``) where the untransposed step runs the
    update as a ``wgmma`` it waits on and its 32-row products with two warps on each row block (ptxas,
    bf16: 128 registers and 768 SASS instructions per thread for DeltaNet's undifferentiated loop,
    against 202 and 824). Paired on one H200
    (H 16, D 128, ``kernel_bench --parts ab``, ``docs/kernels.md``), transposed / untransposed forward:
    bf16 at (2, 8192) 0.80 (DeltaNet), 0.88 (KDA, exact and bounded), 0.89 (GDN, ``eout`` read as a
    ``[1, C]`` row per chunk); at (8, 2048) 0.89, 0.93, 0.97; at (1, 32768), split passes with 128-wide
    blocks, 0.93, 0.96, 0.92; f32 at (2, 8192) 0.66, 0.62, 0.66 and at (1, 32768) (64-wide split blocks)
    0.83, 0.81, 0.83. fwd+bwd, these defaults / "fwd" alone: bf16 at (2, 8192) 0.90 (DeltaNet), 0.97 (KDA
    bounded), 0.98 (GDN); at (1, 32768) 0.97, 1.01, 0.97; f32 at (2, 8192), every pass transposed, 0.79
    (DeltaNet) and 0.82 (KDA), GDN's two 0.95. In GPU time at (2, 8192) (bf16) the training forward's pass
    went from 0.359 to 0.309 ms (DeltaNet) and 0.357 to 0.317 (KDA bounded), the backward's from 0.367 to
    0.273, 0.357 to 0.317 and 0.356 to 0.321 (GDN). GDN's training forward transposed (on the ``q_in``,
    ``k_out`` arrays of ``qk_arrays``) took its fwd+bwd to 1.02×, and on the row-factor columns to
    1.04–1.06×; with the decay read as a pipelined ``[1, K]`` row (``kernels._lagged_decay``) 0.95× at
    (2, 8192) (128 programs of 32 columns), 1.01× at (8, 2048) (512 programs) and 1.04× at (1, 32768)
    (the split passes: 128 programs of 128 columns); paired, commit 2b5230a."""
    if target != "gpu":
        return ()
    if gate != "scalar":
        return ("fwd", "train", "bwd")
    few = low and programs is not None and programs <= STATE_PROGRAMS and bv is not None and bv <= 32
    return ("fwd", "train", "bwd") if few else ("fwd", "bwd")


def default_warps_state(bv: int, low: bool = True) -> int:
    """GPU: warps of the state passes: 8 for value blocks of 128 columns or more (a 128 × 128 float32
    state is 64 registers per thread at 8 warps; ptxas, bf16: 255 registers, no spills for DeltaNet and
    KDA, 20 / 40 B for GDN's forward / backward pass) and for f32 inputs (``low=False``: each product is
    six bf16 MMAs, ``tiles.BF16X6``, so a step is compute- rather than latency-bound; paired on one H200
    at (2, 8192), 32-wide blocks, 8 warps against 4: forward 0.91× (DeltaNet) and 0.95× (KDA), fwd+bwd
    0.99× and 0.96×, ``docs/kernels.md``), else 4 (bf16: 8 warps took the forward to 1.08–1.32×)."""
    return 8 if bv >= 128 or not low else 4


def _mosaic_fits(C, K, V) -> bool:
    """Whether :mod:`kernels.delta.mosaic_gpu`'s passes take these widths and chunk (64-wide value
    blocks): its own argument checks, asked without raising."""
    from . import mosaic_gpu
    try:
        mosaic_gpu._check_widths(K, V, "V", 64)
        mosaic_gpu._check_chunk(C, C)
    except ValueError:
        return False
    return True


def _on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x): what the Mosaic GPU
    passes' wgmma tiles and TMA copies need."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return False
    cc = str(getattr(dev, "compute_capability", "") or "")
    return dev.platform == "gpu" and cc.split(".")[0] == "9"


def default_state_bwd(BH: int, C: int, K: int, V: int, dtype, interpret: bool, hopper: bool = True) -> str:
    """GPU: the backward state pass's lowering (``STATE_BWD``): Mosaic GPU where it runs compiled on a
    Hopper GPU (``hopper``; wgmma and TMA are sm_90 features) on 16-bit inputs its tiles take and
    launches at least ``MOSAIC_BWD_PROGRAMS`` programs (one per batch·head and 64 value columns; with
    fewer, Triton's 16- or 32-column blocks launch more), else Triton. Paired on one H200 (bf16, H 16,
    D 128, fwd+bwd, ``kernel_bench --parts ab --ab state_bwd=triton``, commit 1233476; ``knobs_h200.json``,
    ``paired.state_bwd_programs``), Triton / Mosaic GPU: 0.958 (DeltaNet), 0.982 (KDA bounded), 0.987
    (GDN) at (4, 4096), 128 programs; 0.994, 0.975, 1.010 at (8, 2048), 256; 1.093, 1.061, 1.086 at
    (16, 1024), 512. Float32 stays on Triton: its
    f32 products are f32-accurate (``BF16X6``), Mosaic's are three bf16 products (≈ 2⁻¹⁶ relative)."""
    if interpret or not hopper or jnp.dtype(dtype) == jnp.float32 or not _mosaic_fits(C, K, V):
        return "triton"
    return "mosaic" if BH * (V // 64) >= MOSAIC_BWD_PROGRAMS else "triton"


def default_inverse(target: str, gate: str, low: bool) -> str:
    """How the UT solve inverts its 16×16 diagonal tiles (``inverse="auto"``): block merges (``"blocks"``:
    matmuls, three bf16 MMAs per product for 16-bit inputs) on GPUs for 16-bit DeltaNet and Gated
    DeltaNet, forward substitution (``"loop"``: 15 dependent masked row/column sums) otherwise. On one
    H200 (bf16, (2, 8192), H 16, D 128, paired rounds, blocks / loop) the forward took 0.86× (DeltaNet)
    and 0.95× (GDN, KDA exact), 1.10× with bounded KDA gates (ptxas spills grow from 152 to 276 B per
    thread there); fwd+bwd even within 3%. The whole-chunk kernels (``intra="whole"``) always merge blocks;
    this setting then reaches the tile kernels alone (16-bit KDA: the exact pass over flagged chunks)."""
    return "blocks" if (target == "gpu" and low and gate in ("none", "scalar")) else "loop"


def default_intra(target: str, gate: str, low: bool, C: int = 32, gate_bound=None,
                  anchored_fwd: str = "fixup") -> str:
    """The intra-chunk kernels' form (``intra="auto"``): ``"whole"`` (:func:`kernels.delta.kernels.intra_fwd_whole`
    and the backward's ``*_whole`` kernels: one ``[C, C]`` or ``[C, D]`` matmul per product) on GPUs for 16-bit
    inputs, ``"tiles"`` (16-row tile pairs) otherwise. Paired on one H200 (bf16, H 16, D 128, ``kernel_bench
    --parts ab --pallas_tuning intra=tiles --ab intra=whole``, commit 06f6769), whole / tiles: fwd+bwd
    0.922–0.943 (DeltaNet) and 0.901–0.904 (GDN) at (2, 8192), (8, 2048) and (1, 32768); forward 0.97–0.99.
    With f32 inputs the whole backward scores kernel does not fit (ptxas, sm_90a: 60 KB of spills per thread
    against the tiles' 3.7–6.0 KB). Per-channel gates (KDA) take the whole form in the forward only (the chunk
    anchored at its middle row, :func:`kernels.delta.kernels._whole_channel`; the backward's scores kernel
    keeps the tiles' anchored or looped diagonal tiles), for chunks of at most 32 tokens and gates whose bound
    ``gate_bound`` (None: exact gates, whose chunks that span too far are redone exactly — ``anchored_fwd``
    "fixup"; with "fused" exact gates take the tiles) keeps the anchor's span within ``WHOLE_SPAN``; paired
    (``--ab intra=whole --rules kdab,kda``, commit 006d14f), forward 0.75–0.83×, fwd+bwd 0.90–0.92× at the
    same shapes, exact and bounded gates. Chunks above 32 tokens take ``"halves"`` without per-channel gates
    (:func:`kernels.delta.kernels.intra_fwd_halves`: the forward solves two halves whole and merges them; the
    backward's kernels as "whole"): at C = 64, paired against "whole" (``kernel_bench --parts ab
    --pallas_chunk 64 --ab intra=halves``, commit fee572b), forward 0.67–0.73×, fwd+bwd 0.74–0.77× for
    DeltaNet and GDN at (2, 8192) and (8, 2048)."""
    if not (target == "gpu" and low):
        return "tiles"
    if gate == "channel":
        fits = (anchored_fwd == "fixup") if gate_bound is None else (C // 2) * -gate_bound <= kn.WHOLE_SPAN
        return "whole" if C <= 32 and fits else "tiles"
    return "whole" if C <= 32 else "halves"


def default_qk_arrays(target: str, gate: str, intra: str) -> bool:
    """``qk_arrays="auto"`` in a differentiated call: whether the training forward's intra-chunk kernel
    writes ``q ⊙ E_in`` and ``k ⊙ E_out`` as ``[T, K]`` arrays for the state passes (True) or two
    ``[T, 1]`` row-factor columns (:func:`kernels.delta.kernels.row_factors`); an undifferentiated call
    always takes the columns. True on GPUs for a scalar gate (GDN) with the whole-chunk kernels (16-bit
    inputs, C = 32). Paired on one H200 (bf16, H 16, D 128, ``kernel_bench --parts ab --ab qk_arrays=1
    --rules gdn``, commit 8f210f8; ``knobs_h200.json``, ``paired.qk_arrays_whole``): fwd+bwd 0.952
    (2, 8192), 0.979 (8, 2048), 0.965 (1, 32768); GPU time at (2, 8192): state passes 0.337 / 0.357 ms
    (forward / backward) against 0.400 / 0.433 with the columns, the intra-chunk forward kernel 0.310
    against 0.260 (the two arrays' writes). The forward alone took 1.064, 1.099 and 0.986 — hence the
    columns there. Not measured: the halves kernel (C = 64) and documents without a gate; with the 16-row
    tile kernels (f32 inputs) the arrays spilled and took fwd+bwd 1.04–1.07×. Memory: the backward's
    residuals then hold ``q_in`` and ``k_out`` — as large as ``q`` and ``k`` — instead of two ``[T, 1]``
    columns (bf16 at B·T = 16384 tokens, H 16, K 128: 134 MB more a layer); ``qk_arrays=False`` keeps
    the columns."""
    return target == "gpu" and gate == "scalar" and intra == "whole"


def default_warps_fwd(gate: str, num_warps: int, low: bool = True, C: int = 32) -> int:
    """GPU: warps of the forward's intra-chunk kernel (scores, the UT solve, ``W``, ``U``). With 16-bit
    inputs (``low``) and without per-channel gates it runs with 2. Paired on one H200 (bf16, H 16,
    D 128, ``kernel_bench --parts ab --ab num_warps=2``: every intra-chunk kernel at 2 warps), the
    forward — whose only other kernel, the state pass, has warps of its own — took 0.81× (DeltaNet)
    and 0.81–0.84× (GDN) at (2, 8192) and (8, 2048), KDA's 1.71–2.06× (its per-channel decay tiles
    do not fit 2 warps' registers). fwd+bwd took 1.02× (DeltaNet) and 1.17× (GDN) there: the
    backward's scores kernel is slower at 2 warps (its solve kernel faster: :func:`default_warps_solve`).
    KDA's forward runs with ``num_warps`` (its whole-chunk kernel too: at 8 warps bounded KDA's forward took
    1.35× at (2, 8192), ``paired.num_warps_fwd_8_kda_whole``), and so do f32 inputs, whose tiles already
    spill at 4 warps (ptxas, sm_90a: DeltaNet 924 B per thread at 4 warps, 1868 B at 2; GDN 1416 and 2076 B). The
    whole-chunk kernel (:func:`default_intra`) keeps 2: at 4 warps the forward took 1.12× (DeltaNet)
    and 1.11× (GDN) at (2, 8192), fwd+bwd 1.03×. Chunks above 32 tokens take ``num_warps``: at C = 64
    the whole-chunk kernel does not fit 2 warps (ptxas, sm_90a, bf16: 32 registers and 95 KB of spills per
    thread for DeltaNet) and took 0.546 ms at 4 warps against 0.800 at 8 ((2, 8192), docs/kernels.md)."""
    return 2 if (low and gate != "channel" and C <= 32) else num_warps


def default_warps_solve(num_warps: int, low: bool = True) -> int:
    """GPU: warps of the backward's solve kernel (``dv``, ``dβ``, the back-solve; one gate-free kernel
    for every rule): 2 with 16-bit inputs. Paired on one H200 (bf16, H 16, D 128, ``kernel_bench
    --parts ab --ab num_warps=2,num_warps_scores=4``, which changes only this kernel's warps), fwd+bwd
    took 0.941× for DeltaNet and GDN at (2, 8192) and 0.935× at (8, 2048). f32 inputs keep
    ``num_warps`` (not timed: as for :func:`default_warps_fwd`, their f32 tiles would spill more). The
    whole-chunk solve kernel (:func:`default_intra`) keeps 2: at 4 warps fwd+bwd took 1.04× (DeltaNet)
    and 1.03× (GDN) at (2, 8192)."""
    return 2 if low else num_warps


def default_warps_scores(gate: str, num_warps: int, low: bool = True) -> int:
    """GPU: warps of the backward's scores kernel (dq, dk, dβ, dg). With per-channel gates its tiles
    (decayed q, k and their gradients, K wide) overflow 4 warps' registers — ptxas spilled 1744 B
    per thread for KDA at 4 warps, 260 B at 8 — so KDA's runs with 8; so do every rule's with f32
    inputs (``low=False``: the f32 tiles and their split bf16 parts spilled 3188 B per thread for
    DeltaNet and 5220 B for GDN at 4 warps, 1000 B and 1492 B at 8); the other rules' with
    ``num_warps``. On one H200 (bf16, (2, 8192), H 16, D 128) KDA's intra-chunk backward took
    4.23 ms with 4 warps and 3.48 with 8; DeltaNet's 1.44 with 4 and 2.40 with 8 (all its kernels
    at 8 warps). With f32 inputs 8 warps took DeltaNet's fwd+bwd to 0.37× and GDN's to 0.40×
    (paired, ``docs/kernels.md``)."""
    return 8 if gate == "channel" or not low else num_warps


def check_chunk_size(chunk_size) -> None:
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 16
            or chunk_size % 16 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"`chunk_size` must be a power of two >= 16 for the Pallas kernels, got {chunk_size!r}")


def _check_gate_bound(gate, bound, fn=None):
    """Validate ``gate_lower_bound`` (its type, range and rule); the gates' values against it are checked by
    :func:`_check_inputs`. Returns it as a float (or None)."""
    if bound is None:
        return None
    at = f"{fn}: " if fn else ""
    if gate != "channel":
        raise ValueError(f"{at}`gate_lower_bound` applies to the per-channel (KDA) gate only")
    try:
        bound = float(bound)
    except (TypeError, ValueError):
        raise ValueError(f"{at}`gate_lower_bound` must be a float in [{MIN_GATE_BOUND}, 0), got {bound!r}") from None
    if not (MIN_GATE_BOUND <= bound < 0.0):
        raise ValueError(f"{at}`gate_lower_bound` must be in [{MIN_GATE_BOUND}, 0) (a 16-token tile anchored at its "
                         f"middle row must keep exp(8·|bound|) within float32), got {bound!r}")
    return bound


def _dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _static_scale(fn, scale):
    """``scale`` as a Python float (it is compiled into the kernels): a finite real number, a NumPy scalar or a
    concrete 0-d array; None stays None."""
    if scale is None:
        return None
    if isinstance(scale, jax.core.Tracer):
        raise ValueError(f"{fn}: `scale` must be a concrete number (the kernels compile it in), got a traced value")
    try:
        value = float(scale) if not isinstance(scale, (bool, np.bool_, str)) and np.ndim(scale) == 0 else None
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value):
        raise ValueError(f"{fn}: `scale` must be a finite real number (or None for K ** -0.5), got {scale!r}")
    return value


def _check_inputs(fn, q, k, v, g, beta, *, gate, initial_state, segment_ids, scale=None, gate_lower_bound=None):
    """The public entry points' array checks, naming ``fn`` and the argument. Shapes and dtypes always (at
    trace time); the values of concrete gates, ``beta`` and ``initial_state`` (finite; gates <= 0 and, with
    ``gate_lower_bound``, at or above it in the gates' own dtype) only outside ``jit``: traced arrays are not
    read. Returns ``scale`` as a float (None: the default)."""
    def shape(x):
        return tuple(np.shape(x))

    def need(name, x, expected, layout):
        if x is None:
            raise ValueError(f"{fn}: `{name}` is required (shape {layout} = {expected})")
        if shape(x) != expected:
            raise ValueError(f"{fn}: `{name}` must have shape {layout} = {expected}, got {shape(x)}")

    if q is None or np.ndim(q) != 4:
        raise ValueError(f"{fn}: `q` must be [B, T, H, K], got shape {None if q is None else shape(q)}")
    B, T, H, K = shape(q)
    if T == 0:
        raise ValueError(f"{fn}: `q` has T = 0 tokens; need at least one")
    scale = _static_scale(fn, scale)
    bound = _check_gate_bound(gate, gate_lower_bound, fn)
    need("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    if v is None or np.ndim(v) != 4 or shape(v)[:3] != (B, T, H):
        raise ValueError(f"{fn}: `v` must be [B, T, H, V] with B, T, H = {(B, T, H)} as in q, got shape "
                         f"{None if v is None else shape(v)}")
    need("beta", beta, (B, T, H), "[B, T, H]")
    if gate == "scalar":
        need("g", g, (B, T, H), "[B, T, H]")
    elif gate == "channel":
        need("g", g, (B, T, H, K), "[B, T, H, K]")
    if initial_state is not None:
        need("initial_state", initial_state, (B, H, K, shape(v)[3]), "[B, H, K, V]")
    if segment_ids is not None:
        need("segment_ids", segment_ids, (B, T), "[B, T]")
        dtype = np.asarray(segment_ids).dtype if not hasattr(segment_ids, "dtype") else segment_ids.dtype
        if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)):
            raise ValueError(f"{fn}: `segment_ids` must be an integer array, got dtype {dtype}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and not jnp.issubdtype(_dtype_of(x), jnp.floating):
            raise ValueError(f"{fn}: `{name}` must be a floating-point array, got dtype {_dtype_of(x)}")
    for name, x in (("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is None or isinstance(x, jax.core.Tracer):
            continue
        try:  # reduced where the array lives: three scalars back to the host, not the array
            x = jnp.asarray(x)
            finite = jnp.isfinite(x)
            bad, top, low = jax.device_get((jnp.sum(~finite), jnp.max(jnp.where(finite, x, -jnp.inf), initial=-jnp.inf),
                                            jnp.min(jnp.where(finite, x, jnp.inf), initial=jnp.inf)))
            bad, top, low = int(bad), float(top), float(low)
        except jax.errors.ConcretizationTypeError:  # a constant captured inside jit: traced, not read
            continue
        if bad:
            raise ValueError(f"{fn}: `{name}` has {bad} non-finite entries (NaN or inf)")
        if name == "g" and top > 0:
            raise ValueError(f"{fn}: `g` (log-decay) must be <= 0 everywhere (alpha = exp(g) <= 1); max is {top:.4g}")
        if name == "g" and bound is not None and not low >= float(jnp.asarray(bound, x.dtype)):
            raise ValueError(f"{fn}: `gate_lower_bound={bound}` is set but the gates reach {low:g} < {bound}: the "
                             "bounded-gate kernels would overflow. Clip or bound the gates (e.g. g = "
                             f"{bound}·sigmoid(·)), or leave `gate_lower_bound=None` for the exact kernels.")
    return scale


def _prepare(q, k, v, g, beta, *, gate, scale, initial_state, segment_ids, chunk_size, target, interpret,
             gate_lower_bound=None, bv=None, num_warps=4, num_warps_state=None, num_stages_state=None, state_dtype=None,
             anchored_bwd=None, num_warps_scores=None, num_warps_fwd=None, num_warps_solve=None, fuse_output=True,
             state_bwd="auto", inverse="auto", state_split="auto", grid_order="bhn", chunks_per_program="auto",
             anchored_fwd="fixup", qk_arrays="auto", state_pairs=False, intra="auto", fixup_chunks=1,
             transposed_state="auto", state_dot="fused"):
    """Validate, pick the static :class:`Spec`, pad and lay out. Returns ``(spec, args)``."""
    if grid_order not in GRID_ORDERS:
        raise ValueError(f"`grid_order` must be one of {GRID_ORDERS}, got {grid_order!r}")
    gate_bound = _check_gate_bound(gate, gate_lower_bound)
    if inverse != "auto" and inverse not in INVERSES:
        raise ValueError(f"`inverse` must be 'auto' or one of {INVERSES}, got {inverse!r}")
    if q.ndim != 4:
        raise ValueError(f"`q` must be [B, T, H, K], got shape {q.shape}")
    B, T, H, K0 = q.shape
    V0 = v.shape[-1]
    if target is None:
        target = default_target()
    if target not in TARGETS:
        raise ValueError(f"`target` must be one of {TARGETS}, got {target!r}")
    if state_dot not in STATE_DOTS:
        raise ValueError(f"`state_dot` must be one of {STATE_DOTS}, got {state_dot!r}")
    if intra != "auto" and intra not in INTRAS:
        raise ValueError(f"`intra` must be 'auto' or one of {INTRAS}, got {intra!r}")
    if intra == "halves" and gate == "channel":
        raise ValueError("`intra='halves'` takes scalar or no gates; per-channel gates (KDA) take 'tiles' or 'whole'")
    if intra in ("whole", "halves") and target == "tpu":
        raise ValueError(f"`intra={intra!r}` is a GPU kernel form; `target='tpu'` needs 'tiles'")
    if chunk_size is None:
        chunk_size = default_chunk(target)
    check_chunk_size(chunk_size)
    chunk_size = int(chunk_size)
    if target == "gpu" and chunk_size > GPU_MAX_CHUNK:
        raise ValueError(f"`chunk_size` must be <= {GPU_MAX_CHUNK} for the GPU kernels (their [C, C] blocks live in "
                         f"registers; larger chunks spill and take minutes to compile), got {chunk_size}")
    if intra == "halves" and chunk_size < 32:
        raise ValueError(f"`intra='halves'` splits a chunk into two halves of at least 16 rows; `chunk_size` "
                         f"must be >= 32, got {chunk_size}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    C = chunk_size
    N = -(-T // C)
    Tp = N * C
    K, V = _pad_dim(K0, target), _pad_dim(V0, target)
    io_dtype = jnp.result_type(q, k, v)
    if io_dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        io_dtype = jnp.dtype(jnp.float32)
    low = io_dtype != jnp.float32
    if intra == "whole" and gate == "channel":
        if not low:
            raise ValueError("`intra='whole'` with per-channel gates (KDA) takes 16-bit q, k, v; f32 inputs need "
                             "'tiles'")
        if gate_bound is None and anchored_fwd != "fixup":
            raise ValueError(f"`intra='whole'` with exact per-channel gates needs `anchored_fwd='fixup'` (the chunks "
                             f"whose gates span too far for its anchor are redone exactly), got {anchored_fwd!r}")
        if gate_bound is not None and (C // 2) * -gate_bound > kn.WHOLE_SPAN:
            raise ValueError(f"`intra='whole'` with per-channel gates anchors a chunk at its middle row: it takes "
                             f"`gate_lower_bound` >= {-kn.WHOLE_SPAN / (C // 2)} at chunk_size {C}, got {gate_bound}")
    if scale is None:
        scale = K0 ** -0.5
    # f32 dots: HIGHEST on TPU (Mosaic); on GPU six bf16 MMAs (tiles.BF16X6, f32-accurate) — Triton's
    # IEEE-f32 dots are FMA loops that took 70–100 s to compile per backward kernel.
    f32_prec = lax.Precision.HIGHEST if target == "tpu" else BF16X6
    if target == "tpu":
        solve_prec = lax.Precision.HIGHEST  # Mosaic: DEFAULT (one bf16 pass) or HIGHEST
    else:
        solve_prec = lax.Precision.DEFAULT if low else f32_prec  # DEFAULT = tf32 on Triton
    if inverse == "auto":
        inverse = default_inverse(target, gate or "none", low)
    if intra == "auto":
        intra = default_intra(target, gate or "none", low, chunk_size, gate_bound, anchored_fwd)
    if not (qk_arrays == "auto" or isinstance(qk_arrays, bool)):
        raise ValueError(f"`qk_arrays` must be 'auto', True or False, got {qk_arrays!r}")
    train_qk_arrays = default_qk_arrays(target, gate or "none", intra) if qk_arrays == "auto" else qk_arrays
    qk_arrays = False if qk_arrays == "auto" else qk_arrays
    cfg = Cfg(chunk=C, gate=gate or "none", docs=segment_ids is not None, scale=float(scale),
              mm_dtype=io_dtype if low else F32, mm_prec=None if low else f32_prec,
              solve_prec=solve_prec, unroll=(target == "tpu" and not interpret), gate_bound=gate_bound,
              anchor_when_safe=(target == "gpu"), inverse=inverse, qk_arrays=qk_arrays, transpose=(target == "gpu"),
              intra=intra, state_dot=state_dot)
    if anchored_bwd is None:
        anchored_bwd = "scores"
    if anchored_bwd not in ANCHORED_BWD:
        raise ValueError(f"`anchored_bwd` must be one of {ANCHORED_BWD}, got {anchored_bwd!r}")
    if anchored_fwd not in ANCHORED_FWD:
        raise ValueError(f"`anchored_fwd` must be one of {ANCHORED_FWD}, got {anchored_fwd!r}")
    if not isinstance(fuse_output, bool):
        raise ValueError(f"`fuse_output` must be True or False, got {fuse_output!r}")
    if not isinstance(state_pairs, bool):
        raise ValueError(f"`state_pairs` must be True or False, got {state_pairs!r}")
    if state_pairs and target != "gpu":
        raise ValueError(f"`state_pairs=True` is a GPU state-loop form; `target` is {target!r}")
    if isinstance(transposed_state, (list, tuple)) and not all(
            isinstance(p, str) and p in TRANSPOSED_PASSES for p in transposed_state):
        raise ValueError(f"`transposed_state` passes must be among {TRANSPOSED_PASSES}, got {transposed_state!r}")
    if not (transposed_state == "auto" or isinstance(transposed_state, (bool, list, tuple))):
        raise ValueError(f"`transposed_state` must be 'auto', True, False or a tuple of passes from "
                         f"{TRANSPOSED_PASSES}, got {transposed_state!r}")
    if transposed_state not in ("auto", False, (), []) and target != "gpu":
        raise ValueError(f"`transposed_state={transposed_state!r}` is a GPU state-loop form; `target` is {target!r}")
    if state_bwd not in STATE_BWD:
        raise ValueError(f"`state_bwd` must be one of {STATE_BWD}, got {state_bwd!r}")
    if state_split == "auto":
        state_split = default_state_split(target, B * H, N, V)
    elif isinstance(state_split, bool) or not isinstance(state_split, int) or state_split < 1 or N % state_split:
        raise ValueError(f"`state_split` must be 'auto' or a positive int dividing the number of chunks "
                         f"(T = {T} is {N} chunks of {C}), got {state_split!r}")
    solve_chunks = chunks_per_program
    if chunks_per_program == "auto":
        chunks_per_program = default_chunks_per_program(target, gate or "none", N, C, low)
        solve_chunks = default_chunks_per_program(target, gate or "none", N, C, low, kernel="solve")
    elif isinstance(chunks_per_program, bool) or not isinstance(chunks_per_program, int) or chunks_per_program < 1 \
            or N % chunks_per_program or (chunks_per_program > 1 and target != "gpu"):
        raise ValueError(f"`chunks_per_program` must be 'auto' or a positive int dividing the number of chunks "
                         f"(T = {T} is {N} chunks of {C}; above 1 on GPUs only), got {chunks_per_program!r}")
    elif chunks_per_program > 1 and C > 32:
        raise ValueError(f"`chunks_per_program` above 1 needs `chunk_size` <= 32 (looped, the backward's scores "
                         f"kernels at C = {C} ask for more than a Hopper GPU's 227 KB of shared memory), got "
                         f"{chunks_per_program!r}")
    elif chunks_per_program > 1 and not low and K * V >= 128 * 128:
        raise ValueError(f"`chunks_per_program` above 1 with float32 inputs needs K·V below 128·128 (looped at K = V "
                         f"= 128, the backward's kernels asked an H200 for 339 KB (DeltaNet) and 484 KB (KDA) of its "
                         f"227 KB of shared memory); got K = {K}, V = {V} (padded) and {chunks_per_program!r}")
    if isinstance(fixup_chunks, bool) or not isinstance(fixup_chunks, int) or fixup_chunks < 1 \
            or N % fixup_chunks or (fixup_chunks > 1 and target != "gpu"):
        raise ValueError(f"`fixup_chunks` must be a positive int dividing the number of chunks (T = {T} is {N} "
                         f"chunks of {C}; above 1 on GPUs only), got {fixup_chunks!r}")
    BHs = B * state_split * H  # sequences × heads the state passes run on
    if state_bwd == "auto":
        state_bwd = "triton" if target == "tpu" else default_state_bwd(BHs, C, K, V, io_dtype, bool(interpret),
                                                                           _on_hopper())
    elif state_bwd == "mosaic":
        if target != "gpu":
            raise ValueError(f"`state_bwd='mosaic'` is a GPU lowering; `target` is {target!r}")
        if not interpret and jax.default_backend() == "gpu" and not _on_hopper():
            raise ValueError("`state_bwd='mosaic'` needs a Hopper GPU (compute capability 9.x: wgmma, TMA) "
                             "or interpret=True; use 'auto' or 'triton' on this GPU")
        if not _mosaic_fits(C, K, V):
            raise ValueError(f"`state_bwd='mosaic'` needs the padded key dim K (a multiple of 64, <= 256), value "
                             f"dim V (a multiple of 64) and `chunk_size` (16, 32 or a multiple of 64 up to 256) "
                             f"its tiles take; got K={K}, V={V}, chunk_size={C}")
    for name, w in (("num_warps", num_warps), ("num_warps_state", num_warps_state),
                    ("num_warps_scores", num_warps_scores), ("num_warps_fwd", num_warps_fwd),
                    ("num_warps_solve", num_warps_solve)):
        if w is not None and w not in (1, 2, 4, 8, 16):
            raise ValueError(f"`{name}` must be 1, 2, 4, 8 or 16 (warps per program), got {w!r}")
    if bv is not None and (isinstance(bv, bool) or not isinstance(bv, (int, np.integer)) or bv < 1 or bv & (bv - 1)
                           or V % bv or (target == "gpu" and bv < 16) or (target == "tpu" and bv < 128)):
        least = {"gpu": " and >= 16 on GPUs (matmul tiles)",
                 "tpu": " and >= 128 on TPUs (Mosaic's blocks are whole 128-lane rows)"}[target]
        raise ValueError(f"`bv` must be a power of two dividing the padded value dim V = {V}{least}, or None, "
                         f"got {bv!r}")
    stages_ok = (isinstance(num_stages_state, (int, np.integer)) and not isinstance(num_stages_state, bool)
                 and num_stages_state >= 1)
    if num_stages_state is not None and not stages_ok:
        raise ValueError(f"`num_stages_state` must be a positive int (pipeline stages), got {num_stages_state!r}")
    if state_dtype is not None:
        try:
            ok = jnp.dtype(state_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(F32))
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"`state_dtype` must be bfloat16, float16 or float32 (or None: the inputs' dtype), "
                             f"got {state_dtype!r}")
    if bv is not None:
        bv = int(bv)
    else:
        bv = V if target == "tpu" else (min(V, split_bv(C, low)) if state_split > 1 else default_bv(BHs, V))
    if num_warps_state is None:
        num_warps_state = default_warps_state(bv, low)
    if transposed_state == "auto":
        transposed_state = default_transposed_state(target, gate, BHs * (V // bv), bv, low)
    else:
        transposed_state = TRANSPOSED_PASSES if transposed_state is True else tuple(transposed_state or ())
    s = Spec(cfg=cfg, target=target, interpret=bool(interpret), B=B, H=H, N=N, K=K, V=V, bv=bv,
             store_dtype=io_dtype, state_dtype=(io_dtype if state_dtype is None else state_dtype),
             num_warps=num_warps, num_warps_state=num_warps_state,
             num_stages_state=STATE_STAGES if num_stages_state is None else int(num_stages_state),
             num_warps_scores=(default_warps_scores(cfg.gate, num_warps, low) if num_warps_scores is None
                               else int(num_warps_scores)),
             num_warps_fwd=(default_warps_fwd(cfg.gate, num_warps, low, C) if num_warps_fwd is None
                            else int(num_warps_fwd)),
             num_warps_solve=(default_warps_solve(num_warps, low) if num_warps_solve is None
                              else int(num_warps_solve)),
             anchored_bwd=anchored_bwd, anchored_fwd=anchored_fwd, fuse_output=fuse_output, state_bwd=state_bwd,
             state_split=state_split, grid_order=grid_order, chunks_per_program=chunks_per_program,
             solve_chunks=solve_chunks,
             state_pairs=state_pairs, train_qk_arrays=train_qk_arrays, fixup_chunks=fixup_chunks,
             transposed_state=transposed_state)

    def prep(a, D0, D, dtype):
        a = a.astype(dtype)
        a = jnp.pad(a, ((0, 0), (0, Tp - T), (0, 0), (0, D - D0)))
        return a if target == "gpu" else jnp.transpose(a, (0, 2, 1, 3))

    qq = prep(q, K0, K, io_dtype)
    kk = prep(k, K0, K, io_dtype)
    vv = prep(v, V0, V, io_dtype)
    bb = prep(beta[..., None], 1, 1, F32)
    gg = None
    if gate is not None:
        gg = prep(g[..., None], 1, 1, F32) if gate == "scalar" else prep(g, K0, K, F32)
        if not low:  # f32: no log-decay below GATE_FLOOR (see there)
            gg = jnp.maximum(gg, GATE_FLOOR)
    doc = None
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids)
        reset = jnp.concatenate([jnp.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        reset = jnp.pad(reset, ((0, 0), (0, Tp - T))).reshape(B, N, C)
        doc = jnp.cumsum(reset.astype(jnp.int32), axis=-1).astype(F32).reshape(B, Tp, 1, 1)
        if target == "tpu":
            doc = jnp.transpose(doc, (0, 2, 1, 3))
    if initial_state is None:
        h0 = jnp.zeros((B, H, K, V), F32)
    else:
        h0 = jnp.pad(initial_state.astype(F32), ((0, 0), (0, 0), (0, K - K0), (0, V - V0)))
    return s, (qq, kk, vv, gg, bb, doc, h0)


@functools.lru_cache(maxsize=None)
def _tuning_knobs() -> frozenset:
    """The launch knobs ``**tuning`` takes: ``_prepare``'s keywords after the public ones (read once)."""
    import inspect
    # gate_lower_bound stays: the rules without per-channel gates refuse it with a message of its own
    public = {"q", "k", "v", "g", "beta", "gate", "scale", "initial_state", "segment_ids", "chunk_size", "target",
              "interpret"}
    return frozenset(inspect.signature(_prepare).parameters) - public


def _check_tuning(fn: str, tuning: dict) -> None:
    unknown = sorted(set(tuning) - _tuning_knobs())
    if unknown:
        raise TypeError(f"{fn}: unknown keyword {unknown[0]!r}; the launch knobs are "
                        f"{', '.join(sorted(_tuning_knobs()))}")


def _delta(q, k, v, g, beta, **kw):
    B, T, H, K0 = q.shape
    V0 = v.shape[-1]
    s, args = _prepare(q, k, v, g, beta, **kw)
    o, sT = _chunked(s, *args)
    if s.target == "tpu":
        o = jnp.transpose(o, (0, 2, 1, 3))
    o = o[:, :T, :, :V0].astype(jnp.result_type(q, k, v))
    return o, sT[:, :, :K0, :V0]


def _debug_spec(q, k, v, g, beta, gate=None, **tuning):
    """``(spec, laid-out args)`` for timing the five kernels one by one (benchmarks). ``gate``:
    None (DeltaNet), "scalar" (``g [B, T, H]``) or "channel"; ``tuning`` may hold
    ``gate_lower_bound``, ``chunk_size`` and the launch knobs (``bv``, ``num_warps``,
    ``num_warps_state``, ``num_stages_state``, ``num_warps_scores``, ``num_warps_fwd``, ``num_warps_solve``,
    ``anchored_bwd``, ``anchored_fwd``, ``fixup_chunks``, ``intra``, ``transposed_state``, ``state_dot``)."""
    if gate is None and g is not None:
        gate = "channel" if g.ndim == 4 else "scalar"
    tuning.setdefault("chunk_size", None)
    return _prepare(q, k, v, g, beta, gate=gate, scale=None, initial_state=None,
                    segment_ids=None, target="gpu", interpret=None, **tuning)


_DOC = """

    Args:
      q, k: ``[B, T, H, K]`` (keys L2-normalized); v: ``[B, T, H, V]``;
      beta: ``[B, T, H]``; ``scale`` multiplies q (default ``K**-0.5``);
      initial_state: ``[B, H, K, V]`` (f32); segment_ids: ``[B, T]`` ints, the
      state resets where the id changes; chunk_size: a power of two >= 16, at most ``GPU_MAX_CHUNK`` (64)
      on GPUs (default: :func:`default_chunk` of the target — the result does not depend on it).
      target: ``"gpu"`` (Triton-lowered kernels) or ``"tpu"`` (Mosaic-lowered
      kernels); default from ``jax.default_backend()``. interpret: run the kernels
      in the Pallas interpreter (default: on the CPU).
      **tuning: launch knobs, each with a measured default — ``bv``, ``num_warps``,
      ``num_warps_state``, ``num_stages_state``, ``num_warps_scores``, ``num_warps_fwd``,
      ``num_warps_solve``, ``state_dtype``,
      ``fuse_output``, ``state_bwd``, ``inverse``, ``state_split`` (``"auto"`` or P: the
      state passes run P segments of every sequence at once; P divides the chunk count),
      ``grid_order`` (launch order of the parallel kernels' grid: ``GRID_ORDERS``) and
      ``chunks_per_program`` (``"auto"`` or G: on GPUs each program of the backward's intra-chunk
      kernels loops over G chunks, pipelining their loads; G divides the chunk count; ``"auto"`` may
      pick the solve and scores kernels' apart: :func:`default_chunks_per_program`).
      ``qk_arrays`` (scalar gates and documents; ``"auto"``, True or False): the forward kernel writes
      ``q ⊙ E_in`` and ``k ⊙ E_out`` as ``[T, K]`` arrays for the state passes, as per-channel gates
      do, instead of two ``[T, 1]`` row-factor columns (more bytes, fewer instructions per state
      step); ``"auto"``: arrays in a differentiated call where :func:`default_qk_arrays` says so
      (GDN with the whole-chunk kernels), columns otherwise; True / False: the same in every call.
      ``state_pairs`` (GPU; default False): the forward state pass takes two chunks a step, their
      ``W`` and ``U`` merged in the loop (half the dependent steps, more matmuls per step; slower on
      one H200: forward 0.99–1.62×, fwd+bwd 1.10–1.26×).
      ``transposed_state`` (GPU; ``"auto"``, True, False or a tuple of passes from ``TRANSPOSED_PASSES``):
      the Triton state passes that carry the transposed state, every product of a step ``bv`` rows tall —
      "fwd" (a forward that stores no per-chunk state: an undifferentiated call's), "train" (the training
      forward, ``h`` and ``Ũ`` transposed back for their stores), "bwd" (the backward pass); True: all
      three; ``"auto"``: :func:`default_transposed_state`.
      ``fixup_chunks`` (GPU, exact per-channel gates with ``anchored_fwd="fixup"``; default 1): chunks
      each program of the forward's second intra-chunk pass loops over, checking each one's flag (fewer
      programs where most chunks have nothing to redo; it divides the chunk count).
      ``intra`` (``"auto"``, ``"tiles"``, ``"whole"`` or ``"halves"``): the intra-chunk kernels' form —
      16-row tile pairs, or (GPU) one ``[C, C]`` / ``[C, D]`` matmul per product (per-channel gates: 16-bit
      inputs, the forward kernel alone), or (scalar or no gates) the forward's from two whole halves of the
      chunk (C >= 32); ``"auto"``: :func:`default_intra`.
      ``state_dot`` (``STATE_DOTS``; default ``"fused"``): with scalar gates and 16-bit states, the gate
      gradient's ``Σ S ⊙ dS`` in the backward's scores kernel from the ``dS`` the whole-chunk kernel loads
      for its ``Ũ dSᵀ`` product, reading only ``S`` again (``"fused"``; the tile kernels then take the
      elementwise form), as elementwise products of both states read again (``"elementwise"``), or as the
      trace of 64-row block products on tensor cores (``"tensor"``: fewer instructions, 1-2% slower on an
      H200, docs/kernels.md); other calls are unaffected.
    Returns:
      ``(o [B, T, H, V] in the inputs' dtype, S [B, H, K, V] float32)``.
    """


def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=None,
                     target=None, interpret=None, **tuning):
    _check_tuning("chunk_delta_rule", tuning)
    scale = _check_inputs("chunk_delta_rule", q, k, v, None, beta, gate=None, initial_state=initial_state,
                          segment_ids=segment_ids, scale=scale, gate_lower_bound=tuning.get("gate_lower_bound"))
    return _delta(q, k, v, None, beta, gate=None, scale=scale, initial_state=initial_state,
                  segment_ids=segment_ids, chunk_size=chunk_size, target=target, interpret=interpret, **tuning)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=None,
                           target=None, interpret=None, **tuning):
    _check_tuning("chunk_gated_delta_rule", tuning)
    scale = _check_inputs("chunk_gated_delta_rule", q, k, v, g, beta, gate="scalar", initial_state=initial_state,
                          segment_ids=segment_ids, scale=scale, gate_lower_bound=tuning.get("gate_lower_bound"))
    return _delta(q, k, v, g, beta, gate="scalar", scale=scale, initial_state=initial_state,
                  segment_ids=segment_ids, chunk_size=chunk_size, target=target, interpret=interpret, **tuning)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=None,
              target=None, interpret=None, gate_lower_bound=None, **tuning):
    _check_tuning("chunk_kda", tuning)
    scale = _check_inputs("chunk_kda", q, k, v, g, beta, gate="channel", initial_state=initial_state,
                          segment_ids=segment_ids, scale=scale, gate_lower_bound=gate_lower_bound)
    return _delta(q, k, v, g, beta, gate="channel", scale=scale, initial_state=initial_state,
                  segment_ids=segment_ids, chunk_size=chunk_size, target=target, interpret=interpret,
                  gate_lower_bound=gate_lower_bound, **tuning)


chunk_delta_rule.__doc__ = "DeltaNet, ``S_t = (I − β_t k_tᵀk_t) S_{t−1} + β_t k_tᵀv_t``, by Pallas kernels." + _DOC
chunk_gated_delta_rule.__doc__ = ("Gated DeltaNet (``g [B, T, H]`` log-decay, one scalar per head), by Pallas "
                                  "kernels (scalar-gate variants: each score tile's decay is one ``[16, 16]`` "
                                  "``exp`` of differences; fwd+bwd takes 1.14–1.27× DeltaNet's on one H200, half of "
                                  "the difference in the backward's scores kernel, which also forms the gate's "
                                  "gradient: docs/benchmarks.md)." + _DOC)
_BOUND_DOC = """      gate_lower_bound: opt-in bounded-gate mode (e.g. ``-5.0`` for K3's ``g = −5·σ(·)``), in
        ``[-8, 0)``: the caller promises ``g >= gate_lower_bound`` everywhere. Each 16-token
        diagonal tile is then anchored at its middle row (``|G_i − G_mid| <= 8·|bound|``, so
        ``e^{±40}`` at −5 stays in float32) and computed by one matmul instead of a 16-step
        loop. Concrete gates are checked (``ValueError`` if violated); traced gates (under
        ``jit``) cannot be — gates below the bound then give wrong results (inf/NaN), so bound
        them by construction. ``None`` (default): the exact kernels, safe for any gate.
      anchored_bwd (launch knob): ``"scores"`` (default: the backward anchors its diagonal
        tiles — bounded gates: all; exact gates on GPUs: those whose gates allow it) or
        ``"none"`` (the exact loop on every one); see ``ANCHORED_BWD``.
      anchored_fwd (launch knob; exact gates on GPUs): ``"fixup"`` (default: the bounded-gate
        kernel on every chunk, then the exact kernel again on the chunks holding a tile whose
        gates sum below −64) or ``"fused"`` (one intra-chunk forward kernel, deciding per diagonal
        tile between the anchored matmul and the loop: faster only where most chunks hold such
        tiles); see ``ANCHORED_FWD``.
"""
chunk_kda.__doc__ = ("Kimi Delta Attention (``g [B, T, H, K]`` per-channel log-decay: decay, then erase), by "
                     "Pallas kernels." + _DOC.replace("    Returns:", _BOUND_DOC + "    Returns:"))
