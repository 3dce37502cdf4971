"""Grouped (per-expert) matmuls for the MoE experts, without XLA's dense expansion.

:func:`grouped_matmul` has the semantics of ``jax.lax.ragged_dot``: ``x [M, K]`` holds
contiguous row groups, group ``g`` multiplied by ``w[g] [K, N]``; rows at index
``>= sum(group_sizes)`` give zero. Implementations (``impl``):

* ``"ragged_dot"``: ``jax.lax.ragged_dot``. TPU lowers it to a native grouped matmul
  (Mosaic), the right choice there. XLA:GPU and XLA:CPU expand it into a *dense* dot over
  every group, with a ``[G, M, N]`` intermediate: the grad of one
  ``[131072, 1024] x [64, 1024, 1024]`` bf16 ragged_dot compiles on the CPU to 120 GB of
  temporaries; it was one of two causes (the XLA chunked KDA form the other) of an MoE
  training step on one H200 (64 experts, 32K tokens, top-4) asking for a 197 GiB buffer.
* ``"tiled"``: a pure-JAX block-sparse grouped matmul. Every group is padded to a
  multiple of ``tile`` rows, each row tile gets its group's id, and the tiles are
  multiplied by their own group's weight a static block of tiles at a time under
  ``lax.scan`` (at most ``block x K x N`` gathered weights live, see
  :data:`TILED_BLOCK_BYTES`); rows are gathered into and out of the padded layout.
  Memory is ``O(M·K + M·N + block·K·N + G·K·N)``, never ``O(G·M·N)`` (the grad of the
  shape above: 1.6 GB of temporaries on the CPU). Its reverse-mode rule is a
  ``jax.custom_vjp``: ``dx`` by the same tiles against ``w^T``, ``dw`` as per-tile
  ``x_tile^T dy_tile`` partials scatter-added into a float32 ``[G, K, N]`` accumulator
  (so no per-step ``[G, K, N]`` cotangent buffers, and float32 sums). Forward-mode
  (``jax.jvp``) is therefore not supported on this path.
* ``"pallas"``: the same padded tile layout, multiplied by Pallas kernels
  (:mod:`lineage_jax.layers.grouped_pallas`; the Triton lowering on GPUs, the Pallas
  interpreter on the CPU): one kernel computes every ``[tile, N-block]`` output block
  against its tile's own expert weight (the group id read inside the kernel, the weight
  indexed dynamically), looping over ``K`` blocks with float32 accumulation, so no
  gathered weights are materialized. Its ``jax.custom_vjp`` gets ``dx`` from the same
  kernel contracting against ``w[g]^T`` and ``dw[g]`` from a kernel that sums
  ``x_tile^T dy_tile`` over group ``g``'s tiles (float32; empty groups give zero).
  ``tile`` must be a power of two ``>= 16`` here; ``K`` and ``N`` need not be multiples
  of the kernel blocks (they are zero-padded). Reverse mode only, like ``"tiled"``.
* ``"auto"``: ``"ragged_dot"`` on TPU, or when the dense expansion is small (see
  :data:`DENSE_EXPANSION_LIMIT_BYTES`); otherwise ``"pallas"`` on GPUs (on one H200, a
  ``[131072, 2048] x [64, 2048, 624]`` bf16 forward + backward: 4.0 ms against 12.1 for
  ``"tiled"``, 100 for ``"ragged_dot"`` and 4.7 for one dense matmul of the same FLOPs;
  ``experiments/gmm_bench.py``, docs/benchmarks.md) and ``"tiled"`` on the CPU.

:func:`grouped_glu_mlp` is the routed experts' gated MLP on top of it, shared by
``MoE._experts_ragged`` and the expert-parallel ``_local_experts``.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lineage_jax.layers.ffn import glu
from lineage_jax.layers.grouped_layout import RESIDUALS, _Layout, _layout, _out_dtype, _rows
from lineage_jax.layers.grouped_pallas import gmm
from lineage_jax.memory._validate import is_concrete
from lineage_jax.numerics import at_precision, precision_in_force

Array = jax.Array

GROUPED_MATMUL_IMPLS = ("auto", "ragged_dot", "tiled", "pallas")

# "auto" keeps jax.lax.ragged_dot while its dense [G, M, N] expansion on GPU/CPU stays at
# most this many bytes: small models then run exactly as before (one fused dot, no scan),
# and only shapes whose expansion would dominate memory (one cause of the 197 GiB H200 failure) switch
# to the tiled path.
DENSE_EXPANSION_LIMIT_BYTES = 256 * 2**20

# Upper bound on the bytes of one scan step's per-tile weight-sized buffers in the tiled path
# (block_tiles x K x N at 4 bytes: the gathered expert weights forward, the float32
# weight-gradient partials backward): each step is then a sizeable batched matmul (2048 rows
# at K = N = 1024) while the live weight copies stay small next to the model.
TILED_BLOCK_BYTES = 64 * 2**20


def _check(x, w, group_sizes, impl, tile) -> None:
    if impl not in GROUPED_MATMUL_IMPLS:
        raise ValueError(f"grouped_matmul: `impl` must be one of {GROUPED_MATMUL_IMPLS}, got {impl!r}")
    if isinstance(tile, bool) or not isinstance(tile, numbers.Integral) or tile <= 0:
        raise ValueError(f"grouped_matmul: `tile` must be a positive int, got {tile!r}")
    if impl == "pallas" and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"grouped_matmul: `tile` must be a power of two >= 16 for impl='pallas', got {tile!r}")
    if jnp.ndim(x) != 2:
        raise ValueError(f"grouped_matmul: `x` must be 2-D [M, K], got shape {jnp.shape(x)}")
    if jnp.ndim(w) != 3:
        raise ValueError(f"grouped_matmul: `w` must be 3-D [G, K, N], got shape {jnp.shape(w)}")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"grouped_matmul: `{name}` must be floating, got {a.dtype} (the kernels accumulate in "
                             f"float32)")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: contraction mismatch, `x` is [M, K={x.shape[1]}] but "
                         f"`w` is [G, K={w.shape[1]}, N]")
    if jnp.shape(group_sizes) != (w.shape[0],):
        raise ValueError(f"grouped_matmul: `group_sizes` must be [G={w.shape[0]}] (one size per group of `w`), "
                         f"got shape {jnp.shape(group_sizes)}")
    if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
        raise ValueError(f"grouped_matmul: `group_sizes` must be integer, got {jnp.result_type(group_sizes)}")
    if is_concrete(group_sizes) and bool(np.any(np.asarray(group_sizes) < 0)):  # traced values cannot be checked
        raise ValueError(f"grouped_matmul: `group_sizes` must be >= 0, got {group_sizes.tolist()}")


def resolve_impl(impl: str, m: int, n: int, g: int, out_dtype) -> str:
    """The implementation ``impl`` means for an ``[M, K] x [G, K, N]`` grouped matmul."""
    if impl == "pallas" and jax.default_backend() == "tpu":  # Triton kernels; Mosaic refused them unnamed
        raise ValueError("grouped_matmul: `impl`='pallas' runs Triton kernels (GPUs; interpret mode on a CPU); on a "
                         "TPU use 'auto' or 'ragged_dot' (MoE: `moe_matmul_impl`)")
    if impl != "auto":
        return impl
    if jax.default_backend() == "tpu":
        return "ragged_dot"
    dense_bytes = g * m * n * np.dtype(out_dtype).itemsize
    if dense_bytes <= DENSE_EXPANSION_LIMIT_BYTES:
        return "ragged_dot"
    return "pallas" if jax.default_backend() == "gpu" else "tiled"


def _tiled_sizes(m: int, k: int, n: int, g: int, tile: int) -> tuple[int, int]:
    """``(block, n_blocks)``: tiles per scan step and steps; ``block * n_blocks * tile``
    padded rows hold every group padded to whole tiles (``<= M + G·(tile-1)`` rows)."""
    n_tiles = -(-(m + g * (tile - 1)) // tile)
    most = max(1, TILED_BLOCK_BYTES // max(1, k * n * 4))
    n_blocks = -(-n_tiles // most)
    return -(-n_tiles // n_blocks), n_blocks                   # balanced: little padding to whole blocks


def _tiled_apply(x, w, lay: _Layout, tile: int, out_dtype, transpose: bool) -> Array:
    """Forward tiles: ``[M, K] x [G, K, N] -> [M, N]`` (``transpose``: ``w`` used as ``[G, N, K]``)."""
    cdt = jnp.promote_types(x.dtype, w.dtype)
    block = lay.tile_group.shape[1]
    spec = "btn,bkn->btk" if transpose else "btk,bkn->btn"

    def step(_, inputs):
        src, ids = inputs                                      # [block*tile], [block]
        xb = _rows(x, src).astype(cdt).reshape(block, tile, x.shape[1])
        wb = jnp.take(w, ids, axis=0).astype(cdt)                # the block's expert weights
        yb = jnp.einsum(spec, xb, wb, preferred_element_type=jnp.float32)
        return None, yb.astype(out_dtype).reshape(block * tile, -1)

    _, yp = lax.scan(step, None, (lay.src, lay.tile_group))
    return _rows(yp.reshape(-1, yp.shape[-1]), lay.pos)


def _common_variance(*arrays: Array) -> tuple[Array, ...]:
    """``arrays``, each made to vary over every ``shard_map`` mesh axis any of them varies over.

    A custom VJP's cotangents must have their primal's type, variance included, while the
    tiled backward mixes all operands (e.g. ``dx`` from ``dy`` and a ``w`` split over
    ``tensor``). Adding a zero computed from all operands (sums of empty slices) widens
    every operand to the common variance with public ops; autodiff of that ``+ 0`` then
    ``psum``-s each cotangent over the axes its operand did not vary over. Outside
    ``shard_map`` (and after XLA folds the ``+ 0``) this is a no-op.
    """
    zero = sum(jnp.sum(a.reshape(-1)[:0]).astype(jnp.float32) for a in arrays)
    return tuple(a + zero.astype(a.dtype) for a in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tiled(x: Array, w: Array, group_sizes: Array, tile: int, out_dtype, prec) -> Array:
    m, k = x.shape
    g, _, n = w.shape
    lay = _layout(group_sizes, m, g, tile, *_tiled_sizes(m, k, n, g, tile))
    return _tiled_apply(x, w, lay, tile, out_dtype, transpose=False)


def _tiled_fwd(x, w, group_sizes, tile, out_dtype, prec):
    return _tiled(x, w, group_sizes, tile, out_dtype, prec), (x, w, group_sizes)


def _tiled_bwd(tile, out_dtype, prec, res, dy):
    """``dx = dy W[g]^T`` by the same tiles; ``dw[g] = sum over g's tiles of x_tile^T dy_tile``,
    scatter-added into a float32 ``[G, K, N]`` accumulator carried through the scan; at the
    forward's matmul precision ``prec``."""
    with at_precision(prec):
        return _tiled_bwd_at(tile, res, dy)


def _tiled_bwd_at(tile, res, dy):
    x, w, group_sizes = res
    m, k = x.shape
    g, _, n = w.shape
    lay = _layout(group_sizes, m, g, tile, *_tiled_sizes(m, k, n, g, tile))
    dx = _tiled_apply(dy, w, lay, tile, x.dtype, transpose=True)

    cdt = jnp.promote_types(x.dtype, w.dtype)
    block = lay.tile_group.shape[1]

    def step(acc, inputs):
        src, ids = inputs
        xb = _rows(x, src).astype(cdt).reshape(block, tile, k)
        dyb = _rows(dy, src).astype(cdt).reshape(block, tile, n)
        part = jnp.einsum("btk,btn->bkn", xb, dyb, preferred_element_type=jnp.float32)
        return acc.at[ids].add(part), None

    acc = jnp.zeros_like(w, jnp.float32)            # (zeros_like: w's shard_map variance)
    dw, _ = lax.scan(step, acc, (lay.src, lay.tile_group))
    return dx, dw.astype(w.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_matmul(x: Array, w: Array, group_sizes: Array, *, impl: str = "auto", tile: int = 128) -> Array:
    """``jax.lax.ragged_dot(x, w, group_sizes)`` through the implementation ``impl``.

    Args:
      x: ``[M, K]`` rows, in contiguous groups (group 0 first).
      w: ``[G, K, N]`` one matrix per group.
      group_sizes: ``[G]`` integer rows per group; rows at index ``>= sum(group_sizes)``
        give zero.
      impl: ``"auto"``, ``"ragged_dot"``, ``"tiled"`` or ``"pallas"`` (module docstring).
      tile: rows per tile of the ``"tiled"`` and ``"pallas"`` paths (groups are padded to
        multiples of it; ``"pallas"``: a power of two ``>= 16``).

    Returns:
      ``[M, N]`` in ``ragged_dot``'s output dtype for these inputs (float32 accumulation).

    Raises:
      ValueError: unknown ``impl``, ``tile`` not a positive int (``"pallas"``: not a power
        of two ``>= 16``), or mismatched shapes.
    """
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    _check(x, w, group_sizes, impl, tile)
    out_dtype = _out_dtype(x, w, group_sizes)
    impl = resolve_impl(impl, x.shape[0], w.shape[2], w.shape[0], out_dtype)
    if impl == "ragged_dot":
        return lax.ragged_dot(x, w, group_sizes)
    if x.shape[0] == 0 or w.shape[0] == 0 or w.shape[2] == 0:    # no rows, groups or columns: all zero
        return jnp.zeros((x.shape[0], w.shape[2]), out_dtype)
    if impl == "pallas":
        return gmm(*_common_variance(x, w, group_sizes), tile=int(tile), out_dtype=out_dtype)
    return _tiled(*_common_variance(x, w, group_sizes), int(tile), out_dtype, precision_in_force())


def grouped_glu_mlp(xs: Array, w_gate: Array, w_up: Array, w_down: Array, group_sizes: Array,
                    activation: str, *, impl: str = "auto") -> Array:
    """The experts' gated MLP on rows sorted by expert:
    ``glu(activation, xs W_gate[g], xs W_up[g]) W_down[g]`` for each row's group ``g``.

    ``xs [M, W]``, ``w_gate / w_up [G, W, H]``, ``w_down [G, H, W]`` (cast to ``xs.dtype``),
    ``group_sizes [G]`` -> ``[M, W]``; rows past ``sum(group_sizes)`` give zero.
    """
    dt = xs.dtype
    # Named (RESIDUALS) so that a remat policy can keep them: the "dots" policy saves weight
    # matmuls, and a grouped matmul is a kernel call, not a dot.
    gm = lambda a, b: checkpoint_name(grouped_matmul(a, b.astype(dt), group_sizes, impl=impl), RESIDUALS)
    return gm(glu(activation, gm(xs, w_gate), gm(xs, w_up)), w_down)
