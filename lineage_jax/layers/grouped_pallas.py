"""Pallas grouped matmul (GMM): the ``impl="pallas"`` path of
:func:`~lineage_jax.layers.grouped.grouped_matmul`.

Same semantics as ``jax.lax.ragged_dot`` (``x [M, K]`` in contiguous row groups, group
``g`` times ``w[g] [K, N]``, rows at index ``>= sum(group_sizes)`` give zero), and the
same padded layout as the ``"tiled"`` path (:func:`~lineage_jax.layers.grouped._layout`):
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

Block sizes: ``tile`` rows per tile (a power of two ``>= 16``: Triton's ``dot`` wants
power-of-two operands of at least 16 along each axis); ``block_k`` / ``block_n`` (default
128, also powers of two ``>= 16``) shrink to the next power of two ``>= 16`` of a smaller
``K`` / ``N``. ``K`` and ``N`` that are not multiples of their block are zero-padded in the
wrapper (the padded weight is then a copy of ``w``; with multiples no copy is made) and
the padding is sliced off the results. On a GPU the kernels get ``num_warps=4`` (8 for
``[128, 128]`` accumulators, see :data:`GPU_NUM_WARPS_WIDE`) and as many software-pipeline
stages as fit :data:`GPU_STAGE_BYTES` (see :func:`_stages`).

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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from lineage_jax.layers.grouped import _layout, _out_dtype, _rows

try:  # present in jax 0.10 and 0.11
    from jax.experimental.pallas import triton as pltriton
except Exception:  # pragma: no cover
    pltriton = None

Array = jax.Array

# Launch settings of the GPU (Triton) kernels: 4 warps, or 8 for float32 accumulators of
# GPU_WIDE_ACC elements or more. ptxas for sm_90 (Triton 3.6, bf16, 128-blocks) gives the
# [128, 128] accumulators 255 registers and 76-564 B of spills per thread at 4 warps, none at
# 8; a [64, 128] forward accumulator does not spill at 4.
GPU_NUM_WARPS = 4
GPU_NUM_WARPS_WIDE = 8
GPU_WIDE_ACC = 128 * 128
# Shared-memory budget of the software-pipelined operand buffers: one stage holds one
# iteration's two operand blocks (e.g. [128, 128] + [128, 128] bf16 = 64 KiB), and
# ``num_stages = clamp(GPU_STAGE_BYTES // stage_bytes, 1, GPU_MAX_STAGES)`` (an H200 has
# 227 KiB of shared memory per block): bf16 at 128-blocks gets 2 stages, float32 1.
GPU_STAGE_BYTES = 160 * 2**10
GPU_MAX_STAGES = 3

_DOT_MIN = 16  # smallest operand dimension of a Triton dot


def _pow2_at_least_16(v) -> bool:
    return (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= _DOT_MIN
            and (v & (v - 1)) == 0)


def block_sizes(k: int, n: int, block_k: int = 128, block_n: int = 128) -> tuple[int, int]:
    """``(bk, bn)``, the contraction and output-column blocks the kernels use for a
    ``[.., K] x [G, K, N]`` product: ``block_k`` / ``block_n``, each shrunk to the next power
    of two ``>= 16`` of a smaller ``K`` / ``N`` (so small dims are not padded to a whole
    default block). ``K`` / ``N`` are zero-padded to multiples of them.

    Raises:
      ValueError: ``block_k`` or ``block_n`` not a power of two ``>= 16``.
    """
    for name, v in (("block_k", block_k), ("block_n", block_n)):
        if not _pow2_at_least_16(v):
            raise ValueError(f"gmm: `{name}` must be a power of two >= 16, got {v!r}")
    fit = lambda d, b: min(b, max(_DOT_MIN, 1 << (max(int(d), 1) - 1).bit_length()))
    return fit(k, block_k), fit(n, block_n)


def _stages(stage_bytes: int) -> int:
    """Software-pipeline stages whose operand buffers fit :data:`GPU_STAGE_BYTES`."""
    return int(max(1, min(GPU_MAX_STAGES, GPU_STAGE_BYTES // max(1, stage_bytes))))


def _params(interpret: bool, stage_bytes: int, acc_elems: int):
    """Triton compiler parameters (none in the interpreter)."""
    if interpret or pltriton is None:
        return None
    warps = GPU_NUM_WARPS_WIDE if acc_elems >= GPU_WIDE_ACC else GPU_NUM_WARPS
    return pltriton.CompilerParams(num_warps=warps, num_stages=_stages(stage_bytes))


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


def _tile_matmul(x_pad: Array, w: Array, tile_group: Array, *, tile: int, bc: int, bo: int,
                 transpose: bool, out_dtype, interpret: bool) -> Array:
    """Every row tile of ``x_pad [T*tile, C]`` times its group's weight: ``w [G, C, O]``
    (``transpose``: ``w [G, O, C]`` used as ``w[g]^T``) -> ``[T*tile, O]`` in ``out_dtype``.
    ``C`` and ``O`` are multiples of ``bc`` and ``bo``."""
    rows, c = x_pad.shape
    o = w.shape[1] if transpose else w.shape[2]
    n_tiles = rows // tile
    cdt = jnp.promote_types(x_pad.dtype, w.dtype)
    kernel = functools.partial(_tile_matmul_kernel, tile=tile, bc=bc, n_c=c // bc,
                               transpose=transpose, cdt=cdt)
    stage = (tile * bc + bc * bo) * np.dtype(cdt).itemsize
    return pl.pallas_call(
        kernel,
        grid=(n_tiles, o // bo),
        in_specs=[_whole(tile_group.shape), _whole(x_pad.shape), _whole(w.shape)],
        out_specs=pl.BlockSpec((tile, bo), lambda i, j: (i, j)),
        out_shape=_out_struct((rows, o), out_dtype, x_pad),
        compiler_params=_params(interpret, stage, tile * bo),
        interpret=interpret,
        name="gmm_tiles_t" if transpose else "gmm_tiles",
    )(tile_group, x_pad, w)


def _tile_weight_grad_kernel(toff_ref, x_ref, dy_ref, o_ref, *, tile, cdt):
    """``o = sum over tiles t in [toff[g], toff[g+1]) of x[t][:, k block]^T dy[t][:, n block]``."""
    g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = o_ref.shape
    ks = pl.ds(pl.multiple_of(a * bk, bk), bk)
    ns = pl.ds(pl.multiple_of(b * bn, bn), bn)

    def body(t, acc):
        rows = pl.ds(pl.multiple_of(t * tile, tile), tile)
        xt = x_ref[rows, ks].astype(cdt)                           # [tile, bk]
        dyt = dy_ref[rows, ns].astype(cdt)                         # [tile, bn]
        return acc + lax.dot_general(xt, dyt, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(toff_ref[g], toff_ref[g + 1], body, jnp.zeros((bk, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile_weight_grad(x_pad: Array, dy_pad: Array, toff: Array, g: int, *, tile: int, bk: int, bn: int,
                      out_dtype, interpret: bool) -> Array:
    """``dw [G, K, N]``: per group the sum of its tiles' ``x_tile^T dy_tile`` (``x_pad [R, K]``,
    ``dy_pad [R, N]`` in the padded layout, ``toff [G + 1]`` the groups' tile offsets)."""
    _, k = x_pad.shape
    n = dy_pad.shape[1]
    cdt = jnp.promote_types(x_pad.dtype, dy_pad.dtype)
    kernel = functools.partial(_tile_weight_grad_kernel, tile=tile, cdt=cdt)
    stage = tile * (bk + bn) * np.dtype(cdt).itemsize
    return pl.pallas_call(
        kernel,
        grid=(g, k // bk, n // bn),
        in_specs=[_whole(toff.shape), _whole(x_pad.shape), _whole(dy_pad.shape)],
        out_specs=pl.BlockSpec((None, bk, bn), lambda gi, a, b: (gi, a, b)),
        out_shape=_out_struct((g, k, n), out_dtype, x_pad),
        compiler_params=_params(interpret, stage, bk * bn),
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
    per_group = (group_sizes.astype(jnp.int32) + tile - 1) // tile
    toff = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_group)])
    toff = jnp.minimum(toff, n_tiles).astype(jnp.int32)   # tiles past the layout hold no real row
    return lay.src.reshape(-1), lay.tile_group.reshape(-1), lay.pos, toff


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _gmm(x, w, group_sizes, tile, bk, bn, out_dtype, interpret):
    m, k = x.shape
    g, _, n = w.shape
    src, tile_group, pos, _ = _tiles(group_sizes, m, g, tile)
    x_pad = _pad_to(_rows(x, src), 1, bk)
    w_pad = _pad_to(_pad_to(w, 1, bk), 2, bn)
    y_pad = _tile_matmul(x_pad, w_pad, tile_group, tile=tile, bc=bk, bo=bn, transpose=False,
                         out_dtype=out_dtype, interpret=interpret)
    return _rows(y_pad, pos)[:, :n]


def _gmm_fwd(x, w, group_sizes, tile, bk, bn, out_dtype, interpret):
    return _gmm(x, w, group_sizes, tile, bk, bn, out_dtype, interpret), (x, w, group_sizes)


def _gmm_bwd(tile, bk, bn, out_dtype, interpret, res, dy):
    """``dx = dy W[g]^T`` by the tile kernel with ``transpose``; ``dw`` by the per-group
    weight-gradient kernel (float32 sums, cast to ``w.dtype``)."""
    x, w, group_sizes = res
    m, k = x.shape
    g, _, n = w.shape
    src, tile_group, pos, toff = _tiles(group_sizes, m, g, tile)
    x_pad = _pad_to(_rows(x, src), 1, bk)
    dy_pad = _pad_to(_rows(dy, src), 1, bn)
    w_pad = _pad_to(_pad_to(w, 1, bk), 2, bn)
    dx_pad = _tile_matmul(dy_pad, w_pad, tile_group, tile=tile, bc=bn, bo=bk, transpose=True,
                          out_dtype=x.dtype, interpret=interpret)
    dx = _rows(dx_pad, pos)[:, :k]
    dw = _tile_weight_grad(x_pad, dy_pad, toff, g, tile=tile, bk=bk, bn=bn, out_dtype=w.dtype,
                           interpret=interpret)
    return dx, dw[:, :k, :n], None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(x: Array, w: Array, group_sizes: Array, *, tile: int = 128, block_k: int = 128,
        block_n: int = 128, out_dtype=None, interpret: bool | None = None) -> Array:
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
      block_k: contraction block (power of two ``>= 16``; see :func:`block_sizes`).
      block_n: output-column block (power of two ``>= 16``; see :func:`block_sizes`).
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
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    bk, bn = block_sizes(x.shape[1], w.shape[2], block_k, block_n)
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
    rows = _num_tiles(m, g, tile) * tile
    kp, np_ = -(-x.shape[1] // bk) * bk, -(-n // bn) * bn
    if not interpret and max(rows * max(kp, np_), g * kp * np_) >= 2**31:
        raise ValueError(f"gmm: the kernels address arrays with 32-bit offsets; `x` [{m}, {x.shape[1]}] and "
                         f"`w` [{g}, {x.shape[1]}, {n}] give padded arrays of 2**31 elements or more")
    return _gmm(x, w, group_sizes, int(tile), bk, bn, np.dtype(out_dtype), bool(interpret))
