"""Pallas grouped matmul (GMM): the ``impl="pallas"`` path of
:func:`~lineage_jax.layers.grouped.grouped_matmul`.

Same semantics as ``jax.lax.ragged_dot`` (``x [M, K]`` in contiguous row groups, group
``g`` times ``w[g] [K, N]``, rows at index ``>= sum(group_sizes)`` give zero), and the
same padded layout as the ``"tiled"`` path (:func:`~lineage_jax.layers.grouped_layout._layout`):
every group is padded to whole ``tile``-row tiles, rows are gathered into that layout
before the kernels and back out of it after.

Kernels (all float32 accumulation, written for the Pallas **Triton** lowering and run by
the Pallas interpreter on the CPU):

* ``_tile_matmul`` (forward, and ``dx``): grid ``(num_tiles, out_cols / bo)``. Program
  ``(i, j)`` reads tile ``i``'s group from an int32 ``[num_tiles]`` ref (a whole-array
  block), loops over the contraction in blocks of ``bc`` (``lax.fori_loop``, static trip
  count) and writes the ``[tile, bo]`` output block. The padded rows and the weight
  ``[G, K, N]`` are whole-array refs indexed with ``pl.ds`` (the weight's group axis by
  the loaded id): the Triton lowering has no scalar prefetch, so the group id cannot
  drive a ``BlockSpec`` index map there. ``transpose=True`` contracts against ``w[g]^T``
  (the weight block is read as ``[bo, bc]`` and contracted on its last axis), which gives
  ``dx = dy W[g]^T`` without a transposed copy of ``w``.
* ``_tile_weight_grad`` (``dw``): grid ``(G, K / bk, N / bn)``. Program ``(g, a, b)``
  loops over group ``g``'s tiles ``[toff[g], toff[g+1])`` (an int32 ``[G + 1]`` ref of
  padded tile offsets; a ``lax.fori_loop`` with traced bounds, which the Triton lowering
  turns into an ``scf.for``) and sums ``x_tile^T dy_tile``. Groups without rows run no
  iteration and give ``dw[g] = 0``.

Blocks and launch settings: :func:`plan` (tuned on one H200; ``block_k`` / ``block_n`` fix them
instead). ``tile`` rows per tile is a power of two ``>= 16`` (Triton's ``dot`` wants
power-of-two operands of at least 16 along each axis). ``K`` and ``N`` are zero-padded to the
plan's widths in the wrapper (the padded weight is then a copy of ``w``) and the padding is
sliced off the results.

:func:`routed_experts` is a MoE layer's whole routed path on these kernels: each token's row
gathered once into its ``k`` slots of the padded layout (:func:`slots`), the three grouped
matmuls slot to slot, and one gather to combine; ``MoE`` uses it when its grouped matmuls
resolve to ``"pallas"``.

Reverse mode is a ``jax.custom_vjp`` (nothing is differentiated through ``pallas_call``);
forward mode (``jax.jvp``) is not supported. This path is meant for GPUs (and the CPU
interpreter); on TPU ``grouped_matmul`` uses ``jax.lax.ragged_dot``, a native grouped matmul.

Limits: the compiled kernels address memory with 32-bit element offsets, so every padded
operand must hold fewer than ``2**31`` elements (checked). Inside ``shard_map`` the kernel
outputs carry the operands' varying mesh axes (``check_vma``); the Pallas *interpreter*
cannot run there on varying operands (it evaluates the kernel without those types), so
``interpret`` inside a ``shard_map`` with ``check_vma=True`` raises; compiled, it runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from lineage_jax.layers.ffn import glu
from lineage_jax.layers.grouped_layout import RESIDUALS, _layout, _out_dtype, _rows
from lineage_jax.memory._validate import is_concrete, require_bool

try:  # present in jax 0.10 and 0.11
    from jax.experimental.pallas import triton as pltriton
except Exception:  # pragma: no cover
    pltriton = None

Array = jax.Array

# Launch settings of the GPU (Triton) kernels, from a sweep on one H200 (bf16, 131,072 rows over
# 64 experts, 2048 <-> 640; see :func:`plan`). Shared memory for the software-pipelined
# operand buffers (an H200 has 227 KiB per block): ``stages * stage_bytes <= GPU_SMEM_BYTES``.
GPU_SMEM_BYTES = 200 * 2**10
# Explicit ``block_k`` / ``block_n`` (the pre-tuning settings, kept for them): 4 warps, 8 for
# [128, 128] float32 accumulators and more (255 registers and spills at 4 warps), and up to
# GPU_MAX_STAGES stages within GPU_STAGE_BYTES.
GPU_NUM_WARPS = 4
GPU_NUM_WARPS_WIDE = 8
GPU_WIDE_ACC = 128 * 128
GPU_STAGE_BYTES = 160 * 2**10
GPU_MAX_STAGES = 3

_DOT_MIN = 16  # smallest operand dimension of a Triton dot


def _pow2_at_least_16(v) -> bool:
    return (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= _DOT_MIN
            and (v & (v - 1)) == 0)


def _fit(d: int, b: int) -> int:
    """``b`` shrunk to the next power of two ``>= 16`` of a smaller ``d``."""
    return min(b, max(_DOT_MIN, 1 << (max(int(d), 1) - 1).bit_length()))


def block_sizes(k: int, n: int, block_k: int = 128, block_n: int = 128) -> tuple[int, int]:
    """``(bk, bn)``, the contraction and output-column blocks of explicit ``block_k`` /
    ``block_n`` for a ``[.., K] x [G, K, N]`` product, each shrunk to the next power of two
    ``>= 16`` of a smaller ``K`` / ``N`` (so small dims are not padded to a whole block).
    ``K`` / ``N`` are zero-padded to multiples of them.

    Raises:
      ValueError: ``block_k`` or ``block_n`` not a power of two ``>= 16``.
    """
    for name, v in (("block_k", block_k), ("block_n", block_n)):
        if not _pow2_at_least_16(v):
            raise ValueError(f"gmm: `{name}` must be a power of two >= 16, got {v!r}")
    return _fit(k, block_k), _fit(n, block_n)


class Launch(NamedTuple):
    """One kernel's blocks and Triton settings. Matmul kernels: ``a`` = contraction block,
    ``b`` = output-column block, ``rows`` = the tile. Weight-gradient kernel: ``rows`` = rows
    summed per step (a divisor of the tile), ``a`` / ``b`` = the ``K`` / ``N`` blocks."""

    rows: int
    a: int
    b: int
    warps: int
    stages: int


class Plan(NamedTuple):
    """The padded widths and the three kernels' launches of one ``[.., K] x [G, K, N]`` product."""

    kp: int
    np_: int
    fwd: Launch
    dx: Launch
    dw: Launch


def _stages_within(want: int, stage_bytes: int) -> int:
    return int(max(1, min(want, GPU_SMEM_BYTES // max(1, stage_bytes))))


def _pad_width(d: int) -> int:
    """Padded width of a ``K`` / ``N`` dimension in the tuned plan: a multiple of 128, or the
    next power of two ``>= 16`` below 128."""
    return -(-d // 128) * 128 if d > 128 else _fit(d, 128)


def plan(k: int, n: int, tile: int, itemsize: int = 2, block_k: Optional[int] = None,
         block_n: Optional[int] = None) -> Plan:
    """The kernels' blocks for ``[.., K] x [G, K, N]`` with ``tile``-row tiles.

    Default (tuned on one H200, bf16, 131,072 rows over 64 experts, ``K, N`` in {2048, 640};
    ``python -m experiments.gmm_bench``): ``K`` and ``N`` padded to multiples of 128; the matmul
    kernels (forward, and ``dx`` against the transposed weight) contract in blocks of 64 and
    write 256-column blocks with 8 warps and 4 stages when the output is at least 1024 wide
    (a multiple of 256), else 128-column blocks (forward: 8 warps, ``dx``: 4; 3 stages); the
    weight-gradient kernel writes ``[128, 256]`` blocks summing 128 rows a step (8 warps) when
    ``N`` is that wide, else ``[128, 128]`` blocks summing 64 rows a step (4 warps), 2 stages.
    Measured against the pre-tuning settings (``[128, 128]`` blocks everywhere): 1.48-1.73 ms
    -> 0.91-1.08 ms per kernel. Stages are capped so their operand buffers fit
    :data:`GPU_SMEM_BYTES` (float32 operands get fewer).

    ``block_k`` / ``block_n`` (powers of two ``>= 16``, see :func:`block_sizes`) fix the
    ``K`` / ``N`` blocks of every kernel instead (each padded to them; launch settings as before
    tuning).
    """
    if block_k is not None or block_n is not None:
        bk, bn = block_sizes(k, n, 128 if block_k is None else block_k, 128 if block_n is None else block_n)
        kp, np_ = -(-k // bk) * bk, -(-n // bn) * bn

        def old(rows, a, b, acc):
            warps = GPU_NUM_WARPS_WIDE if acc >= GPU_WIDE_ACC else GPU_NUM_WARPS
            stage = (rows * a + a * b) * itemsize
            return Launch(rows, a, b, warps, int(max(1, min(GPU_MAX_STAGES, GPU_STAGE_BYTES // stage))))

        return Plan(kp, np_, old(tile, bk, bn, tile * bn), old(tile, bn, bk, tile * bk),
                    Launch(tile, bk, bn, *old(tile, bk, bn, bk * bn)[3:]))
    kp, np_ = _pad_width(k), _pad_width(n)

    def matmul(c, o, transposed):
        bc = min(64, c)
        wide = o >= 1024 and o % 256 == 0
        bo = 256 if wide else min(128, o)
        warps, want = (8, 4) if wide else ((4 if transposed else 8), 3)
        return Launch(tile, bc, bo, warps, _stages_within(want, (tile * bc + bc * bo) * itemsize))

    wide = np_ >= 1024 and np_ % 256 == 0
    bn = 256 if wide else min(128, np_)
    bk = min(128, kp)
    rows = min(tile, 128 if wide else 64)
    dw = Launch(rows, bk, bn, 8 if wide else 4, _stages_within(2, rows * (bk + bn) * itemsize))
    return Plan(kp, np_, matmul(kp, np_, False), matmul(np_, kp, True), dw)


def _params(interpret: bool, launch: Launch):
    """Triton compiler parameters (none in the interpreter)."""
    if interpret or pltriton is None:
        return None
    return pltriton.CompilerParams(num_warps=launch.warps, num_stages=launch.stages)


def _whole(shape) -> pl.BlockSpec:
    """A block that is the whole array, the same for every program."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _out_struct(shape, dtype, like: Array) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output type that varies over the same ``shard_map`` mesh axes as
    ``like`` (required under ``check_vma``; the kernels' operands all share one variance,
    see ``grouped._common_variance``). The field is ``manual_axis_type`` or, in other jax
    versions, ``vma``; outside ``shard_map`` it is empty and ignored."""
    aval = jax.typeof(like)
    for field in ("manual_axis_type", "vma"):
        if hasattr(aval, field):
            try:
                return jax.ShapeDtypeStruct(tuple(shape), dtype, **{field: getattr(aval, field)})
            except TypeError:  # this jax's ShapeDtypeStruct has the other name
                continue
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _varying_axes(*arrays: Array) -> frozenset:
    """The ``shard_map`` mesh axes any of ``arrays`` varies over (empty outside ``shard_map``
    or under ``check_vma=False``)."""
    axes = set()
    for a in arrays:
        aval = jax.typeof(a)
        mat = getattr(aval, "manual_axis_type", None)
        axes |= set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())
    return frozenset(axes)


def _pad_to(a: Array, axis: int, multiple: int) -> Array:
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


# ----------------------------------------------------------------------------- kernels
def _tile_matmul_kernel(gid_ref, x_ref, w_ref, o_ref, *, tile, bc, n_c, transpose, cdt):
    """``o[tile i, block j] = x[tile i] @ w[gid[i]][:, block j]`` (``transpose``: ``w[gid[i]]^T``)."""
    i, j = pl.program_id(0), pl.program_id(1)
    bo = o_ref.shape[-1]
    g = gid_ref[i]
    rows = pl.ds(pl.multiple_of(i * tile, tile), tile)
    outs = pl.ds(pl.multiple_of(j * bo, bo), bo)

    def body(c, acc):
        cs = pl.ds(pl.multiple_of(c * bc, bc), bc)
        a = x_ref[rows, cs].astype(cdt)                            # [tile, bc]
        if transpose:
            b = w_ref[g, outs, cs].astype(cdt)                     # [bo, bc]
            dims = (((1,), (1,)), ((), ()))
        else:
            b = w_ref[g, cs, outs].astype(cdt)                     # [bc, bo]
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_c, body, jnp.zeros((tile, bo), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile_matmul(x_pad: Array, w: Array, tile_group: Array, launch: Launch, *, transpose: bool, out_dtype,
                 interpret: bool) -> Array:
    """Every row tile of ``x_pad [T*tile, C]`` times its group's weight: ``w [G, C, O]``
    (``transpose``: ``w [G, O, C]`` used as ``w[g]^T``) -> ``[T*tile, O]`` in ``out_dtype``.
    ``C`` and ``O`` are multiples of ``launch.a`` and ``launch.b``; ``launch.rows`` is the tile."""
    rows, c = x_pad.shape
    o = w.shape[1] if transpose else w.shape[2]
    tile, bc, bo = launch.rows, launch.a, launch.b
    n_tiles = rows // tile
    cdt = jnp.promote_types(x_pad.dtype, w.dtype)
    kernel = functools.partial(_tile_matmul_kernel, tile=tile, bc=bc, n_c=c // bc,
                               transpose=transpose, cdt=cdt)
    return pl.pallas_call(
        kernel,
        grid=(n_tiles, o // bo),
        in_specs=[_whole(tile_group.shape), _whole(x_pad.shape), _whole(w.shape)],
        out_specs=pl.BlockSpec((tile, bo), lambda i, j: (i, j)),
        out_shape=_out_struct((rows, o), out_dtype, x_pad),
        compiler_params=_params(interpret, launch),
        interpret=interpret,
        name="gmm_tiles_t" if transpose else "gmm_tiles",
    )(tile_group, x_pad, w)


def _tile_weight_grad_kernel(toff_ref, x_ref, dy_ref, o_ref, *, rows, per_tile, cdt):
    """``o = sum over the row blocks of tiles [toff[g], toff[g+1]) of x[:, k block]^T dy[:, n block]``
    (``per_tile`` blocks of ``rows`` rows per tile)."""
    g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = o_ref.shape
    ks = pl.ds(pl.multiple_of(a * bk, bk), bk)
    ns = pl.ds(pl.multiple_of(b * bn, bn), bn)

    def body(t, acc):
        rs = pl.ds(pl.multiple_of(t * rows, rows), rows)
        xt = x_ref[rs, ks].astype(cdt)                             # [rows, bk]
        dyt = dy_ref[rs, ns].astype(cdt)                           # [rows, bn]
        return acc + lax.dot_general(xt, dyt, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(toff_ref[g] * per_tile, toff_ref[g + 1] * per_tile, body, jnp.zeros((bk, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile_weight_grad(x_pad: Array, dy_pad: Array, toff: Array, g: int, launch: Launch, *, tile: int,
                      out_dtype, interpret: bool) -> Array:
    """``dw [G, K, N]``: per group the sum of its tiles' ``x_tile^T dy_tile`` (``x_pad [R, K]``,
    ``dy_pad [R, N]`` in the padded layout, ``toff [G + 1]`` the groups' tile offsets), summed
    ``launch.rows`` rows a step."""
    _, k = x_pad.shape
    n = dy_pad.shape[1]
    cdt = jnp.promote_types(x_pad.dtype, dy_pad.dtype)
    bk, bn = launch.a, launch.b
    kernel = functools.partial(_tile_weight_grad_kernel, rows=launch.rows, per_tile=tile // launch.rows, cdt=cdt)
    return pl.pallas_call(
        kernel,
        grid=(g, k // bk, n // bn),
        in_specs=[_whole(toff.shape), _whole(x_pad.shape), _whole(dy_pad.shape)],
        out_specs=pl.BlockSpec((None, bk, bn), lambda gi, a, b: (gi, a, b)),
        out_shape=_out_struct((g, k, n), out_dtype, x_pad),
        compiler_params=_params(interpret, launch),
        interpret=interpret,
        name="gmm_weight_grad",
    )(toff, x_pad, dy_pad)


# ----------------------------------------------------------------------------- layout + vjp
def _num_tiles(m: int, g: int, tile: int) -> int:
    """Tiles that hold every group padded to whole tiles (``<= M + G·(tile-1)`` rows)."""
    return -(-(m + g * (tile - 1)) // tile)


def _tiles(group_sizes: Array, m: int, g: int, tile: int):
    """``(src [T*tile], tile_group [T], pos [M], toff [G+1])`` of the padded layout."""
    n_tiles = _num_tiles(m, g, tile)
    lay = _layout(group_sizes, m, g, tile, 1, n_tiles)
    per_group = (jnp.minimum(group_sizes, m).astype(jnp.int32) + tile - 1) // tile  # clamped as in _layout
    toff = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_group)])
    toff = jnp.minimum(toff, n_tiles).astype(jnp.int32)   # tiles past the layout hold no real row
    return lay.src.reshape(-1), lay.tile_group.reshape(-1), lay.pos, toff


def _pad_weight(w: Array, p: Plan) -> Array:
    return _pad_to(_pad_to(w, 1, p.kp), 2, p.np_)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _padded_gmm(x_pad, w_pad, tile_group, toff, tile, p, out_dtype, interpret):
    """``[R, Kp] x [G, Kp, Np] -> [R, Np]`` on rows already in the padded layout."""
    return _tile_matmul(x_pad, w_pad, tile_group, p.fwd, transpose=False, out_dtype=out_dtype, interpret=interpret)


def _padded_gmm_fwd(x_pad, w_pad, tile_group, toff, tile, p, out_dtype, interpret):
    return _padded_gmm(x_pad, w_pad, tile_group, toff, tile, p, out_dtype, interpret), (x_pad, w_pad, tile_group, toff)


def _padded_gmm_bwd(tile, p, out_dtype, interpret, res, dy_pad):
    """``dx = dy W[g]^T`` by the tile kernel with ``transpose``; ``dw`` by the per-group
    weight-gradient kernel (float32 sums)."""
    x_pad, w_pad, tile_group, toff = res
    dy_pad = dy_pad.astype(out_dtype)
    dx = _tile_matmul(dy_pad, w_pad, tile_group, p.dx, transpose=True, out_dtype=x_pad.dtype, interpret=interpret)
    dw = _tile_weight_grad(x_pad, dy_pad, toff, w_pad.shape[0], p.dw, tile=tile, out_dtype=w_pad.dtype,
                           interpret=interpret)
    return dx, dw, None, None


_padded_gmm.defvjp(_padded_gmm_fwd, _padded_gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm(x, w, group_sizes, tile, p, out_dtype, interpret):
    m, k = x.shape
    g, _, n = w.shape
    src, tile_group, pos, _ = _tiles(group_sizes, m, g, tile)
    x_pad = _pad_to(_rows(x, src), 1, p.kp)
    y_pad = _tile_matmul(x_pad, _pad_weight(w, p), tile_group, p.fwd, transpose=False, out_dtype=out_dtype,
                         interpret=interpret)
    return _rows(y_pad, pos)[:, :n]


def _gmm_fwd(x, w, group_sizes, tile, p, out_dtype, interpret):
    return _gmm(x, w, group_sizes, tile, p, out_dtype, interpret), (x, w, group_sizes)


def _gmm_bwd(tile, p, out_dtype, interpret, res, dy):
    """The padded-layout backward (:func:`_padded_gmm_bwd`) between the row gathers."""
    x, w, group_sizes = res
    m, k = x.shape
    g, _, n = w.shape
    src, tile_group, pos, toff = _tiles(group_sizes, m, g, tile)
    x_pad = _pad_to(_rows(x, src), 1, p.kp)
    dy_pad = _pad_to(_rows(dy, src), 1, p.np_)
    dx_pad, dw, _, _ = _padded_gmm_bwd(tile, p, out_dtype, interpret, (x_pad, _pad_weight(w, p), tile_group, toff),
                                       dy_pad)
    return _rows(dx_pad, pos)[:, :k], dw[:, :k, :n].astype(w.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(x: Array, w: Array, group_sizes: Array, *, tile: int = 128, block_k: Optional[int] = None,
        block_n: Optional[int] = None, out_dtype=None, interpret: bool | None = None) -> Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` by the Pallas kernels of this module.

    Differentiable in ``x`` and ``w`` (reverse mode, ``jax.custom_vjp``). The arguments are
    not checked for shape consistency here:
    :func:`~lineage_jax.layers.grouped.grouped_matmul` (``impl="pallas"``) checks them first.

    Args:
      x: ``[M, K]`` rows, in contiguous groups (group 0 first).
      w: ``[G, K, N]`` one matrix per group.
      group_sizes: ``[G]`` integer rows per group; rows at index ``>= sum(group_sizes)``
        give zero.
      tile: rows per tile (groups are padded to multiples of it); a power of two ``>= 16``.
      block_k: ``K`` block of every kernel (power of two ``>= 16``; see :func:`block_sizes`);
        default: the tuned :func:`plan`.
      block_n: ``N`` block of every kernel, likewise.
      out_dtype: output dtype; default ``ragged_dot``'s for these inputs.
      interpret: run the kernels in the Pallas interpreter; default on the CPU backend.

    Returns:
      ``[M, N]`` in ``out_dtype`` (float32 accumulation).

    Raises:
      ValueError: ``tile``, ``block_k`` or ``block_n`` not a power of two ``>= 16``; or,
        compiled, a padded operand of ``2**31`` elements or more (32-bit offsets).
      NotImplementedError: ``interpret`` inside a ``shard_map`` with ``check_vma=True`` on
        operands that vary over mesh axes (jax's Pallas interpreter evaluates the kernel
        without varying-axis types there; the compiled GPU kernels are not affected).
    """
    if not _pow2_at_least_16(tile):
        raise ValueError(f"gmm: `tile` must be a power of two >= 16 for the Pallas kernels, got {tile!r}")
    require_bool("gmm", "interpret", interpret, allow_none=True,
                 none_means="the default: interpreted on the CPU backend")
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    cdt = jnp.promote_types(x.dtype, w.dtype)
    p = plan(x.shape[1], w.shape[2], int(tile), np.dtype(cdt).itemsize, block_k, block_n)
    if out_dtype is None:
        out_dtype = _out_dtype(x, w, group_sizes)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    m, n, g = x.shape[0], w.shape[2], w.shape[0]
    if m == 0 or g == 0 or n == 0 or x.shape[1] == 0:              # nothing to multiply: all zero
        return jnp.zeros((m, n), out_dtype)
    if interpret and (axes := _varying_axes(x, w, group_sizes)):
        raise NotImplementedError(
            f"gmm: the Pallas interpreter (`interpret`, the CPU default) cannot run inside a shard_map "
            f"with check_vma=True (the operands vary over mesh axes {sorted(axes)}); use impl='tiled' "
            f"there, or check_vma=False")
    _check_offsets(interpret, _num_tiles(m, g, tile) * tile, g, p, f"`x` [{m}, {x.shape[1]}] and `w` "
                   f"[{g}, {x.shape[1]}, {n}]")
    return _gmm(x, w, group_sizes, int(tile), p, np.dtype(out_dtype), bool(interpret))


def _check_offsets(interpret: bool, rows: int, g: int, p: Plan, what: str) -> None:
    if not interpret and max(rows * max(p.kp, p.np_), g * p.kp * p.np_) >= 2**31:
        raise ValueError(f"gmm: the kernels address arrays with 32-bit offsets; {what} give padded arrays of "
                         f"2**31 elements or more")


# ------------------------------------------------------------------ MoE experts in the padded layout
class Slots(NamedTuple):
    """Where the ``N·k`` (token, expert) assignments of a MoE layer sit in the padded layout
    (every expert's rows padded to whole tiles; ``R`` slots in all). All int32.

    Attributes:
      token: ``[R]`` the token of each slot (``N``: an empty slot, reads zero).
      assign: ``[R]`` the assignment ``t·k + j`` (token ``t``'s ``j``-th expert) of each slot
        (``N·k``: empty).
      of: ``[N, k]`` the slot of each assignment.
      tile_group: ``[R / tile]`` each tile's expert.  toff: ``[E + 1]`` the experts' tile offsets.
    """

    token: Array
    assign: Array
    of: Array
    tile_group: Array
    toff: Array


def slots(expert_idx: Array, num_experts: int, tile: int) -> Slots:
    """The padded layout of ``expert_idx [N, k]``: assignments sorted by expert (stably, so
    token order within an expert), each expert's run padded to whole ``tile``-row tiles."""
    n, k = expert_idx.shape
    m = n * k
    flat = expert_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)               # sorted -> assignment
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    src, tile_group, pos, toff = _tiles(sizes, m, num_experts, tile)
    assign = jnp.take(order, src, mode="fill", fill_value=m)               # empty slots: m
    inverse = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    return Slots(assign // k, assign, pos[inverse].astype(jnp.int32).reshape(n, k), tile_group, toff)


@jax.custom_vjp
def _dispatch(z: Array, token: Array, of: Array) -> Array:
    """``z[token]`` (zero rows for empty slots): every token's row in each of its ``k`` slots.
    The gradient sums each token's ``k`` slots (a gather, no scatter-add)."""
    return _rows(z, token)


def _dispatch_fwd(z, token, of):
    return _rows(z, token), of


def _dispatch_bwd(of, g):
    n, k = of.shape
    dz = jnp.sum(_rows(g, of.reshape(-1)).reshape(n, k, -1).astype(jnp.float32), axis=1)
    return dz.astype(g.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(y_pad: Array, weights: Array, of: Array, assign: Array) -> Array:
    """``out[t] = sum_j weights[t, j] · y_pad[of[t, j]]`` in float32 (``[N, W]``). Gradients by
    gathers: ``d y_pad[s] = weights[assign[s]] · g[token of s]`` (zero in empty slots) and
    ``d weights[t, j] = <g[t], y_pad[of[t, j]]>``."""
    n, k = of.shape
    picked = _rows(y_pad, of.reshape(-1)).reshape(n, k, -1).astype(jnp.float32)
    return jnp.einsum("nkw,nk->nw", picked, weights.astype(jnp.float32))


def _combine_fwd(y_pad, weights, of, assign):
    return _combine(y_pad, weights, of, assign), (y_pad, weights, of, assign)


def _combine_bwd(res, g):
    y_pad, weights, of, assign = res
    n, k = of.shape
    g = g.astype(jnp.float32)
    w_slot = jnp.take(weights.reshape(-1).astype(jnp.float32), assign, mode="fill", fill_value=0)
    dy_pad = (_rows(g, assign // k) * w_slot[:, None]).astype(y_pad.dtype)
    picked = _rows(y_pad, of.reshape(-1)).reshape(n, k, -1).astype(jnp.float32)
    dweights = jnp.einsum("nkw,nw->nk", picked, g).astype(weights.dtype)
    return dy_pad, dweights, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _check_routed(z, expert_idx, weights, w_gate, w_up, w_down) -> None:
    """Shapes, dtypes and (when concrete) expert ids of :func:`routed_experts`' arguments, each refused by
    name: the kernels would pad a short weight with zeros, clamp an expert index or drop an assignment."""
    fn = "routed_experts"
    if jnp.ndim(z) != 2 or not jnp.issubdtype(jnp.result_type(z), jnp.floating):
        raise ValueError(f"{fn}: `z` must be floating [N, W], got {jnp.result_type(z)} {jnp.shape(z)}")
    n, wd = z.shape
    if jnp.ndim(expert_idx) != 2 or expert_idx.shape[0] != n or not jnp.issubdtype(expert_idx.dtype, jnp.integer):
        raise ValueError(f"{fn}: `expert_idx` must be integer [N={n}, k], got {expert_idx.dtype} "
                         f"{jnp.shape(expert_idx)}")
    if jnp.shape(weights) != expert_idx.shape:
        raise ValueError(f"{fn}: `weights` must be [N, k] = {tuple(expert_idx.shape)}, got {jnp.shape(weights)}")
    if jnp.ndim(w_gate) != 3 or w_gate.shape[1] != wd:
        raise ValueError(f"{fn}: `w_gate` must be [E, W={wd}, H], got {jnp.shape(w_gate)}")
    e, _, h = w_gate.shape
    if jnp.shape(w_up) != (e, wd, h):
        raise ValueError(f"{fn}: `w_up` must be [E, W, H] = {(e, wd, h)} as `w_gate`, got {jnp.shape(w_up)}")
    if jnp.shape(w_down) != (e, h, wd):
        raise ValueError(f"{fn}: `w_down` must be [E, H, W] = {(e, h, wd)}, got {jnp.shape(w_down)}")
    if is_concrete(expert_idx) and expert_idx.size:  # traced ids cannot be checked
        ids = np.asarray(expert_idx)
        if ids.min() < 0 or ids.max() >= e:
            raise ValueError(f"{fn}: `expert_idx` must lie in [0, {e}) (E = {e} experts), got ids from "
                             f"{int(ids.min())} to {int(ids.max())}")


def routed_experts(z: Array, expert_idx: Array, weights: Array, w_gate: Array, w_up: Array, w_down: Array,
                   activation: str, *, tile: int = 128, interpret: bool | None = None) -> Array:
    """A MoE layer's routed experts, dropless, by the kernels of this module in the padded layout
    from dispatch to combine.

    ``routed[t] = sum_j weights[t, j] · glu(z[t] W_gate[e], z[t] W_up[e]) W_down[e]`` with
    ``e = expert_idx[t, j]``: the same function as sorting the assignments and running
    :func:`~lineage_jax.layers.grouped.grouped_glu_mlp`, without its row gathers around each
    matmul. Each token's row is gathered once into its ``k`` padded slots (:func:`slots`); the
    three grouped matmuls run slot to slot (hidden width padded by zero weight columns, which
    the gated activation keeps zero); the combine gathers each token's ``k`` outputs. Every
    gradient is a gather (no scatter-add). The matmul outputs are named
    :data:`~lineage_jax.layers.grouped_layout.RESIDUALS` (kept by the ``"dots"`` remat policy).

    Args:
      z: ``[N, W]`` token rows.  expert_idx: ``[N, k]`` int, distinct experts per token.
      weights: ``[N, k]`` combine weights.  w_gate, w_up: ``[E, W, H]``.  w_down: ``[E, H, W]``
        (weights cast to ``z.dtype``).
      activation: ``"swiglu"`` or ``"situ"`` (:func:`~lineage_jax.layers.ffn.glu`).
      tile: rows per tile (a power of two ``>= 16``).  interpret: default on the CPU backend.

    Returns:
      ``[N, W]`` float32.
    """
    if not _pow2_at_least_16(tile):
        raise ValueError(f"routed_experts: `tile` must be a power of two >= 16, got {tile!r}")
    require_bool("routed_experts", "interpret", interpret, allow_none=True,
                 none_means="the default: interpreted on the CPU backend")
    _check_routed(z, expert_idx, weights, w_gate, w_up, w_down)
    n, wd = z.shape
    e, _, h = w_gate.shape
    k = expert_idx.shape[1]
    dt = z.dtype
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if n == 0:
        return jnp.zeros((0, wd), jnp.float32)
    if interpret and (axes := _varying_axes(z, expert_idx, weights, w_gate, w_up, w_down)):
        raise NotImplementedError(
            f"routed_experts: the Pallas interpreter cannot run inside a shard_map with check_vma=True "
            f"(the operands vary over mesh axes {sorted(axes)})")
    size = np.dtype(dt).itemsize
    up, down = plan(wd, h, tile, size), plan(h, wd, tile, size)
    _check_offsets(interpret, _num_tiles(n * k, e, tile) * tile, e, up, f"{n * k} rows of width {wd} over {e} experts")
    s = slots(expert_idx, e, tile)
    x_pad = _dispatch(_pad_to(z, 1, up.kp), s.token, s.of)

    def gm(a, w, p):
        y = _padded_gmm(a, _pad_weight(w.astype(dt), p), s.tile_group, s.toff, tile, p, np.dtype(dt), bool(interpret))
        return checkpoint_name(y, RESIDUALS)

    y_pad = gm(glu(activation, gm(x_pad, w_gate, up), gm(x_pad, w_up, up)), w_down, down)
    return _combine(y_pad, weights, s.of, s.assign)[:, :wd]
