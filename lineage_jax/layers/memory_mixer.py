"""Fixed-state token mixers: linear attention, DeltaNet, Gated DeltaNet, KDA — one layer.

They share everything but the switches of the update equation
(:func:`lineage_jax.memory.update_rule`), so one module builds every rule from one row of
:data:`RULES` (a :class:`Rule`); a new fixed-state mixer is a new row (here, or at run time with
:func:`lineage_jax.models.register_rule`) — its letter in a ``ModelConfig.pattern``, its parameters,
its accounting and its decode step follow from it:

    x ─┬─ W_q, W_k, W_v ─ [short causal conv + SiLU] ─ feature map ─┐
       ├─ W_β ─ σ ─────────────────────────────────────── β ────────┤   (rules that erase)
       ├─ gate(x) ─────────────────────────────────────── g ────────┼─ update rule ─ [RMSNorm ⊙ gate(x)] ─ W_o
       └─ (output gate) ────────────────────────────────────────────┘

==========  ======  ==============  ==============================  ======  =====================================
rule        letter  feature map     gate g (log-decay)              erase   output
==========  ======  ==============  ==============================  ======  =====================================
linear      L       elu + 1         —                               no      normalized read ``qS / (q·z + eps)``
deltanet    D       SiLU, L2 q/k    —                               yes     RMSNorm
gdn         G       SiLU, L2 q/k    "scalar": per head, Mamba-2's   yes     RMSNorm ⊙ SiLU(W_g x)
                                    ``−exp(A_log)·softplus(a(x)+b)``
kda         K       SiLU, L2 q/k    "channel": per key channel,     yes     RMSNorm ⊙ σ(gate(x)), low-rank gate
                                    low-rank ``f_b f_a``:
                                    ``−exp(A_log)·softplus(z + b)``
                                    or K3's bounded
                                    ``−5·σ(exp(A_log)·(z + b))``
==========  ======  ==============  ==============================  ======  =====================================
"""


from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineage_jax import memory
from lineage_jax.memory import _validate as V
from lineage_jax.memory.options import MemoryOptions
from lineage_jax.memory.options import resolve as resolve_options
from lineage_jax.memory.segments import document_index
from lineage_jax.numerics import matmul_precision
from lineage_jax.layers.common import Dense, RMSNorm, l2_normalize, normal, param

Array = jax.Array

GATES = ("none", "scalar", "channel")
FEATURES = ("elu1", "silu_l2")


class Rule(NamedTuple):
    """One fixed-state mixer: the switches of the update equation and the layer's defaults around it.

    Attributes:
      letter: the rule's letter in ``ModelConfig.pattern``.
      gate: the decay ``α = exp(g)``: ``"none"``; ``"scalar"``, one log-decay per head and token from
        Mamba-2's gate (``g = −exp(A_log)·softplus(a(x) + b)``, parameters ``gate_a``, ``A_log``,
        ``dt_bias``); ``"channel"``, one per key channel from a low-rank projection
        (``gate_b(gate_a(x))``) under the layer's ``kda_gate`` form.
      erase: the delta rule's correction ``− β k Diag(α) S`` before the write; β (``W_β``, a sigmoid)
        exists with it.
      normalize: linear attention's normalized read ``qS / (q·z + eps)`` (state ``(S, z)``); only
        without a gate and without erasing.
      feature: the feature map of ``q`` and ``k``: ``"elu1"`` (``elu + 1``) or ``"silu_l2"`` (SiLU
        where no conv applies one, then L2 normalization).
      conv: the Decoder gives the layer ``ModelConfig.conv_size``'s short convolution (else none).
      output_norm, output_gate, gate_activation: the defaults of the layer's arguments of those names.
    """

    letter: str
    gate: str = "none"
    erase: bool = True
    normalize: bool = False
    feature: str = "silu_l2"
    conv: bool = True
    output_norm: bool = True
    output_gate: str = "none"
    gate_activation: str = "sigmoid"


RULES: dict[str, Rule] = {
    "linear": Rule("L", erase=False, normalize=True, feature="elu1", conv=False, output_norm=False),
    "deltanet": Rule("D"),
    "gdn": Rule("G", gate="scalar", output_gate="full", gate_activation="silu"),
    "kda": Rule("K", gate="channel", output_gate="lowrank"),
}
KDA_GATES = ("softplus", "bounded")
OUTPUT_GATES = ("none", "lowrank", "full")
GATE_ACTIVATIONS = ("silu", "sigmoid")
A_INITS = ("default", "unit")


def check_rules(rules: dict[str, Rule], taken: str = "SM") -> None:
    """Raise ``ValueError`` naming the first inconsistent row of a rule table (run on :data:`RULES` at
    import): settings from the allowed sets, a normalized read only for an ungated rule that does not
    erase, one distinct upper-case letter per rule outside ``taken`` (the attention layers' letters)."""
    letters = set(taken)
    for name, r in rules.items():
        where = f"memory_mixer.RULES[{name!r}]"
        if not isinstance(r, Rule):
            raise ValueError(f"{where} must be a Rule, got {type(r).__name__}")
        if not (isinstance(r.letter, str) and len(r.letter) == 1 and r.letter.isupper()) or r.letter in letters:
            raise ValueError(f"{where}.letter must be one upper-case letter not already used "
                             f"({''.join(sorted(letters))}), got {r.letter!r}")
        letters.add(r.letter)
        for field, allowed in (("gate", GATES), ("feature", FEATURES), ("output_gate", OUTPUT_GATES),
                               ("gate_activation", GATE_ACTIVATIONS)):
            if getattr(r, field) not in allowed:
                raise ValueError(f"{where}.{field} must be one of {allowed}, got {getattr(r, field)!r}")
        for field in ("erase", "normalize", "conv", "output_norm"):
            if not isinstance(getattr(r, field), bool):
                raise ValueError(f"{where}.{field} must be True or False, got {getattr(r, field)!r}")
        if r.normalize and (r.erase or r.gate != "none"):
            raise ValueError(f"{where}: the normalized read (normalize=True) is for an ungated rule that does "
                             "not erase (linear attention)")


check_rules(RULES)


class MemoryCache(NamedTuple):
    """Decode cache of a fixed-state mixer: the last ``conv_size − 1`` pre-conv inputs and the state."""

    conv: Optional[Array]  # [B, conv_size - 1, C] or None
    state: Any  # [B, H, K, V] float32, or (S, z) for normalized linear attention


def _dt_bias_init(key, shape, dtype):
    """Mamba-2: dt ~ logUniform[1e-3, 1e-1], stored as softplus⁻¹(dt)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (np.log(0.1) - np.log(1e-3)) + np.log(1e-3))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _a_log_init(key, shape, dtype):
    """A ~ Uniform[1, 16], stored as log A (Mamba-2)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def causal_conv(x: Array, w: Array, prefix: Optional[Array], doc: Optional[Array], *,
                kernel: bool = False) -> tuple[Array, Array]:
    """Depthwise causal conv ``y_t = Σ_i w[i] · x_{t−i}`` that never crosses a document boundary.

    Args:
      x: ``[B, T, C]``; w: ``[W, C]`` (``w[0]`` weighs the current token);
      prefix: ``[B, W−1, C]`` inputs before ``x`` (zeros at a sequence start);
      doc: ``[B, T]`` document index of each token (prefix tokens are document 0);
      kernel: without a prefix, run the Pallas kernel (:mod:`lineage_jax.layers.conv_pallas`;
        the same values, float32 accumulation in both) instead of XLA's shifted slices — within
        its 32-bit offsets (``conv_pallas.fits``).
    Returns:
      ``(y [B, T, C], new_prefix [B, W−1, C])``; the new prefix keeps the incoming
      prefix's dtype (a cache's dtype does not change from step to step) and holds only the last
      document's inputs (zeros before its start), as a sequence start's does.
    """
    V.require_bool("causal_conv", "kernel", kernel)
    if doc is not None and (not jnp.issubdtype(doc.dtype, jnp.integer) or doc.dtype == jnp.bool_):
        raise ValueError(f"causal_conv: `doc` must hold integer document ids, got {doc.dtype}")
    B, T, C = x.shape
    W = w.shape[0]
    from lineage_jax.layers import conv_pallas
    docp = None if doc is None else jnp.concatenate([jnp.zeros((B, W - 1), doc.dtype), doc], axis=1)

    def last_document(tail):  # the last W−1 inputs, those of earlier documents zeroed
        if docp is None:
            return tail
        return tail * (docp[:, T:] == doc[:, -1:])[..., None].astype(tail.dtype)

    if kernel and prefix is None and conv_pallas.fits(x):
        xp = jnp.concatenate([jnp.zeros((B, W - 1, C), x.dtype), x[:, max(T - (W - 1), 0):]], axis=1)
        from lineage_jax.parallel.rules import per_device  # a kernel XLA cannot partition: each device's share
        y = per_device(conv_pallas.causal_conv, (x, w, doc),
                       (("batch", None, "heads"), (None, "heads"), ("batch", None)), ("batch", None, "heads"),
                       what="causal_conv kernel")
        return y, last_document(xp[:, xp.shape[1] - (W - 1):])
    if prefix is None:
        prefix = jnp.zeros((B, W - 1, C), x.dtype)
    xp = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    y = jnp.zeros((B, T, C), jnp.float32)
    for i in range(W):
        tap = xp[:, W - 1 - i: W - 1 - i + T].astype(jnp.float32) * w[i].astype(jnp.float32)
        if docp is not None:
            tap = tap * (docp[:, W - 1 - i: W - 1 - i + T] == doc)[..., None]
        y = y + tap
    return y.astype(x.dtype), last_document(xp[:, T:]).astype(prefix.dtype)


class MemoryMixer(nnx.Module):
    """A fixed-state token mixer; ``rule`` picks the edit (see the module table).

    Args:
      d_model: residual width. num_heads, head_dim: ``H`` heads of key width ``K``.
      v_head_dim: value width ``V`` (default ``head_dim``).
      conv_size: short causal conv width on q, k, v (0: none).
      rule: a key of :data:`RULES` (``"linear"``, ``"deltanet"``, ``"gdn"``, ``"kda"``, or a row added there).
      kda_gate: the per-channel gate's form (the rules with ``gate="channel"``: KDA's):
        "softplus" (Kimi Linear: ``g = −exp(A_log)·softplus(z + b)``) or "bounded"
        (K3: ``g = −gate_bound·σ(exp(A_log)·(z + b))``, so ``g ≥ −gate_bound`` per token). Both
        use the Mamba-2 bias ``softplus(b) ~ logU[1e-3, 0.1]``, so a fresh layer forgets slowly
        under either gate. ``A_log`` starts at ``log U[1, 16]`` for the softplus gate and at 0 for
        the bounded gate (fla's ``safe_gate``): there ``exp(A_log)`` multiplies the sigmoid's
        argument, and with ``A`` up to 16 the sigmoid starts saturated (``σ(A·b)`` with
        ``A·b ≈ −40``), its gradient ~1e-6 — a gate that cannot learn. With ``A = 1``,
        ``g ≈ −gate_bound·σ(b) ≈ −gate_bound·dt`` per token and the gate's slope is ~``g``.
        (Without the bias ``b`` the bounded gate starts at ``−gate_bound/2`` per token for every
        channel: the memory would forget everything within a few tokens.)
      gate_rank: rank of KDA's decay projection ``f_a: D→rank, f_b: rank→H·K`` (default head_dim).
      a_init: GDN / KDA decay scale at init. "default": as above (Mamba-2's ``A ~ U[1, 16]`` for
        the softplus gates, ``A = 1`` for the bounded gate); "unit": ``A = 1`` for every gate, so
        the bias alone sets the initial decay (half-lives from ≈ 7 tokens up) — a diagnostic of how much
        the fast initial forgetting slows learning (no effect for linear attention / DeltaNet).
      silu_v: without a conv (``conv_size=0``), apply SiLU to ``v`` as well as to ``q`` and ``k``
        (fla's layers do; with a conv, SiLU follows the conv on all three either way).
      allow_neg_eigval: ``β = 2σ(·) ∈ (0, 2)`` instead of ``σ(·) ∈ (0, 1)``, so the transition
        ``I − β kᵀk`` can have a negative eigenvalue (Grazzi et al., 2024, arXiv:2411.12537; fla's
        ``allow_neg_eigval``).
      output_gate_bias: a bias on the output gate's last projection (fla's KDA low-rank gate has one;
        Kimi Linear's has none).
      output_norm: RMSNorm each head's read (epsilon ``norm_eps``; fla and Kimi Linear use 1e-5).
      output_gate: "none" | "lowrank" | "full".
      num_v_heads: value heads of the delta rules (default ``num_heads``): a multiple of
        ``num_heads``; each query/key head is shared by ``num_v_heads // num_heads`` consecutive
        value heads, and β, the decay, the state, the norm and the output gate are per value head
        (fla's and Qwen3-Next's grouped Gated DeltaNet).
      gate_activation: the output gate's nonlinearity, "silu" | "sigmoid" (default: SiLU for
        GDN, as in fla's GatedDeltaNet, sigmoid otherwise).
      chunk_size: chunk of the WY/UT training form (None: the backend's own, see
        :func:`lineage_jax.memory.delta_rule`).
      backend: the delta rules' chunked form: "auto" (the default: the Pallas kernels on GPU/TPU,
        XLA on the CPU), "xla" or "pallas" (see :func:`lineage_jax.memory.delta_rule`).
      options: a :class:`~lineage_jax.memory.MemoryOptions` instead of ``chunk_size`` / ``backend``
        (not both; ``ModelConfig.memory_options`` builds the Decoder's). The bounded KDA gate adds
        ``gate_lower_bound=-gate_bound`` to it (the gate's construction guarantees the bound).
    """

    @staticmethod
    def check(d_model: int, *, rule: str, num_heads: int, head_dim: int, v_head_dim: Optional[int] = None,
              conv_size: int = 4, kda_gate: str = "softplus", gate_bound: float = 5.0, gate_rank: Optional[int] = None,
              output_norm: Optional[bool] = None, output_gate: Optional[str] = None,
              gate_activation: Optional[str] = None, a_init: str = "default", chunk_size: Optional[int] = None,
              backend: Optional[str] = None, norm_eps: float = 1e-6, silu_v: bool = False,
              allow_neg_eigval: bool = False, output_gate_bias: bool = False, num_v_heads: Optional[int] = None,
              options: Optional[MemoryOptions] = None) -> MemoryOptions:
        """Raise ``ValueError`` naming the first bad argument of ``MemoryMixer(...)`` (the same
        arguments, without ``rngs``); ``ModelConfig`` runs it on its part for each rule. Returns the
        layer's :class:`~lineage_jax.memory.MemoryOptions` (the bounded KDA gate's bound added)."""
        if rule not in RULES:
            raise ValueError(f"MemoryMixer: `rule` must be one of {tuple(RULES)}, got {rule!r}")
        for name, val in (("d_model", d_model), ("num_heads", num_heads), ("head_dim", head_dim)):
            V.require_positive_int("MemoryMixer", name, val)
        for name, val in (("v_head_dim", v_head_dim), ("gate_rank", gate_rank)):
            if val is not None:
                V.require_positive_int("MemoryMixer", name, val)
        if not V.is_int(conv_size) or conv_size < 0 or conv_size == 1:
            raise ValueError(f"MemoryMixer: `conv_size` must be an int, 0 (none) or >= 2, got {conv_size!r}")
        if (isinstance(norm_eps, bool) or not isinstance(norm_eps, numbers.Real) or not math.isfinite(norm_eps)
                or not norm_eps > 0):
            raise ValueError(f"MemoryMixer: `norm_eps` must be a positive finite number, got {norm_eps!r}")
        V.require_bool("MemoryMixer", "output_norm", output_norm, allow_none=True, none_means="the rule's default")
        for name, val in (("silu_v", silu_v), ("allow_neg_eigval", allow_neg_eigval),
                          ("output_gate_bias", output_gate_bias)):
            V.require_bool("MemoryMixer", name, val)
        options = resolve_options("MemoryMixer", options, default_backend="auto", backend=backend,
                                  chunk_size=chunk_size)
        if a_init not in A_INITS:
            raise ValueError(f"MemoryMixer: `a_init` must be one of {A_INITS}, got {a_init!r}")
        if kda_gate not in KDA_GATES:
            raise ValueError(f"MemoryMixer: `kda_gate` must be one of {KDA_GATES}, got {kda_gate!r}")
        if output_gate is not None and output_gate not in OUTPUT_GATES:
            raise ValueError(f"MemoryMixer: `output_gate` must be one of {OUTPUT_GATES}, got {output_gate!r}")
        if gate_activation is not None and gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(f"MemoryMixer: `gate_activation` must be one of {GATE_ACTIVATIONS}, "
                             f"got {gate_activation!r}")
        H = num_heads if num_v_heads is None else num_v_heads
        if not isinstance(H, int) or H <= 0 or H % num_heads:
            raise ValueError(f"MemoryMixer: `num_v_heads` must be a positive multiple of num_heads={num_heads}, "
                             f"got {H!r}")
        if H != num_heads and RULES[rule].normalize:
            raise ValueError(f"MemoryMixer: `num_v_heads` (grouped value heads) is not for a normalized read "
                             f"(rule {rule!r})")
        if output_gate_bias and MemoryMixer._defaults(rule, output_norm, output_gate, gate_activation)[1] == "none":
            raise ValueError("MemoryMixer: `output_gate_bias` needs an output gate (output_gate='none')")
        if RULES[rule].gate == "channel" and kda_gate == "bounded":
            try:  # MemoryOptions checks the bound it becomes; name the argument given here
                options = options.replace(gate_lower_bound=-float(gate_bound))
            except (TypeError, ValueError):
                from lineage_jax._kernels import MIN_GATE_BOUND  # the kernels' limit (float32 range of a tile)
                raise ValueError(f"MemoryMixer: `gate_bound` must be a number in (0, {-MIN_GATE_BOUND}] (the bounded "
                                 f"gate's log-decay is >= -gate_bound), got {gate_bound!r}") from None
        return options

    @staticmethod
    def _defaults(rule, output_norm, output_gate, gate_activation) -> tuple[bool, str, str]:
        """The rule's output norm, output gate and gate activation where the arguments leave them None."""
        r = RULES[rule]
        return (r.output_norm if output_norm is None else output_norm,
                r.output_gate if output_gate is None else output_gate,
                r.gate_activation if gate_activation is None else gate_activation)

    def __init__(self, d_model: int, *, rule: str, num_heads: int, head_dim: int, v_head_dim: Optional[int] = None,
                 conv_size: int = 4, kda_gate: str = "softplus", gate_bound: float = 5.0, gate_rank: Optional[int] = None,
                 output_norm: Optional[bool] = None, output_gate: Optional[str] = None,
                 gate_activation: Optional[str] = None, a_init: str = "default", chunk_size: Optional[int] = None,
                 backend: Optional[str] = None, norm_eps: float = 1e-6, silu_v: bool = False,
                 allow_neg_eigval: bool = False, output_gate_bias: bool = False, num_v_heads: Optional[int] = None,
                 options: Optional[MemoryOptions] = None, rngs: nnx.Rngs):
        options = self.check(d_model, rule=rule, num_heads=num_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                             conv_size=conv_size, kda_gate=kda_gate, gate_bound=gate_bound, gate_rank=gate_rank,
                             output_norm=output_norm, output_gate=output_gate, gate_activation=gate_activation,
                             a_init=a_init, chunk_size=chunk_size, backend=backend, norm_eps=norm_eps, silu_v=silu_v,
                             allow_neg_eigval=allow_neg_eigval, output_gate_bias=output_gate_bias,
                             num_v_heads=num_v_heads, options=options)
        output_norm, output_gate, gate_activation = self._defaults(rule, output_norm, output_gate, gate_activation)
        Hq, K = num_heads, head_dim
        H = Hq if num_v_heads is None else num_v_heads
        Vd = head_dim if v_head_dim is None else v_head_dim
        rank = head_dim if gate_rank is None else gate_rank
        self.rule, self.d_model, self.num_heads, self.head_dim, self.v_head_dim = rule, d_model, Hq, K, Vd
        spec = self.spec
        self.num_v_heads = H
        self.options = options  # how the rule runs: backend, chunk, gate bound, precision (checked once)
        self.conv_size, self.kda_gate, self.gate_bound = conv_size, kda_gate, gate_bound
        self.output_gate, self.gate_activation = output_gate, gate_activation
        self.silu_v, self.beta_max = bool(silu_v), 2.0 if allow_neg_eigval else 1.0

        self.q = Dense(d_model, (Hq, K), axes=("embed", "heads", "head_dim"), rngs=rngs)
        self.k = Dense(d_model, (Hq, K), axes=("embed", "heads", "head_dim"), rngs=rngs)
        self.v = Dense(d_model, (H, Vd), axes=("embed", "heads", "head_dim"), rngs=rngs)
        self.conv = (param(rngs, normal(conv_size ** -0.5), (conv_size, self.conv_channels), ("conv", "heads"))
                     if conv_size else None)
        self.beta = Dense(d_model, H, axes=("embed", "heads"), rngs=rngs) if spec.erase else None
        if spec.gate == "scalar":
            self.gate_a = Dense(d_model, H, axes=("embed", "heads"), rngs=rngs)
            self.A_log = param(rngs, _a_log_init if a_init == "default" else jax.nn.initializers.zeros, (H,), ("heads",))
            self.dt_bias = param(rngs, _dt_bias_init, (H,), ("heads",))
        elif spec.gate == "channel":
            self.gate_a = Dense(d_model, rank, axes=("embed", "gate_rank"), rngs=rngs)
            self.gate_b = Dense(rank, (H, K), axes=("gate_rank", "heads", "head_dim"), rngs=rngs)
            # The bounded gate scales the sigmoid's argument by exp(A_log): start at A = 1 (fla's
            # safe_gate), not Mamba-2's A ~ U[1, 16], which saturates the sigmoid (dead gradient).
            a_log_init = _a_log_init if kda_gate == "softplus" and a_init == "default" else jax.nn.initializers.zeros
            self.A_log = param(rngs, a_log_init, (H,), ("heads",))
            self.dt_bias = param(rngs, _dt_bias_init, (H, K), ("heads", "head_dim"))
        self.norm = RMSNorm(Vd, rngs=rngs, eps=norm_eps) if output_norm else None
        if output_gate == "full":
            self.out_gate = Dense(d_model, (H, Vd), axes=("embed", "heads", "head_dim"), rngs=rngs,
                                  use_bias=output_gate_bias)
        elif output_gate == "lowrank":
            self.out_gate_a = Dense(d_model, Vd, axes=("embed", "gate_rank"), rngs=rngs)
            self.out_gate = Dense(Vd, (H, Vd), axes=("gate_rank", "heads", "head_dim"), rngs=rngs,
                                  use_bias=output_gate_bias)
        self.o = param(rngs, normal((H * Vd) ** -0.5), (H, Vd, d_model), ("heads", "head_dim", "embed"))

    @property
    def spec(self) -> Rule:
        """The layer's row of :data:`RULES`."""
        return RULES[self.rule]

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q and k (``num_heads``), v (``num_v_heads``)."""
        return 2 * self.num_heads * self.head_dim + self.num_v_heads * self.v_head_dim

    # ------------------------------------------------------------------ pieces
    def _check(self, fn: str, x: Array, rank: int) -> None:
        if x.ndim != rank or x.shape[-1] != self.d_model:
            want = "[B,T,D]" if rank == 3 else "[B,D]"
            raise ValueError(f"MemoryMixer.{fn}: `x` must have shape {want} with D={self.d_model}, got {tuple(x.shape)}")
        V.require_float(f"MemoryMixer.{fn}", "x", x)

    def _check_cache(self, fn: str, cache: MemoryCache, batch: int) -> None:
        """``cache`` is a :class:`MemoryCache` of this layer for ``batch`` rows: its conv history
        ``[B, conv_size - 1, C]`` (None without a conv). The state is checked by the rule."""
        fn = f"MemoryMixer.{fn}"
        if not isinstance(cache, MemoryCache):
            raise ValueError(f"{fn}: `cache` must be a MemoryCache (see MemoryMixer.init_cache), "
                             f"got {type(cache).__name__}")
        if self.conv is not None:
            V.require_shape(fn, "cache.conv", cache.conv, (batch, self.conv_size - 1, self.conv_channels),
                            "[B,conv_size-1,C]")
            V.require_float(fn, "cache.conv", cache.conv)
        elif cache.conv is not None:
            raise ValueError(f"{fn}: `cache.conv` must be None (this layer has no conv), got shape "
                             f"{V.shape_of(cache.conv)}")

    def _inputs(self, x: Array, conv_prefix: Optional[Array], doc: Optional[Array]):
        """Project ``x [B,T,D]`` to the rule's ``(q, k, v, g, β)`` and the new conv prefix."""
        B, T, _ = x.shape
        H, Hv, K, Vd = self.num_heads, self.num_v_heads, self.head_dim, self.v_head_dim
        q, k, v = self.q(x), self.k(x), self.v(x)
        new_prefix = None
        if self.conv is not None:
            qkv = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
            qkv, new_prefix = causal_conv(qkv, self.conv[...], conv_prefix, doc,
                                          kernel=self.options.use_pallas_conv())
            qkv = jax.nn.silu(qkv)
            q, k, v = jnp.split(qkv, [H * K, 2 * H * K], axis=-1)
            q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, Hv, Vd)
        if self.spec.feature == "elu1":
            q, k = jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0
        else:
            if self.conv is None:
                q, k = jax.nn.silu(q), jax.nn.silu(k)
                if self.silu_v:
                    v = jax.nn.silu(v)
            q, k = l2_normalize(q), l2_normalize(k)
            if Hv != H:  # grouped value heads: each q/k head serves Hv // H consecutive value heads
                q, k = jnp.repeat(q, Hv // H, axis=2), jnp.repeat(k, Hv // H, axis=2)
        beta = None if self.beta is None else self.beta_max * jax.nn.sigmoid(self.beta(x).astype(jnp.float32))
        g = None
        if self.spec.gate == "scalar":
            a = self.gate_a(x).astype(jnp.float32) + self.dt_bias[...]
            g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a)
        elif self.spec.gate == "channel":
            z = self.gate_b(self.gate_a(x)).astype(jnp.float32) + self.dt_bias[...]
            rate = jnp.exp(self.A_log[...])[:, None]
            if self.kda_gate == "softplus":
                g = -rate * jax.nn.softplus(z)
            else:
                g = -self.gate_bound * jax.nn.sigmoid(rate * z)
        return q, k, v, g, beta, new_prefix

    def _output(self, o: Array, x: Array) -> Array:
        """``o [..., H, V]`` -> ``[..., D]`` through the optional norm and output gate."""
        if self.norm is not None:
            o = self.norm(o)
        if self.output_gate != "none":
            gx = self.out_gate(self.out_gate_a(x)) if self.output_gate == "lowrank" else self.out_gate(x)
            act = jax.nn.silu if self.gate_activation == "silu" else jax.nn.sigmoid
            o = o * act(gx.astype(jnp.float32)).astype(o.dtype)
        return jnp.einsum("...hv,hvd->...d", o.astype(x.dtype), self.o[...].astype(x.dtype))

    @property
    def chunk_size(self) -> Optional[int]:
        return self.options.chunk_size

    @property
    def backend(self) -> str:
        return self.options.backend

    def _rule(self, q, k, v, g, beta, state, segment_ids):
        """The sequence through the rule's update equation (the Pallas kernels run the erasing rules)."""
        kw = dict(initial_state=state, segment_ids=segment_ids)
        if self.spec.normalize:  # (no options: its XLA form at the options' precision, as the other rules')
            with matmul_precision(self.options.precision):
                return memory.linear_attention(q, k, v, normalize=True, chunk_size=self.options.chunk_size, **kw)
        return memory.update_rule(q, k, v, g=g, beta=beta, gate=self.spec.gate, erase=self.spec.erase,
                                  options=self.options, **kw)

    # ------------------------------------------------------------------ public
    def __call__(self, x: Array, *, segment_ids: Optional[Array] = None) -> Array:
        self._check("__call__", x, 3)
        V.check_segment_ids("MemoryMixer.__call__", segment_ids, *x.shape[:2])
        q, k, v, g, beta, _ = self._inputs(x, None, None if segment_ids is None else document_index(segment_ids))
        o, _ = self._rule(q, k, v, g, beta, None, segment_ids)
        return self._output(o, x)

    def init_cache(self, batch: int, max_len: int = 0, dtype=jnp.float32) -> MemoryCache:
        """A zero state (``max_len`` is ignored: the state does not grow)."""
        batch = V.require_positive_int("MemoryMixer.init_cache", "batch", batch)
        dtype = V.require_float_dtype("MemoryMixer.init_cache", "dtype", dtype)
        H, K, Vd = self.num_v_heads, self.head_dim, self.v_head_dim
        conv = (jnp.zeros((batch, self.conv_size - 1, self.conv_channels), dtype) if self.conv is not None else None)
        S = jnp.zeros((batch, H, K, Vd), jnp.float32)
        state = (S, jnp.zeros((batch, H, K), jnp.float32)) if self.spec.normalize else S
        return MemoryCache(conv, state)

    def prefill(self, x: Array, cache: MemoryCache, *, segment_ids: Optional[Array] = None):
        """Run ``T`` tokens after ``cache`` (chunked form); returns ``(y, cache)``."""
        self._check("prefill", x, 3)
        self._check_cache("prefill", cache, x.shape[0])
        V.check_segment_ids("MemoryMixer.prefill", segment_ids, *x.shape[:2])
        q, k, v, g, beta, prefix = self._inputs(x, cache.conv, None if segment_ids is None else document_index(segment_ids))
        o, state = self._rule(q, k, v, g, beta, cache.state, segment_ids)
        return self._output(o, x), MemoryCache(prefix, state)

    def decode(self, x_t: Array, cache: MemoryCache):
        """One token ``x_t [B, D]`` through the rule's decode step."""
        self._check("decode", x_t, 2)
        self._check_cache("decode", cache, x_t.shape[0])
        q, k, v, g, beta, prefix = self._inputs(x_t[:, None], cache.conv, None)
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        if self.spec.normalize:
            o, state = memory.linear_attention_step(q, k, v, cache.state, normalize=True)
        else:
            o, state = memory.update_rule_step(q, k, v, cache.state, g_t=None if g is None else g[:, 0],
                                               beta_t=None if beta is None else beta[:, 0], gate=self.spec.gate,
                                               erase=self.spec.erase)
        return self._output(o, x_t), MemoryCache(prefix, state)
