"""Mixture-of-Experts FFN in the DeepSeek-V3 / Kimi style.

* **Router**: sigmoid scores ``s = σ(x W_router)`` in float32. Experts are chosen by an
  exact top-k of ``s + b``, where ``b`` is a score-correction bias (:class:`RouterBias`)
  that is *not* trained by the optimizer and receives no gradient; it is moved between
  steps by :func:`sign_bias_update` or :func:`quantile_bias_update` to balance the load.
  The combine weights use the uncorrected scores of the chosen experts, renormalised to
  sum to one over the top-k and multiplied by ``routed_scaling_factor``.
* **Experts**: gated FFNs (``ffn.glu``: SwiGLU or SiTU-GLU), ``W_gate, W_up [E, in, H]``,
  ``W_down [E, H, in]``.
* **Shared experts**: one merged dense gated FFN (``ffn.MLP``) of width ``shared_hidden``
  on the full-width input, added to the routed output.
* **Latent MoE** (``latent_dim=L``): routed experts run on ``z = x W_down_proj`` (``[D, L]``);
  the routed sum is returned to model width by ``RMSNorm(r) W_up_proj`` (``[L, D]``).
  The router and the shared experts still see the full-width ``x``.
* **Dispatch**: ``"ragged"`` is dropless: assignments sorted by expert, then grouped
  matmuls (:func:`~lineage_jax.layers.grouped.grouped_matmul`, ``matmul_impl``). On TPU
  that is ``jax.lax.ragged_dot`` (a native grouped matmul). XLA:GPU/CPU expand
  ``ragged_dot`` into a dense ``[E, N·k, H]`` dot over all experts (one of two causes of an H200
  training step with 64 experts, 32K tokens, top-4 asking for a 197 GiB buffer; the CPU memory analysis
  of one ``[131072, 1024] x [64, 1024, 1024]`` grad is 120 GB), so there ``"auto"`` keeps
  ``ragged_dot`` only while that expansion is at most 256 MiB and otherwise runs the
  Pallas grouped matmul on GPUs (``"pallas"``) and the pure-JAX tiled one on the CPU
  (``"tiled"``; memory ``O(N·k·(W + H))`` plus weight-sized buffers). One resolution per layer
  (at the wider of its matmuls) decides all three; with ``"pallas"`` the layer runs in the kernels'
  padded layout from dispatch to combine (:func:`~lineage_jax.layers.grouped_pallas.routed_experts`).
  ``"capacity"`` is the GShard-style einsum with a fixed per-expert capacity that drops
  (and counts) assignments beyond it.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineage_jax.layers.common import Dense, RMSNorm, normal, param
from lineage_jax.layers.ffn import MLP, glu
from lineage_jax.layers.grouped import GROUPED_MATMUL_IMPLS, grouped_glu_mlp, resolve_impl
from lineage_jax.memory import _validate as V

Array = jax.Array

ACTIVATIONS = ("swiglu", "situ")
DISPATCHES = ("ragged", "capacity")
BIAS_RULES = ("sign", "quantile")


class RouterBias(nnx.Variable):
    """The router's score-correction bias ``[E]``: a non-trainable variable.

    It is deliberately not an ``nnx.Param``, so optimizers and ``nnx.grad`` (which
    default to ``nnx.Param``) never see it; it is updated by the bias rules below.
    """


class RouterStats(NamedTuple):
    """Routing statistics of one MoE call (a pytree); ``N`` is the number of tokens.

    Attributes:
      expert_counts: ``[E]`` int32, (token, expert) assignments routed to each expert,
        counted before any capacity drop. Sums to ``N * top_k``.
      load: ``[E]`` float32, ``expert_counts / (N * top_k)``; sums to 1.
      tokens_dropped: int32 scalar, (token, expert) assignments dropped because their
        expert was over capacity (always 0 for ``dispatch="ragged"``).
      scores: ``[N, E]`` float32, the uncorrected sigmoid scores (input to
        :func:`quantile_bias_update`).
    """

    expert_counts: Array
    load: Array
    tokens_dropped: Array
    scores: Array


@jax.custom_vjp
def permute_rows(a: Array, perm: Array, inverse: Array) -> Array:
    """``a[perm]`` for a permutation ``perm`` of ``a``'s rows, whose inverse is ``inverse``.

    Its gradient is the gather ``g[inverse]``: autodiff of ``a[perm]`` would scatter-add (on one
    H200, the MoE dispatch's scatters took 63 ms of a 552 ms training step)."""
    return a[perm]


def _permute_rows_fwd(a, perm, inverse):
    return a[perm], inverse


def _permute_rows_bwd(inverse, g):
    return g[inverse], None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def select_experts(logits: Array, bias: Array, top_k: int, routed_scaling_factor: float = 1.0, *,
                   n_group: int = 1, topk_group: int = 1) -> tuple[Array, Array, Array]:
    """Sigmoid routing with a score-correction bias, in float32.

    Args:
      logits: ``[N, E]`` router logits.
      bias: ``[E]`` score-correction bias (used for selection only, no gradient).
      top_k: experts per token.
      routed_scaling_factor: multiplies the renormalised weights.
      n_group, topk_group: group-limited routing (DeepSeek-V3: 8 groups, top 4). The ``E`` experts
        form ``n_group`` consecutive groups; each group is scored by the sum of its two largest
        corrected scores (its largest one when a group holds a single expert), and a token picks its
        ``top_k`` experts from its ``topk_group`` best groups only. ``n_group = 1``: plain top-k.

    Returns:
      ``expert_idx [N, k]`` int32 (the k largest ``scores + bias``, in decreasing order),
      ``weights [N, k]`` float32 (uncorrected scores of those experts / their sum,
      times ``routed_scaling_factor``) and ``scores [N, E]`` float32 (``sigmoid(logits)``).
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    corrected = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if n_group > 1:
        n, e = corrected.shape
        grouped = corrected.reshape(n, n_group, e // n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, min(2, e // n_group))[0], axis=-1)     # [N, G]
        _, best = jax.lax.top_k(group_score, topk_group)                                     # [N, topk_group]
        keep = jnp.any(best[..., None] == jnp.arange(n_group), axis=-2)                      # [N, G]
        corrected = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(n, e)
    _, expert_idx = jax.lax.top_k(corrected, top_k)
    chosen = jnp.take_along_axis(scores, expert_idx, axis=-1)
    denom = jnp.maximum(jnp.sum(chosen, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    weights = chosen / denom * routed_scaling_factor
    return expert_idx.astype(jnp.int32), weights, scores


def sign_bias_update(bias: Array, expert_counts: Array, rate: float) -> Array:
    """DeepSeek-V3's bias rule: ``bias + rate * sign(mean(counts) - counts)``.

    Underloaded experts (below the mean count) move up by ``rate``, overloaded ones
    down, exactly balanced ones stay.

    Args:
      bias: ``[E]`` current bias.  expert_counts: ``[E]`` assignments per expert.
    Returns: the new ``[E]`` float32 bias.
    """
    counts = expert_counts.astype(jnp.float32)
    return bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(counts) - counts)


def quantile_bias_update(bias: Array, scores: Array, top_k: int, rate: float) -> Array:
    """Quantile balancing: move the bias towards the one that equalises expert quantiles.

    Under balanced load each expert is chosen by a fraction ``k/E`` of the tokens. With
    ``scores [N, E]`` the *uncorrected* sigmoid scores, let
    ``q_e = quantile(scores[:, e], 1 - k/E)`` be the score that expert ``e`` exceeds on
    exactly a fraction ``k/E`` of the tokens. The target bias
    ``b*_e = mean(q) - q_e`` shifts every expert's corrected score ``s_e + b*_e`` so that
    these quantiles all sit at one common threshold ``mean(q)``; selecting the corrected
    scores above that threshold would then pick each expert for a fraction ``k/E`` of
    tokens, which top-k selection approximates. The update is the relaxation
    ``bias + rate * (b* - bias)`` (``rate=1`` jumps to the target). ``mean(q)`` fixes the
    otherwise arbitrary common offset (top-k is invariant to it).

    Returns: the new ``[E]`` float32 bias.
    """
    num_experts = scores.shape[-1]
    q = jnp.quantile(scores.astype(jnp.float32), 1.0 - top_k / num_experts, axis=0)
    target = jnp.mean(q) - q
    bias = bias.astype(jnp.float32)
    return bias + rate * (target - bias)


def _check_rate(fn: str, rate) -> None:
    """A bias update's ``rate``: a real scalar, finite and >= 0 (its value is read only when concrete)."""
    if isinstance(rate, (jax.Array, np.ndarray)) and rate.ndim == 0 and jnp.issubdtype(rate.dtype, jnp.number) \
            and not jnp.issubdtype(rate.dtype, jnp.complexfloating):
        if not V.is_concrete(rate):
            return
        value = float(jax.device_get(rate))
    elif isinstance(rate, numbers.Real) and not isinstance(rate, bool):
        value = float(rate)
    else:
        raise ValueError(f"{fn}: `rate` must be a real number >= 0, got {rate!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{fn}: `rate` must be a finite number >= 0, got {rate!r}")


class MoE(nnx.Module):
    """Sigmoid-routed Mixture-of-Experts FFN: ``x [B, T, D] -> (y [B, T, D], RouterStats)``.

    Args:
      d_model: model width ``D``.
      num_experts: routed experts ``E``.  top_k: experts per token ``k``.
      expert_hidden: hidden width ``H`` of each routed expert.
      num_shared_experts: shared experts, merged into one dense gated FFN (0: none).
      shared_hidden: width of the merged shared FFN; default ``expert_hidden * num_shared_experts``.
      activation: ``"swiglu"`` or ``"situ"`` (gated, ``ffn.glu``); also used by the shared FFN.
      routed_scaling_factor: multiplies the renormalised combine weights.
      latent_dim: ``None`` for an ordinary MoE; ``L`` to run the routed experts in a
        width-``L`` latent space (see the module docstring).
      dispatch: ``"ragged"`` (dropless) or ``"capacity"`` (drops beyond capacity).
      capacity_factor: per-expert capacity is ``ceil(capacity_factor * N * k / E)``
        assignments (capped at ``N``); used only by ``dispatch="capacity"``.
      n_group, topk_group: group-limited routing (:func:`select_experts`; 1, 1: plain top-k).
      matmul_impl: the routed experts' grouped matmuls for ``dispatch="ragged"`` (also
        expert-parallel): ``"auto"``, ``"ragged_dot"``, ``"tiled"`` or ``"pallas"``
        (:func:`~lineage_jax.layers.grouped.grouped_matmul`).
    """

    @staticmethod
    def check(d_model: int, *, num_experts: int, top_k: int, expert_hidden: int,
              num_shared_experts: int = 0, shared_hidden: Optional[int] = None,
              activation: str = "swiglu", routed_scaling_factor: float = 1.0,
              latent_dim: Optional[int] = None, dispatch: str = "ragged",
              capacity_factor: float = 1.25, matmul_impl: str = "auto", n_group: int = 1, topk_group: int = 1) -> None:
        """Raise ``ValueError`` naming the first bad argument of ``MoE(...)`` (the same arguments,
        without ``rngs``); ``ModelConfig`` runs it on its MoE part."""
        for name, val in (("d_model", d_model), ("num_experts", num_experts), ("expert_hidden", expert_hidden)):
            V.require_positive_int("MoE", name, val)
        if not V.is_int(top_k) or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: `top_k` must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if not V.is_int(num_shared_experts) or num_shared_experts < 0:
            raise ValueError(f"MoE: `num_shared_experts` must be an int >= 0, got {num_shared_experts!r}")
        if num_shared_experts == 0 and shared_hidden is not None:
            raise ValueError("MoE: `shared_hidden` is set but `num_shared_experts` is 0")
        if shared_hidden is not None:
            V.require_positive_int("MoE", "shared_hidden", shared_hidden)
        if (isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, numbers.Real)
                or not math.isfinite(routed_scaling_factor) or not routed_scaling_factor > 0):
            raise ValueError(f"MoE: `routed_scaling_factor` must be a positive finite number, "
                             f"got {routed_scaling_factor!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoE: `activation` must be one of {ACTIVATIONS}, got {activation!r}")
        if dispatch not in DISPATCHES:
            raise ValueError(f"MoE: `dispatch` must be one of {DISPATCHES}, got {dispatch!r}")
        if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
                or not math.isfinite(capacity_factor) or not capacity_factor > 0):
            raise ValueError(f"MoE: `capacity_factor` must be a positive finite number, got {capacity_factor!r}")
        if latent_dim is not None and (not V.is_int(latent_dim) or latent_dim <= 0):
            raise ValueError(f"MoE: `latent_dim` must be a positive int or None, got {latent_dim!r}")
        if not (isinstance(n_group, int) and n_group >= 1 and num_experts % n_group == 0):
            raise ValueError(f"MoE: `n_group` must be a positive divisor of num_experts={num_experts}, got {n_group!r}")
        if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
            raise ValueError(f"MoE: `topk_group` must be in [1, n_group={n_group}], got {topk_group!r}")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"MoE: `top_k`={top_k} exceeds the {topk_group * (num_experts // n_group)} experts "
                             f"of topk_group={topk_group} groups")
        if matmul_impl not in GROUPED_MATMUL_IMPLS:
            raise ValueError(f"MoE: `matmul_impl` must be one of {GROUPED_MATMUL_IMPLS}, got {matmul_impl!r}")

    def __init__(self, d_model: int, *, num_experts: int, top_k: int, expert_hidden: int,
                 num_shared_experts: int = 0, shared_hidden: Optional[int] = None,
                 activation: str = "swiglu", routed_scaling_factor: float = 1.0,
                 latent_dim: Optional[int] = None, dispatch: str = "ragged",
                 capacity_factor: float = 1.25, matmul_impl: str = "auto", n_group: int = 1, topk_group: int = 1,
                 rngs: nnx.Rngs):
        self.check(d_model, num_experts=num_experts, top_k=top_k, expert_hidden=expert_hidden,
                   num_shared_experts=num_shared_experts, shared_hidden=shared_hidden, activation=activation,
                   routed_scaling_factor=routed_scaling_factor, latent_dim=latent_dim, dispatch=dispatch,
                   capacity_factor=capacity_factor, matmul_impl=matmul_impl, n_group=n_group, topk_group=topk_group)

        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.activation = activation
        self.routed_scaling_factor = routed_scaling_factor
        self.dispatch = dispatch
        self.capacity_factor = capacity_factor
        self.latent_dim = latent_dim
        self.matmul_impl = matmul_impl
        self.n_group, self.topk_group = n_group, topk_group

        self.router = param(rngs, normal(d_model ** -0.5), (d_model, num_experts), ("embed", "experts"))
        self.router_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32), logical_axes=("experts",))

        if latent_dim is None:
            width, width_axis = d_model, "embed"
            self.down_proj = self.up_proj = self.latent_norm = None
        else:
            width, width_axis = latent_dim, "latent"
            self.down_proj = Dense(d_model, latent_dim, axes=("embed", "latent"), rngs=rngs)
            self.latent_norm = RMSNorm(latent_dim, rngs=rngs)
            self.up_proj = Dense(latent_dim, d_model, axes=("latent", "embed"), rngs=rngs)

        in_axes = ("experts", width_axis, "expert_mlp")
        self.w_gate = param(rngs, normal(width ** -0.5), (num_experts, width, expert_hidden), in_axes)
        self.w_up = param(rngs, normal(width ** -0.5), (num_experts, width, expert_hidden), in_axes)
        self.w_down = param(rngs, normal(expert_hidden ** -0.5), (num_experts, expert_hidden, width),
                            ("experts", "expert_mlp", width_axis))

        if num_shared_experts > 0:
            hidden = expert_hidden * num_shared_experts if shared_hidden is None else shared_hidden
            self.shared = MLP(d_model, hidden, kind=activation, rngs=rngs)
        else:
            self.shared = None

    # ----------------------------------------------------------------------------- routing
    def route(self, x: Array) -> tuple[Array, Array, Array]:
        """Route ``x [..., D]`` (flattened to ``N`` tokens).

        Returns ``expert_idx [N, k]`` int32, ``weights [N, k]`` float32 and
        ``scores [N, E]`` float32, as :func:`select_experts`.
        """
        x32 = x.reshape(-1, self.d_model).astype(jnp.float32)
        logits = x32 @ self.router[...]
        return select_experts(logits, self.router_bias[...], self.top_k, self.routed_scaling_factor,
                              n_group=self.n_group, topk_group=self.topk_group)

    # ---------------------------------------------------------------------------- dispatch
    def _experts_ragged(self, z: Array, expert_idx: Array, weights: Array) -> tuple[Array, Array]:
        """Dropless: sort the ``N*k`` assignments by expert and run grouped matmuls
        (``self.matmul_impl``). When that resolves to ``"pallas"``, the whole path runs in the
        kernels' padded layout (:func:`~lineage_jax.layers.grouped_pallas.routed_experts`: one
        gather in, one out); otherwise :func:`~lineage_jax.layers.grouped.grouped_glu_mlp` on the
        sorted rows.

        ``z [N, W]``, ``expert_idx / weights [N, k]`` -> (``[N, W]`` float32, dropped = 0).
        """
        n, k = expert_idx.shape
        w_gate, w_up, w_down = self.w_gate[...], self.w_up[...], self.w_down[...]
        impl = resolve_impl(self.matmul_impl, n * k, max(w_gate.shape[2], z.shape[1]), self.num_experts, z.dtype)
        if impl == "pallas":
            from lineage_jax.layers.grouped_pallas import routed_experts  # imports grouped
            from lineage_jax.parallel.rules import per_device

            # kernels XLA cannot partition: under a sharded layout each device routes its own tokens through
            # whole expert weights (expert parallelism, which splits the experts, runs its own shard_map)
            rows, whole = ("batch", None), (None, None, None)
            out = per_device(lambda *a: routed_experts(*a, self.activation),
                             (z, expert_idx, weights, w_gate, w_up, w_down), (rows, rows, rows, whole, whole, whole),
                             rows, what="routed_experts kernels")
            return out, jnp.zeros((), jnp.int32)
        flat_expert = expert_idx.reshape(-1)                       # [N*k], token-major
        order = jnp.argsort(flat_expert, stable=True)              # assignments sorted by expert
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
        group_sizes = jnp.bincount(flat_expert, length=self.num_experts).astype(jnp.int32)
        xs = permute_rows(jnp.repeat(z, k, axis=0), order, inverse)  # [N*k, W], sorted by expert
        out = grouped_glu_mlp(xs, w_gate, w_up, w_down, group_sizes, self.activation, impl=impl)
        out = permute_rows(out, inverse, order).reshape(n, k, -1)  # unsort
        routed = jnp.einsum("nkw,nk->nw", out.astype(jnp.float32), weights)
        return routed, jnp.zeros((), jnp.int32)

    def _experts_capacity(self, z: Array, expert_idx: Array, weights: Array) -> tuple[Array, Array]:
        """Fixed-capacity einsum dispatch (GShard style).

        Each expert takes at most ``C = min(ceil(capacity_factor * N * k / E), N)``
        assignments. Slots are filled choice-major (every token's 1st choice, in token
        order, before any 2nd choice); assignments past ``C`` are dropped (contribute 0).
        Memory is ``O(N * E * C)`` for the dispatch tensor.

        ``z [N, W]``, ``expert_idx / weights [N, k]`` -> (``[N, W]`` float32, dropped count).
        """
        n, k = expert_idx.shape
        e = self.num_experts
        capacity = min(math.ceil(self.capacity_factor * n * k / e), n)
        onehot = jax.nn.one_hot(expert_idx.T.reshape(k * n), e, dtype=jnp.int32)   # [k*N, E], choice-major
        position = (jnp.cumsum(onehot, axis=0) - 1) * onehot                         # slot within its expert
        assigned = onehot.reshape(k, n, e)
        kept_per_choice = assigned * (position.reshape(k, n, e) < capacity)        # [k, N, E] 0/1
        dropped = (n * k - jnp.sum(kept_per_choice)).astype(jnp.int32)
        # A token's k experts are distinct, so summing over k gives its [N, E] view exactly.
        kept = jnp.sum(kept_per_choice, axis=0)                                       # [N, E] 0/1
        position = jnp.sum(position.reshape(k, n, e), axis=0)                         # [N, E]
        dispatch = jax.nn.one_hot(position, capacity, dtype=jnp.float32) * kept[..., None]   # [N, E, C]
        expert_weight = jnp.einsum("kne,nk->ne", assigned.astype(jnp.float32), weights)     # [N, E]
        combine = dispatch * expert_weight[..., None]                                 # [N, E, C]

        dt = z.dtype
        expert_in = jnp.einsum("nec,nw->ecw", dispatch.astype(dt), z)                # [E, C, W]
        gate = jnp.einsum("ecw,ewh->ech", expert_in, self.w_gate[...].astype(dt))
        up = jnp.einsum("ecw,ewh->ech", expert_in, self.w_up[...].astype(dt))
        expert_out = jnp.einsum("ech,ehw->ecw", glu(self.activation, gate, up), self.w_down[...].astype(dt))
        routed = jnp.einsum("nec,ecw->nw", combine, expert_out.astype(jnp.float32))
        return routed, dropped

    # ------------------------------------------------------------------------------- call
    def __call__(self, x: Array) -> tuple[Array, RouterStats]:
        """``x [B, T, D]`` -> ``(y [B, T, D]`` in ``x.dtype``, :class:`RouterStats`)."""
        if x.ndim != 3:
            raise ValueError(f"MoE: input `x` must be [B, T, D], got shape {x.shape}")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: input `x` width {x.shape[-1]} != `d_model` {self.d_model}")
        V.require_float("MoE", "x", x)
        b, t, d = x.shape
        expert_idx, weights, scores = self.route(x)

        xf = x.reshape(b * t, d)
        z = xf if self.down_proj is None else self.down_proj(xf)
        run = self._experts_ragged if self.dispatch == "ragged" else self._experts_capacity
        routed, dropped = run(z, expert_idx, weights)
        routed = routed.astype(x.dtype)
        y = routed if self.up_proj is None else self.up_proj(self.latent_norm(routed))
        if self.shared is not None:
            y = y + self.shared(xf)

        counts = jnp.bincount(expert_idx.reshape(-1), length=self.num_experts).astype(jnp.int32)
        stats = RouterStats(expert_counts=counts,
                            load=counts.astype(jnp.float32) / (b * t * self.top_k),
                            tokens_dropped=dropped, scores=scores)
        return y.reshape(b, t, d), stats

    # ------------------------------------------------------------------------ bias update
    def update_bias(self, stats: RouterStats, *, rule: str = "sign", rate: float) -> None:
        """Apply one bias update in place: ``rule="sign"`` (:func:`sign_bias_update` on
        ``stats.expert_counts``) or ``"quantile"`` (:func:`quantile_bias_update` on ``stats.scores``).

        Works on a stacked module too (a scanned group: bias ``[n, E]``, stats stacked along axis 0)."""
        name = "MoE.update_bias"
        if rule == "sign":
            fn = lambda b, s: sign_bias_update(b, s.expert_counts, rate)
        elif rule == "quantile":
            fn = lambda b, s: quantile_bias_update(b, s.scores, self.top_k, rate)
        else:
            raise ValueError(f"{name}: `rule` must be one of {BIAS_RULES}, got {rule!r}")
        _check_rate(name, rate)
        bias = self.router_bias[...]
        if not hasattr(stats, "expert_counts" if rule == "sign" else "scores"):
            raise ValueError(f"{name}: `stats` must be the RouterStats of a MoE call, got {type(stats).__name__}")
        lead, E = tuple(bias.shape[:-1]), self.num_experts
        if rule == "sign":
            V.require_shape(name, "stats.expert_counts", stats.expert_counts, (*lead, E), "[..., E] (as the bias)")
        elif V.shape_of(stats.scores)[:len(lead)] != lead or V.shape_of(stats.scores)[len(lead) + 1:] != (E,):
            raise ValueError(f"{name}: `stats.scores` must have shape [..., N, E] with E = {E} (leading axes "
                             f"{lead} as the bias), got {V.shape_of(stats.scores)}")
        for _ in range(bias.ndim - 1):
            fn = jax.vmap(fn)
        self.router_bias[...] = fn(bias, stats)
