"""Expert-parallel MoE: experts sharded over the ``expert`` mesh axis, tokens moved by all-to-all.

Routing, the latent projections and the shared experts of :class:`~lineage_jax.layers.moe.MoE`
stay as they are (plain GSPMD under ``jax.jit``); only the routed experts — dispatch,
grouped matmuls, combine — run inside ``shard_map``, reading the ``MoE`` module's own
``w_gate / w_up / w_down``. Per device, with ``n`` local tokens, ``k`` choices,
``ep`` = size of the expert axis and ``E_loc = E / ep`` local experts:

1. the ``n·k`` (token, expert) assignments are taken **choice-major** (every token's
   first choice, in token order, before any second choice) and each gets its
   destination shard ``e // E_loc`` and its rank among the assignments going there;
2. **dispatch**: each destination receives at most ``C`` rows from each source, into a
   receive buffer ``[ep·C, W]`` (block ``s`` from source ``s``) plus each row's local
   expert id. Assignments ranked ``>= C`` are dropped and counted;
3. the receiver sorts its rows by local expert and runs the gated expert MLP with grouped
   matmuls, :func:`~lineage_jax.layers.grouped.grouped_glu_mlp` (the same code as the
   single-device ``MoE``, with its ``matmul_impl``): ``jax.lax.ragged_dot`` on TPU (native
   grouped matmul); on GPU/CPU, where XLA expands ``ragged_dot`` into a dense
   ``[E_loc, ep·C, H]`` dot (one of two causes of a 197 GiB buffer on one H200 for 64 experts,
   32K tokens, top-4; 120 GB in the CPU memory analysis of one ``[131072, 1024] x [64, 1024, 1024]``
   grad), ``"auto"`` switches once that expansion exceeds 256 MiB: to the Pallas grouped-matmul
   kernels on GPUs, the pure-JAX tiled grouped matmul on CPUs (``layers.grouped``). The ``expert_mlp`` hidden dimension may be split over ``tensor``:
   partial sums are ``psum``-ed after the combine;
4. **combine**: the outputs travel back the same way and are weighted and summed per token.

``C`` (per source → destination pair):

* dropless (default, the ``MoE``'s ``dispatch="ragged"``): ``C = n · min(k, E_loc)``, the
  most one source can ever send one destination, so nothing is dropped and the result
  equals the single-device ragged MoE up to float rounding. The receive buffer is then
  ``ep·n·min(k, E_loc)`` rows: fine for tests and small meshes, too large at scale;
* ``capacity_factor=f`` (or the ``MoE``'s ``dispatch="capacity"``):
  ``C = ceil(f · n · k / ep)``, so a device receives at most ``f·n·k`` rows. Drops are
  per (source, destination shard), unlike the single-device capacity dispatch (per
  expert over all tokens), so the two agree only when nothing is dropped.

Three exchange implementations (``impl``), identical in result:

* ``"ragged"``: ``jax.lax.ragged_all_to_all`` — sends only the rows that exist. XLA:CPU
  (jax 0.10.2) does not implement it ("HLO opcode ragged-all-to-all is not supported
  by XLA:CPU"); GPU and TPU do;
* ``"dense"``: ``jax.lax.all_to_all`` of the padded ``[ep·C, W]`` buffers (the
  capacity-bounded dense all-to-all; runs everywhere, sends ``ep·C`` rows);
* ``"ragged_reference"``: the ``"ragged"`` bookkeeping with ``ragged_all_to_all``
  emulated by a dense all-to-all — so the ragged offsets are tested on the CPU;
* ``"auto"``: ``"ragged"`` on TPU, ``"dense"`` elsewhere.

**``"ragged"`` on GPUs computes wrong gradients** across devices (measured 2026-11-29, 2 H200s
in one process, jax 0.11.2, CUDA 13): forward outputs equal the dense exchange's (rel 4e-8) but
the gradient with respect to the tokens is unrelated to it (rel 0.80 for the exchange alone,
1.03 through an ``MoE``; ``tests/parallel/test_accelerator.py``), identically with the
ragged-all-to-all decomposer on; with XLA's one-shot kernel off XLA refuses to run it unless
the NCCL send/recv fallback is allowed, and with it allowed the exchange test failed too
(values not recorded: ``docs/parallelism.md``). The same program with ``"ragged_reference"`` (identical offsets through a
dense ``all_to_all``) is right on the CPU, so the offsets are not the cause; not diagnosed
further. A full-size ``ragged`` training run on 2 H200s also hung (a collective rendezvous
timed out) where ``"dense"`` ran. Hence ``"auto"`` is ``"dense"`` on GPUs, and an explicit
``impl="ragged"`` with a GPU expert axis > 1 warns.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from lineage_jax.layers.grouped import grouped_glu_mlp
from lineage_jax.layers.moe import MoE, RouterStats
from lineage_jax.parallel.mesh import mesh_shape
from lineage_jax.parallel.rules import DEFAULT_RULES, Rules, logical_to_spec, mesh_axes_of

Array = jax.Array
IMPLS = ("auto", "ragged", "dense", "ragged_reference")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How MoE layers run expert-parallel on ``mesh``.

    Attributes:
      mesh: the device mesh; the expert axis is the mesh axis ``rules`` maps ``experts`` to.
      rules: logical-axis rules (tokens are split like ``batch``; routed-expert hidden like
        ``expert_mlp``).
      impl: ``"auto" | "ragged" | "dense" | "ragged_reference"`` (module docstring).
      capacity_factor: ``None``: follow each ``MoE`` (``dispatch="ragged"`` → dropless,
        ``"capacity"`` → its ``capacity_factor``); a float forces that capacity everywhere.
    """

    mesh: Mesh
    rules: Rules = DEFAULT_RULES
    impl: str = "auto"
    capacity_factor: Optional[float] = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"ExpertParallel: `impl` must be one of {IMPLS}, got {self.impl!r}")
        check_capacity_factor("ExpertParallel", self.capacity_factor)
        axes = mesh_axes_of("experts", self.rules)
        if len(axes) != 1:
            raise ValueError(f"ExpertParallel: `rules` must map 'experts' to exactly one mesh axis, got {axes}")
        if (self.impl == "ragged" and self.expert_size > 1
                and self.mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")):
            warnings.warn("ExpertParallel(impl='ragged') on GPUs: jax.lax.ragged_all_to_all gave wrong gradients "
                          "across 2 H200s (jax 0.11.2; forward correct) — see lineage_jax.parallel.expert; "
                          "impl='dense' (the GPU default) is exact", RuntimeWarning, stacklevel=3)

    @property
    def expert_axis(self) -> str:
        return mesh_axes_of("experts", self.rules)[0]

    @property
    def expert_size(self) -> int:
        return mesh_shape(self.mesh).get(self.expert_axis, 1)

    def resolved_impl(self) -> str:
        if self.impl != "auto":
            return self.impl
        return "ragged" if self.mesh.devices.flat[0].platform == "tpu" else "dense"


def check_capacity_factor(fn: str, capacity_factor) -> None:
    """``capacity_factor`` is None (dropless) or a positive finite real number."""
    if capacity_factor is None:
        return
    if not (isinstance(capacity_factor, numbers.Real) and not isinstance(capacity_factor, bool)
            and 0 < capacity_factor < math.inf):
        raise ValueError(f"{fn}: `capacity_factor` must be a positive finite number or None, got {capacity_factor!r}")


def check_num_experts(num_experts: int, mesh: Mesh, rules: Optional[Rules] = None) -> None:
    """``ValueError`` unless ``num_experts`` is divisible by the expert mesh axis."""
    rules = DEFAULT_RULES if rules is None else rules
    axes = mesh_axes_of("experts", rules)
    size = math.prod(mesh_shape(mesh).get(a, 1) for a in axes)
    if num_experts % size:
        raise ValueError(f"expert parallelism: `num_experts`={num_experts} is not divisible by the expert mesh "
                         f"axis {axes} of size {size}; choose an expert axis size that divides {num_experts}")


# ----------------------------------------------------------------------------- the exchange
def _ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                 *, axis_name: str, axis_size: int):
    """``lax.ragged_all_to_all`` (one slice per peer) built from a dense ``all_to_all``."""
    rows = operand.shape[0]
    r = jnp.arange(rows)
    src = jnp.clip(input_offsets[:, None] + r[None, :], 0, rows - 1)                   # [ep, rows]
    valid = r[None, :] < send_sizes[:, None]
    blocks = jnp.where(valid.reshape(valid.shape + (1,) * (operand.ndim - 1)), operand[src], 0)
    recv = lax.all_to_all(blocks.astype(operand.dtype), axis_name, 0, 0, tiled=True)   # [ep, rows, ...]
    where = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)               # my slot at each source
    tgt = jnp.where(r[None, :] < recv_sizes[:, None], where[:, None] + r[None, :], output.shape[0])
    return output.at[tgt.reshape(-1)].set(recv.reshape((axis_size * rows,) + operand.shape[1:]), mode="drop")


def _local_experts(x: Array, local_expert: Array, w_gate: Array, w_up: Array, w_down: Array,
                   activation: str, matmul_impl: str = "auto") -> Array:
    """Rows ``x [R, W]`` with local expert ids ``[R]`` (``-1``: empty slot) -> ``[R, W]`` outputs
    (``matmul_impl``: :func:`~lineage_jax.layers.grouped.grouped_matmul`'s ``impl``)."""
    e_loc = w_gate.shape[0]
    valid = local_expert >= 0
    key = jnp.where(valid, local_expert, e_loc)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=e_loc + 1)[:e_loc].astype(jnp.int32)
    out = grouped_glu_mlp(x[order], w_gate, w_up, w_down, group_sizes, activation, impl=matmul_impl)
    out = jnp.where(valid[order][:, None], out, jnp.zeros((), out.dtype))
    return jnp.zeros_like(out).at[order].set(out)


def exchange_capacity(n: int, k: int, e_loc: int, ep: int, capacity_factor: Optional[float]) -> int:
    """Rows one source sends one expert shard at most (the receive buffer is ``ep`` of them): dropless
    ``n · min(k, e_loc)``; with a ``capacity_factor`` ``ceil(f · n · k / ep)``, at least 1, at most that."""
    most = n * min(k, e_loc)
    return most if capacity_factor is None else max(1, min(most, math.ceil(capacity_factor * n * k / ep)))


def ep_exchange(z, expert_idx, weights, local_fn, *, e_loc: int, ep_axis: str, ep: int, token_axes: tuple,
                capacity_factor: Optional[float], impl: str):
    """One device's dispatch -> ``local_fn`` -> combine (inside ``shard_map`` over the expert axis).

    ``z [n, W]`` this device's tokens, ``expert_idx / weights [n, k]`` their routing; each
    assignment is sent to the device holding its expert (``e_loc`` experts per device),
    ``local_fn(rows [R, W], local_expert [R]) -> [R, W]`` runs there (``-1``: an empty slot,
    whose output must be 0), and the outputs come back and are mixed by ``weights``. ``impl``:
    "dense" (``all_to_all`` of capacity-padded buffers), "ragged" (``lax.ragged_all_to_all``)
    or "ragged_reference" (the same offsets through a dense ``all_to_all``). Returns
    ``(routed [n, W] float32, tokens dropped over the token axes)``. The experts use it with
    the expert MLP as ``local_fn``; ``experiments.ep_scaling`` times it with a mask.
    """
    n, k = expert_idx.shape
    width = z.shape[-1]
    cap = exchange_capacity(n, k, e_loc, ep, capacity_factor)

    expert = expert_idx.T.reshape(-1)                          # [k*n] choice-major: a = c*n + t
    token = jnp.tile(jnp.arange(n), k)
    dest = expert // e_loc
    local_expert = (expert - dest * e_loc).astype(jnp.int32)
    onehot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)         # [k*n, ep]
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    counts = jnp.sum(onehot, axis=0)                           # [ep] assignments per destination
    kept = rank < cap
    dropped = jnp.sum(counts - jnp.minimum(counts, cap)).astype(jnp.int32)
    x_assign = z[token]                                        # [k*n, W]

    if impl == "dense":
        slot = jnp.where(kept, dest * cap + rank, ep * cap)    # out of range: dropped
        send_x = jnp.zeros((ep * cap, width), z.dtype).at[slot].set(x_assign, mode="drop")
        send_e = jnp.full((ep * cap,), -1, jnp.int32).at[slot].set(local_expert, mode="drop")
        recv_x = lax.all_to_all(send_x, ep_axis, 0, 0, tiled=True)
        recv_e = lax.all_to_all(send_e, ep_axis, 0, 0, tiled=True)
        out = local_fn(recv_x, recv_e)
        back = lax.all_to_all(out, ep_axis, 0, 0, tiled=True)  # [ep*cap, W], my send layout
        y_assign = back.at[slot].get(mode="fill", fill_value=0)
    else:
        if impl == "ragged":
            a2a = lax.ragged_all_to_all
        else:
            a2a = lambda *a, axis_name: _ragged_all_to_all_reference(*a, axis_name=axis_name, axis_size=ep)
        me = lax.axis_index(ep_axis)
        offsets = (jnp.cumsum(counts) - counts).astype(jnp.int32)   # block starts of the sorted send buffer
        sorted_idx = offsets[dest] + rank                            # a permutation of [0, k*n)
        send_x = jnp.zeros_like(x_assign).at[sorted_idx].set(x_assign)
        send_e = jnp.zeros((k * n,), jnp.int32).at[sorted_idx].set(local_expert)
        send_sizes = jnp.minimum(counts, cap).astype(jnp.int32)
        recv_sizes = lax.all_to_all(send_sizes, ep_axis, 0, 0, tiled=True)
        slot_at_dest = jnp.full((ep,), me * cap, jnp.int32)          # source s writes block s of the buffer
        recv_x = a2a(send_x, jnp.zeros((ep * cap, width), z.dtype), offsets, send_sizes, slot_at_dest,
                     recv_sizes, axis_name=ep_axis)
        recv_e = a2a(send_e, jnp.full((ep * cap,), -1, jnp.int32), offsets, send_sizes, slot_at_dest,
                     recv_sizes, axis_name=ep_axis)
        out = local_fn(recv_x, recv_e)
        block_starts = (jnp.arange(ep) * cap).astype(jnp.int32)
        source_offsets = lax.all_to_all(offsets, ep_axis, 0, 0, tiled=True)  # where my rows sat at each source
        back = a2a(out, jnp.zeros((k * n, width), out.dtype), block_starts, recv_sizes, source_offsets,
                   send_sizes, axis_name=ep_axis)                            # [k*n, W], sorted send layout
        y_assign = jnp.where(kept[:, None], back[sorted_idx], jnp.zeros((), back.dtype))

    routed = jnp.einsum("knw,kn->nw", y_assign.reshape(k, n, width).astype(jnp.float32), weights.T)
    return routed, lax.psum(dropped, token_axes)


def _ep_shard(z, expert_idx, weights, w_gate, w_up, w_down, *, hidden_axes: tuple, activation: str,
              matmul_impl: str = "auto", **exchange):
    """One device's part of the expert-parallel experts: :func:`ep_exchange` with the local experts'
    MLP (their hidden width split over ``hidden_axes``: partial outputs summed)."""
    local = functools.partial(_local_experts, w_gate=w_gate, w_up=w_up, w_down=w_down, activation=activation,
                              matmul_impl=matmul_impl)
    routed, dropped = ep_exchange(z, expert_idx, weights, local, e_loc=w_gate.shape[0], **exchange)
    if hidden_axes:
        routed = lax.psum(routed, hidden_axes)
    return routed, dropped


def expert_parallel_experts(moe: MoE, z: Array, expert_idx: Array, weights: Array, ep: ExpertParallel,
                            capacity_factor: Optional[float] = None) -> tuple[Array, Array]:
    """The routed experts of ``moe``, expert-parallel: ``z [N, W]``, ``expert_idx / weights [N, k]``
    -> ``(routed [N, W] float32, tokens_dropped int32)`` (same contract as ``MoE._experts_ragged``).

    ``capacity_factor=None`` is dropless. Raises ``ValueError`` if the experts do not divide
    over the expert axis, or the ``N`` tokens do not divide over the token axes.
    """
    mesh = ep.mesh
    sizes = mesh_shape(mesh)
    ep_axis, ep_size = ep.expert_axis, ep.expert_size
    check_capacity_factor("expert_parallel_experts", capacity_factor)
    check_num_experts(moe.num_experts, mesh, ep.rules)
    n_tokens = z.shape[0]
    token_spec = logical_to_spec(("batch",), mesh, ep.rules, shape=(n_tokens,))
    split = () if not token_spec else token_spec[0]
    split = (split,) if isinstance(split, str) else tuple(split)
    # Size-1 axes stay in the shard_map specs: the collectives over them still "vary" over them.
    token_axes = tuple(a for a in mesh_axes_of("batch", ep.rules) if a in split or sizes.get(a, 1) == 1)
    if ep_size > 1 and ep_axis not in token_axes:
        raise ValueError(f"expert parallelism: the {n_tokens} tokens of this MoE call must be split over the expert "
                         f"axis {ep_axis!r} (size {ep_size}) through the 'batch' rule; got token axes {token_axes} "
                         f"(the token count must be divisible by the batch mesh axes)")
    hidden = moe.w_gate.shape[-1]
    hidden_axes = tuple(a for a in mesh_axes_of("expert_mlp", ep.rules)
                        if a != ep_axis and a not in token_axes and sizes.get(a, 1) > 1)
    if hidden_axes and hidden % math.prod(sizes[a] for a in hidden_axes):
        hidden_axes = ()
    tok = P(token_axes if token_axes else None, None)
    h_spec = hidden_axes if hidden_axes else None
    fn = jax.shard_map(
        lambda *args: _ep_shard(*args, ep_axis=ep_axis, ep=ep_size, hidden_axes=hidden_axes, token_axes=token_axes,
                                capacity_factor=capacity_factor, impl=ep.resolved_impl(), activation=moe.activation,
                                matmul_impl=moe.matmul_impl),
        mesh=mesh,
        in_specs=(tok, tok, tok, P(ep_axis, None, h_spec), P(ep_axis, None, h_spec), P(ep_axis, h_spec, None)),
        out_specs=(tok, P()),
    )
    return fn(z, expert_idx, weights.astype(jnp.float32), moe.w_gate[...], moe.w_up[...], moe.w_down[...])


class ExpertParallelMoE(MoE):
    """A :class:`MoE` whose routed experts run expert-parallel; nothing else differs (same
    parameters, paths and statistics). Made by :func:`enable_expert_parallel`, never built."""

    def _experts_ragged(self, z, expert_idx, weights):
        ep = self.expert_parallel
        return expert_parallel_experts(self, z, expert_idx, weights, ep, capacity_factor=ep.capacity_factor)

    def _experts_capacity(self, z, expert_idx, weights):
        ep = self.expert_parallel
        cf = self.capacity_factor if ep.capacity_factor is None else ep.capacity_factor
        return expert_parallel_experts(self, z, expert_idx, weights, ep, capacity_factor=cf)


def enable_expert_parallel(model: nnx.Module, ep: ExpertParallel) -> nnx.Module:
    """Switch every ``MoE`` inside ``model`` to the expert-parallel dispatch, in place.

    Meant for a model merged inside a jitted function (as ``lineage_jax.train.step`` does), so
    the caller's model is untouched. The switch only changes the class of each ``MoE``
    node (to :class:`ExpertParallelMoE`) and adds the static ``expert_parallel``
    attribute, so ``nnx.split`` / ``merge`` (e.g. inside the Decoder's layer scan) keep it.
    Raises ``ValueError`` if some layer's experts do not divide over the expert axis.
    """
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            check_num_experts(node.num_experts, ep.mesh, ep.rules)
            if type(node) is MoE:
                node.__class__ = ExpertParallelMoE
            node.expert_parallel = ep
    return model


def moe_forward(moe: MoE, x: Array, ep: ExpertParallel) -> tuple[Array, RouterStats]:
    """``moe(x)`` with expert parallelism, leaving ``moe`` itself unchanged: ``x [B, T, D]``
    -> ``(y [B, T, D], RouterStats)``. Call it under ``jax.jit``."""
    graphdef, state = nnx.split(moe)
    view = enable_expert_parallel(nnx.merge(graphdef, state), ep)
    return view(x)


def resolve_expert_parallel(model: nnx.Module, mesh: Mesh, rules: Optional[Rules],
                            expert_parallel: Union[str, bool, ExpertParallel]) -> Optional[ExpertParallel]:
    """``"auto"``: on when the model has MoE layers, the rules split the experts and the expert mesh axis is > 1;
    ``True`` / ``False``; or a ready :class:`ExpertParallel`. Checks the experts divide."""
    if isinstance(expert_parallel, ExpertParallel):
        ep = expert_parallel
    elif expert_parallel is False:
        return None
    elif expert_parallel in ("auto", True):
        if expert_parallel == "auto" and not mesh_axes_of("experts", DEFAULT_RULES if rules is None else rules):
            return None  # rules that keep the experts whole: nothing to run expert-parallel
        ep = ExpertParallel(mesh, rules=DEFAULT_RULES if rules is None else rules)
        if expert_parallel == "auto" and ep.expert_size == 1:
            return None
    else:
        raise ValueError(f"`expert_parallel` must be 'auto', True, False or an ExpertParallel, got {expert_parallel!r}")
    moes = [node for _, node in nnx.iter_graph(model) if isinstance(node, MoE)]
    if not moes:
        return None
    for moe in moes:
        check_num_experts(moe.num_experts, ep.mesh, ep.rules)
    return ep
