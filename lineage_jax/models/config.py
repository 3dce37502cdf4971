"""Model configs: one dataclass, validated once, and the named configs of the lineage.

A model is a layer pattern — one letter per layer naming its token mixer —
plus the FFN (dense for the first ``first_dense_layers``, MoE after when
``num_experts > 0``) and the residual (plain, or block Attention Residuals):

    S  softmax attention (GPT-2; GQA via num_kv_heads)     D  DeltaNet
    L  linear attention (elu+1, normalized)                G  Gated DeltaNet
    K  Kimi Delta Attention                                M  MLA

The fixed-state letters (L D G K) are the rows of
:data:`lineage_jax.layers.memory_mixer.RULES`: a row added there is a letter here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any, Optional

from lineage_jax.layers.attention import Attention
from lineage_jax.layers.memory_mixer import RULES, MemoryMixer, Rule, check_rules
from lineage_jax.layers.mla import MLA
from lineage_jax.layers.moe import MoE
from lineage_jax.memory.fused import IMPLS as ATTENTION_IMPLS
from lineage_jax.memory.options import MemoryOptions
from lineage_jax.memory.softmax import READS
from lineage_jax.numerics import MATMUL_PRECISIONS

# A layer's letter in `pattern` -> its mixer: softmax attention, each fixed-state rule, MLA.
MIXERS = {"S": "softmax", **{r.letter: name for name, r in RULES.items()}, "M": "mla"}


def register_rule(name: str, rule: Rule) -> None:
    """Add a fixed-state mixer at run time: ``rule`` becomes ``MemoryMixer(rule=name)`` and the pattern
    letter ``rule.letter`` of every ``ModelConfig`` (the Decoder, the checks and the accounting read it
    from here on). For example GLA, a per-channel decay without erasing:
    ``register_rule("gla", Rule("X", gate="channel", erase=False, output_gate="full"))``. A run that
    uses the letter registers it again in a new process before its config is read (resume, ``generate``).
    Registering the same row under the same name again does nothing; ``ValueError`` for a name or letter
    already taken by another row, or an inconsistent row."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_rule: `name` must be an identifier string, got {name!r}")
    if RULES.get(name) == rule and isinstance(rule, Rule) and MIXERS.get(rule.letter) == name:
        return  # the same row again (a module imported twice, a notebook cell rerun)
    if name in RULES or name in MIXERS.values():
        raise ValueError(f"register_rule: `name` {name!r} is taken (mixers: {sorted(set(MIXERS.values()))})")
    try:
        check_rules({**RULES, name: rule})
    except ValueError as e:
        raise ValueError(f"register_rule: {e}") from None
    RULES[name] = rule
    MIXERS[rule.letter] = name


def _letters(pick) -> set[str]:
    """The letters of the fixed-state rules for which ``pick(rule)`` holds."""
    return {r.letter for r in RULES.values() if pick(r)}


FFN_KINDS = ("gelu", "swiglu", "situ")
# What a layer group keeps for the backward pass (lineage_jax.models.decoder.remat_policy):
#   "none": everything (no rematerialisation; fastest, most memory);
#   "dots": the outputs of the weight matmuls (projections, FFN) and the residuals of the
#           attention, delta-rule and grouped-matmul kernels; elementwise ops and norms are
#           recomputed;
#   "full": only the layer group's input (least memory; the whole forward runs twice).
REMAT_POLICIES = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that defines a ``Decoder``: frozen, validated once on construction.

    The fields come in families; each layer reads its own:

    * **Shape** — ``name``, ``vocab_size``, ``d_model``, ``pattern`` (one letter per layer,
      :data:`MIXERS`), ``num_heads``, ``head_dim``, ``positions`` / ``rope_theta`` /
      ``max_seq_len``, ``norm``, ``tie_embeddings``: the embedding, the head and every layer.
    * **Softmax attention** (``S``) — ``num_kv_heads`` (grouped-query attention), ``attn_bias``.
    * **Fixed-state mixers** (``L``, ``D``, ``G``, ``K``; ``layers.memory_mixer``) —
      ``conv_size``, ``chunk_size``, ``kda_gate``, ``kda_gate_rank``, ``kda_output_gate``,
      ``decay_a_init``, ``gdn_output_gate``, ``memory_backend`` (the delta rules' chunked
      form: the XLA form of ``lineage_jax.memory`` or the Pallas kernels).
    * **MLA** (``M``; ``layers.mla``) — ``q_lora_rank``, ``kv_lora_rank``,
      ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``mla_rope``,
      ``mla_output_gate``.
    * **FFN and MoE** (``layers.ffn``, ``layers.moe``) — ``ffn_kind``, ``ffn_hidden`` for
      dense layers; with ``num_experts > 0`` every layer from ``first_dense_layers`` on is a
      MoE: ``top_k``, ``moe_hidden``, ``num_shared_experts``, ``shared_hidden``,
      ``moe_latent_dim`` (latent MoE), ``moe_activation``, ``routed_scaling_factor``,
      ``moe_dispatch``, ``moe_matmul_impl``, ``capacity_factor``.
    * **Residual** — ``attnres_block`` (0: plain sum; ``n``: block Attention Residuals over
      blocks of ``n`` layers).
    * **Execution** — how the same model runs, not what it computes: ``decode_read``,
      ``attention_impl``, ``remat``, ``scan_layers``, ``scan_period``, ``dtype``.

    Each layer family reads its fields through its **part** (:class:`Part`):
    :meth:`attention_part`, :meth:`mla_part`, :meth:`mixer_part` (per rule), :meth:`moe_part` give
    the layer's arguments under the layer's own names, and the Decoder builds each layer from its
    part. Validation follows the same split: the checks of a family's fields are the layer's own
    (``Attention.check``, ``MLA.check``, ``MemoryMixer.check``, ``MoE.check``), run here on the part,
    with errors naming the config field (``ModelConfig.moe_hidden: MoE: `expert_hidden` must be
    positive``); :func:`validate` keeps the checks that span families (the pattern, positions,
    RoPE scaling, execution settings).

    :meth:`replace` returns a validated copy with some fields changed; the named configs of
    the lineage are in ``CONFIGS`` (:func:`get_config`).
    """

    name: str = "custom"
    vocab_size: int = 256
    d_model: int = 64
    pattern: str = "S"
    num_heads: int = 4
    head_dim: Optional[int] = None  # default d_model // num_heads
    num_kv_heads: Optional[int] = None  # softmax layers only (GQA)
    positions: str = "none"  # "learned" (GPT-2) | "rope" (softmax layers rotate q, k; Llama-style) | "none"
    rope_theta: float = 10000.0  # RoPE base: softmax layers with positions="rope", MLA with mla_rope
    max_seq_len: int = 1024  # size of the learned position table
    norm: str = "rmsnorm"  # "layernorm" | "rmsnorm"
    norm_eps: Optional[float] = None  # epsilon of the residual-stream norms; None: 1e-6 (rmsnorm), 1e-5 (layernorm)
    # YaRN scaling of every RoPE (softmax layers with positions="rope", MLA with mla_rope): "none" | "yarn".
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # YaRN: context extension ratio
    rope_original_max_len: int = 4096  # YaRN: the pretraining context
    rope_beta_fast: float = 32.0  # YaRN: ramp bounds, in rotations over rope_original_max_len
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 1.0  # YaRN: multiplies the rotated channels (cos and sin)
    rope_truncate: bool = True  # YaRN: round the ramp bounds to whole channels
    tie_embeddings: bool = False
    attn_bias: bool = False
    # Dense FFN.
    ffn_kind: str = "swiglu"
    ffn_hidden: int = 256
    # MoE (num_experts = 0: every layer dense).
    first_dense_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    moe_hidden: int = 0
    num_shared_experts: int = 0
    shared_hidden: Optional[int] = None  # merged shared-expert width (default moe_hidden × num_shared)
    moe_latent_dim: Optional[int] = None  # latent MoE width (K3)
    moe_activation: str = "swiglu"
    routed_scaling_factor: float = 1.0
    moe_dispatch: str = "ragged"  # "ragged" (dropless) | "capacity"
    # The dropless experts' grouped matmuls (layers.grouped.grouped_matmul's `impl`): "auto" |
    # "ragged_dot" | "tiled" | "pallas".
    moe_matmul_impl: str = "auto"
    capacity_factor: float = 1.25
    n_group: int = 1  # group-limited routing: experts in n_group groups, each token picks from its
    topk_group: int = 1  # topk_group best groups (DeepSeek-V3: 8 and 4); 1, 1: plain top-k
    # Fixed-state mixers (L, D, G, K).
    conv_size: int = 4
    chunk_size: Optional[int] = None  # chunk of the delta rules' chunked form; None: each backend's own
    kda_gate: str = "softplus"  # "softplus" (Kimi Linear) | "bounded" (K3: −5·σ(exp(A)·(z + b)))
    kda_gate_rank: Optional[int] = None  # default head_dim
    kda_output_gate: str = "lowrank"  # "lowrank" (Kimi Linear) | "full" (K3) | "none" (diagnostic)
    decay_a_init: str = "default"  # GDN / KDA decay scale at init: "default" | "unit" (A = 1; diagnostic)
    silu_v: bool = False  # conv_size=0: SiLU on v too, as on q and k (fla); with a conv SiLU follows it on all three
    allow_neg_eigval: bool = False  # delta rules (D, G, K): β = 2σ(·) ∈ (0, 2), eigenvalues of I − βkᵀk in (−1, 1]
    # Value heads of the delta rules (D, G, K), a multiple of num_heads: each q/k head serves
    # num_v_heads // num_heads value heads (fla's / Qwen3-Next's grouped GDN). None: num_heads.
    num_v_heads: Optional[int] = None
    kda_output_gate_bias: bool = False  # a bias on KDA's output gate (fla's low-rank gate has one; Kimi Linear's not)
    mixer_norm_eps: float = 1e-6  # epsilon of the fixed-state mixers' (gated) output RMSNorm; fla and Kimi: 1e-5
    gdn_output_gate: str = "silu"  # GDN's full output gate: "silu" (fla's GatedDeltaNet) | "sigmoid" | "none"
    # Chunked form of the delta rules (D, G, K) in training / prefill: "auto" (the kernels.delta Pallas
    # kernels on GPU/TPU, lineage_jax.memory's XLA chunked form on the CPU), "xla" or "pallas"
    # (interpret mode on the CPU). With chunk_size and matmul_precision it makes `memory_options`.
    memory_backend: str = "auto"
    # MLA (M).
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_rope: bool = False  # False: NoPE (Kimi Linear, K3)
    mla_output_gate: bool = False
    mla_softmax_scale: Optional[float] = None  # MLA score scale; None: (qk_nope + qk_rope) ** -0.5
    # Residual.
    attnres_block: int = 0  # 0: plain residual; n > 0: block AttnRes, blocks of n layers
    # Execution.
    # How decode steps read softmax / MLA caches: "auto" | "dot" (einsum) | "reduce" (multiply-and-
    # reduce, no transposed copy of the cache); see lineage_jax.memory.resolve_read.
    decode_read: str = "auto"
    # Fused attention of softmax and MLA layers in training / prefill: "auto" | "xla" | "cudnn" |
    # "pallas" (lineage_jax.memory.softmax_attention's `impl`).
    attention_impl: str = "auto"
    # Matmul precision of the whole model (lineage_jax.numerics): "default" (the backend's: TF32
    # for float32 on GPUs, float32 on CPU) | "high" | "highest" (float32 products everywhere).
    matmul_precision: str = "default"
    # Rematerialisation policy of each layer group (REMAT_POLICIES): "none" | "full" | "dots".
    # True / False (older configs) mean "full" / "none".
    remat: str = "none"
    scan_layers: bool = True
    # Run each scanned group's loop unrolled (lax.scan's ``unroll=True``): the parameters stay
    # stacked, the compiled step has no loop (more to compile, no per-iteration slicing of the
    # stacked residuals).
    scan_unroll: bool = False
    scan_period: Optional[int] = None  # macrocycle length for lax.scan (default: smallest period of the pattern)
    dtype: str = "float32"  # activation dtype ("float32" | "bfloat16"); parameters stay float32 (but hf.load's)

    def __post_init__(self):
        # Older configs and `--set remat=true` spell the policy as a bool.
        legacy = {True: "full", False: "none", "true": "full", "false": "none"}
        if isinstance(self.remat, (bool, str)) and self.remat in legacy and not (
                isinstance(self.remat, str) and self.remat in REMAT_POLICIES):
            object.__setattr__(self, "remat", legacy[self.remat])
        validate(self)

    # ------------------------------------------------------------------ derived
    @property
    def yarn(self):
        """The :class:`~lineage_jax.layers.common.YaRN` of ``rope_scaling="yarn"`` (else None)."""
        if self.rope_scaling != "yarn":
            return None
        from lineage_jax.layers.common import YaRN
        return YaRN(float(self.rope_factor), int(self.rope_original_max_len), float(self.rope_beta_fast),
                    float(self.rope_beta_slow), float(self.rope_attention_factor), bool(self.rope_truncate))

    @property
    def memory_options(self) -> MemoryOptions:
        """How the delta rules run (``memory_backend``, ``chunk_size``, ``matmul_precision``), for
        every fixed-state mixer; a bounded KDA gate adds its bound in the layer."""
        return MemoryOptions(backend=self.memory_backend, chunk_size=self.chunk_size, precision=self.matmul_precision)

    # ------------------------------------------------------------------ each layer's part
    def attention_part(self) -> "Part":
        """The softmax-attention layers' (``S``) arguments of :class:`~lineage_jax.layers.attention.Attention`."""
        rope = self.positions == "rope"
        # GPT-2's init (std 0.02, output scaled by depth) for the GPT-2 family: learned positions or
        # LayerNorm (so GPT-2 without positions, or with RoPE, differs from GPT-2 in that alone).
        gpt2_init = self.positions == "learned" or self.norm == "layernorm"
        return Part("Attention", d_model=(self.d_model, "d_model"), num_heads=(self.num_heads, "num_heads"),
                    head_dim=(self.resolved_head_dim, "head_dim"), num_kv_heads=(self.num_kv_heads, "num_kv_heads"),
                    use_bias=(self.attn_bias, "attn_bias"), std=(0.02 if gpt2_init else None, "positions"),
                    out_std=(0.02 / (2 * self.num_layers) ** 0.5 if gpt2_init else None, "positions"),
                    rope_theta=(self.rope_theta if rope else None, "rope_theta"),
                    decode_read=(self.decode_read, "decode_read"), attention_impl=(self.attention_impl, "attention_impl"),
                    yarn=(self.yarn if rope else None, "rope_scaling"))

    def mla_part(self) -> "Part":
        """The MLA layers' (``M``) arguments of :class:`~lineage_jax.layers.mla.MLA`."""
        return Part("MLA", d_model=(self.d_model, "d_model"), num_heads=(self.num_heads, "num_heads"),
                    q_lora_rank=(self.q_lora_rank, "q_lora_rank"), kv_lora_rank=(self.kv_lora_rank, "kv_lora_rank"),
                    qk_nope_head_dim=(self.qk_nope_head_dim, "qk_nope_head_dim"),
                    qk_rope_head_dim=(self.qk_rope_head_dim, "qk_rope_head_dim"),
                    v_head_dim=(self.v_head_dim, "v_head_dim"), use_rope=(self.mla_rope, "mla_rope"),
                    rope_theta=(self.rope_theta, "rope_theta"), output_gate=(self.mla_output_gate, "mla_output_gate"),
                    decode_read=(self.decode_read, "decode_read"), attention_impl=(self.attention_impl, "attention_impl"),
                    yarn=(self.yarn if self.mla_rope else None, "rope_scaling"),
                    softmax_scale=(self.mla_softmax_scale, "mla_softmax_scale"))

    def mixer_part(self, rule: str) -> "Part":
        """The arguments of :class:`~lineage_jax.layers.memory_mixer.MemoryMixer` for ``rule``
        (a key of ``memory_mixer.RULES``: ``"linear"``, ``"deltanet"``, ``"gdn"``, ``"kda"``, the ``L``,
        ``D``, ``G``, ``K`` layers). The fields of the rules' own settings (``kda_*``, ``gdn_output_gate``)
        reach those rules only; the others take the rule's defaults."""
        spec = RULES[rule]
        gates = {}
        if rule == "kda":
            gates = dict(output_gate=(self.kda_output_gate, "kda_output_gate"),
                         output_gate_bias=(self.kda_output_gate_bias and self.kda_output_gate != "none",
                                           "kda_output_gate_bias"))
        elif rule == "gdn":
            gates = (dict(output_gate=("none", "gdn_output_gate")) if self.gdn_output_gate == "none" else
                     dict(output_gate=("full", "gdn_output_gate"), gate_activation=(self.gdn_output_gate, "gdn_output_gate")))
        return Part("MemoryMixer", d_model=(self.d_model, "d_model"), rule=(rule, "pattern"),
                    num_heads=(self.num_heads, "num_heads"), head_dim=(self.resolved_head_dim, "head_dim"),
                    conv_size=(self.conv_size if spec.conv else 0, "conv_size"), kda_gate=(self.kda_gate, "kda_gate"),
                    gate_rank=(self.kda_gate_rank, "kda_gate_rank"), a_init=(self.decay_a_init, "decay_a_init"),
                    options=(self.memory_options, "memory_backend"), norm_eps=(self.mixer_norm_eps, "mixer_norm_eps"),
                    silu_v=(self.silu_v, "silu_v"),
                    allow_neg_eigval=(self.allow_neg_eigval and spec.erase, "allow_neg_eigval"),
                    num_v_heads=(None if spec.normalize else self.num_v_heads, "num_v_heads"), **gates)

    def moe_part(self) -> "Part":
        """The MoE layers' arguments of :class:`~lineage_jax.layers.moe.MoE`."""
        return Part("MoE", d_model=(self.d_model, "d_model"), num_experts=(self.num_experts, "num_experts"),
                    top_k=(self.top_k, "top_k"), expert_hidden=(self.moe_hidden, "moe_hidden"),
                    num_shared_experts=(self.num_shared_experts, "num_shared_experts"),
                    shared_hidden=(self.shared_hidden if self.num_shared_experts else None, "shared_hidden"),
                    activation=(self.moe_activation, "moe_activation"),
                    routed_scaling_factor=(self.routed_scaling_factor, "routed_scaling_factor"),
                    latent_dim=(self.moe_latent_dim, "moe_latent_dim"), dispatch=(self.moe_dispatch, "moe_dispatch"),
                    capacity_factor=(self.capacity_factor, "capacity_factor"),
                    matmul_impl=(self.moe_matmul_impl, "moe_matmul_impl"), n_group=(self.n_group, "n_group"),
                    topk_group=(self.topk_group, "topk_group"))

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    def mixer(self, layer: int) -> str:
        return MIXERS[self.pattern[layer]]

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense_layers

    def layer_kind(self, layer: int) -> tuple[str, bool]:
        return self.pattern[layer], self.is_moe(layer)

    def replace(self, **changes: Any) -> "ModelConfig":
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; valid fields: {sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)


class Part:
    """One layer's arguments from a :class:`ModelConfig`: ``kwargs`` under the layer's own argument
    names and, for each argument, the config field it comes from (what an error names). Built by
    ``ModelConfig.attention_part`` / ``mla_part`` / ``mixer_part`` / ``moe_part``; the Decoder
    builds each layer from its part, and :func:`validate` runs the layer's own ``check`` on it."""

    def __init__(self, layer: str, **args: tuple[Any, str]):
        self.layer = layer
        self.kwargs = {a: v for a, (v, _) in args.items()}
        self.fields = {a: f for a, (_, f) in args.items()}

    def check(self, check_fn) -> Any:
        """``check_fn(**kwargs)``; a ``ValueError`` naming an argument is raised again naming the
        config field it comes from (``ModelConfig.<field>: <the layer's message>``)."""
        try:
            return check_fn(**self.kwargs)
        except ValueError as e:
            m = re.search(r"`(\w+)`", str(e))
            field = self.fields.get(m.group(1)) if m else None
            if field is None:
                raise
            raise ValueError(f"ModelConfig.{field}: {e}") from None


def _fail(field: str, message: str):
    raise ValueError(f"ModelConfig.{field}: {message}")


def validate(c: ModelConfig) -> None:
    """Raise ``ValueError`` naming the first inconsistent field."""
    def positive(field):
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            _fail(field, f"must be a positive int, got {v!r}")

    def non_negative(field):
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            _fail(field, f"must be an int >= 0, got {v!r}")

    def real(field):
        v = getattr(c, field)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            _fail(field, f"must be a finite number, got {v!r}")

    for f in ("vocab_size", "d_model", "num_heads", "max_seq_len"):
        positive(f)
    for f in ("num_experts", "first_dense_layers", "attnres_block"):
        non_negative(f)
    if c.scan_period is not None:
        positive("scan_period")
    for f in ("tie_embeddings", "attn_bias", "rope_truncate", "silu_v", "allow_neg_eigval", "kda_output_gate_bias",
              "mla_rope", "mla_output_gate", "scan_layers", "scan_unroll"):
        if not isinstance(getattr(c, f), bool):
            _fail(f, f"must be True or False, got {getattr(c, f)!r}")
    if c.chunk_size is not None:
        positive("chunk_size")
    if not c.pattern:
        _fail("pattern", "is empty; give one letter per layer")
    bad = sorted(set(c.pattern) - set(MIXERS))
    if bad:
        _fail("pattern", f"unknown letter(s) {bad}; valid: " + ", ".join(f"{k}={v}" for k, v in MIXERS.items()))
    if c.head_dim is None:
        if c.d_model % c.num_heads:
            _fail("num_heads", f"d_model={c.d_model} is not divisible by num_heads={c.num_heads}; set head_dim explicitly")
    else:
        positive("head_dim")
    if c.positions not in ("learned", "rope", "none"):
        _fail("positions", f"must be 'learned', 'rope' or 'none', got {c.positions!r}")
    if (isinstance(c.rope_theta, bool) or not isinstance(c.rope_theta, numbers.Real)
            or not math.isfinite(c.rope_theta) or not c.rope_theta > 0):
        _fail("rope_theta", f"must be a positive finite number, got {c.rope_theta!r}")
    if c.positions == "rope" and "S" not in c.pattern:
        _fail("positions", "'rope' rotates the softmax ('S') layers and this pattern has none "
                           f"({c.pattern!r}); MLA layers use mla_rope")
    if c.norm not in ("layernorm", "rmsnorm"):
        _fail("norm", f"must be 'layernorm' or 'rmsnorm', got {c.norm!r}")
    for f in ("norm_eps", "mla_softmax_scale"):  # mixer_norm_eps: MemoryMixer.check (its `norm_eps`)
        v = getattr(c, f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not v > 0):
            _fail(f, f"must be a positive finite number or None, got {v!r}")
    if c.rope_scaling not in ("none", "yarn"):
        _fail("rope_scaling", f"must be 'none' or 'yarn', got {c.rope_scaling!r}")
    if c.rope_scaling == "yarn":
        if not (c.positions == "rope" and "S" in c.pattern or c.mla_rope and "M" in c.pattern):
            _fail("rope_scaling", "'yarn' scales RoPE and no layer of this config rotates (softmax layers need "
                                  "positions='rope', MLA layers mla_rope=True)")
        for f in ("rope_factor", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor"):
            real(f)
        if not c.rope_factor >= 1:
            _fail("rope_factor", f"must be >= 1, got {c.rope_factor!r}")
        positive("rope_original_max_len")
        if not 0 < c.rope_beta_slow <= c.rope_beta_fast:
            _fail("rope_beta_slow", f"must be in (0, rope_beta_fast={c.rope_beta_fast}], got {c.rope_beta_slow!r}")
        if not c.rope_attention_factor > 0:
            _fail("rope_attention_factor", f"must be > 0, got {c.rope_attention_factor!r}")
    if c.ffn_kind not in FFN_KINDS:
        _fail("ffn_kind", f"must be one of {FFN_KINDS}, got {c.ffn_kind!r}")
    if not 0 <= c.first_dense_layers <= c.num_layers:
        _fail("first_dense_layers", f"must be in [0, {c.num_layers}] (the number of layers), got {c.first_dense_layers}")
    if c.num_experts == 0 or c.first_dense_layers > 0:
        positive("ffn_hidden")
    try:
        c.memory_options
    except ValueError as e:  # MemoryOptions names its own argument: name the config's field instead
        msg = str(e).split(": ", 1)[1]
        for arg, field in (("`backend`", "memory_backend"), ("`chunk_size`", "chunk_size"),
                           ("`precision`", "matmul_precision")):
            if msg.startswith(arg):
                _fail(field, msg[len(arg):].strip())
        raise
    if c.attention_impl not in ATTENTION_IMPLS:
        _fail("attention_impl", f"must be one of {ATTENTION_IMPLS}, got {c.attention_impl!r}")
    if c.matmul_precision not in MATMUL_PRECISIONS:
        _fail("matmul_precision", f"must be one of {MATMUL_PRECISIONS}, got {c.matmul_precision!r}")
    if c.remat not in REMAT_POLICIES:
        _fail("remat", f"must be one of {REMAT_POLICIES} (or a bool: True = 'full'), got {c.remat!r}")
    if c.decode_read not in READS:
        _fail("decode_read", f"must be one of {READS}, got {c.decode_read!r}")
    gated, grouped, erasing = (_letters(lambda r: r.gate != "none"), _letters(lambda r: not r.normalize),
                               _letters(lambda r: r.erase))
    if c.decay_a_init != "default" and not set(c.pattern) & gated:
        _fail("decay_a_init", f"sets the gated rules' decay scale ({''.join(sorted(gated))}) and this pattern "
                              f"has none ({c.pattern!r})")
    if c.num_v_heads not in (None, c.num_heads) and not set(c.pattern) & grouped:
        _fail("num_v_heads", f"sets the value heads of the rules without a normalized read "
                             f"({''.join(sorted(grouped))}) and this pattern has none ({c.pattern!r})")
    if c.allow_neg_eigval and not set(c.pattern) & erasing:
        _fail("allow_neg_eigval", f"sets the erasing rules' β ({''.join(sorted(erasing))}) and this pattern "
                                  f"has none ({c.pattern!r})")
    if c.kda_output_gate_bias and ("K" not in c.pattern or c.kda_output_gate == "none"):
        _fail("kda_output_gate_bias", "needs KDA layers ('K') with an output gate")
    # Each layer family: its part of the config, checked by the layer's own `check` (errors name the field).
    for rule in RULES:  # every rule: its fields are checked even when unused
        c.mixer_part(rule).check(MemoryMixer.check)
    if "S" in c.pattern:
        c.attention_part().check(Attention.check)
    if "M" in c.pattern:
        c.mla_part().check(MLA.check)
    if c.num_experts > 0:
        c.moe_part().check(MoE.check)
    if c.attnres_block < 0 or c.attnres_block > c.num_layers:
        _fail("attnres_block", f"must be 0 (plain residual) or a block size in [1, {c.num_layers}] layers, got {c.attnres_block}")
    if c.scan_period is not None and not 0 < c.scan_period <= c.num_layers:
        _fail("scan_period", f"must be in [1, {c.num_layers}], got {c.scan_period}")
    if c.dtype not in ("float32", "bfloat16"):
        _fail("dtype", f"must be 'float32' or 'bfloat16', got {c.dtype!r}")


# ---------------------------------------------------------------------------- named configs
def _gpt2_small() -> ModelConfig:
    return ModelConfig(name="gpt2_small", vocab_size=50304, d_model=768, pattern="S" * 12, num_heads=12,
                       positions="learned", max_seq_len=1024, norm="layernorm", tie_embeddings=True, attn_bias=True,
                       ffn_kind="gelu", ffn_hidden=3072)


def _kimi_linear_48b_a3b() -> ModelConfig:
    # 27 layers, MLA at 1-based layers 4, 8, ..., 24 and 27.
    pattern = "".join("M" if (i + 1) in (4, 8, 12, 16, 20, 24, 27) else "K" for i in range(27))
    return ModelConfig(name="kimi_linear_48b_a3b", vocab_size=163840, d_model=2304, pattern=pattern, num_heads=32,
                       head_dim=128, ffn_kind="swiglu", ffn_hidden=9216, first_dense_layers=1, num_experts=256, top_k=8,
                       moe_hidden=1024, num_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=512,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_rope=False,
                       kda_gate="softplus", kda_output_gate="lowrank", max_seq_len=1 << 20)


def _kimi_k3() -> ModelConfig:
    return ModelConfig(name="kimi_k3", vocab_size=163840, d_model=7168, pattern="KKKM" * 23 + "M", num_heads=96,
                       head_dim=128, ffn_kind="situ", ffn_hidden=33792, first_dense_layers=1, num_experts=896, top_k=16,
                       moe_hidden=3072, num_shared_experts=2, shared_hidden=6144, moe_latent_dim=3584,
                       moe_activation="situ", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128, mla_rope=False, mla_output_gate=True, kda_gate="bounded",
                       kda_output_gate="full", attnres_block=12, max_seq_len=1 << 20)


_TINY = dict(vocab_size=256, d_model=64, num_heads=4, head_dim=16, ffn_hidden=128, chunk_size=16, max_seq_len=512)


def _tiny(name: str, **kw) -> ModelConfig:
    base = dict(_TINY)
    base.update(kw)
    return ModelConfig(name=name, **base)


_TINY_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_TINY_MOE = dict(first_dense_layers=1, num_experts=8, top_k=2, moe_hidden=32, num_shared_experts=1)

CONFIGS = {
    "gpt2_small": _gpt2_small,
    "kimi_linear_48b_a3b": _kimi_linear_48b_a3b,
    "kimi_k3": _kimi_k3,
    "tiny_gpt2": lambda: _tiny("tiny_gpt2", pattern="SS", positions="learned", norm="layernorm", tie_embeddings=True,
                               attn_bias=True, ffn_kind="gelu"),
    "tiny_llama": lambda: _tiny("tiny_llama", pattern="SS", positions="rope", num_kv_heads=2),  # RoPE GQA, SwiGLU
    "tiny_linear": lambda: _tiny("tiny_linear", pattern="LL", conv_size=0),
    "tiny_deltanet": lambda: _tiny("tiny_deltanet", pattern="DD"),
    "tiny_gdn": lambda: _tiny("tiny_gdn", pattern="GG"),
    "tiny_kda": lambda: _tiny("tiny_kda", pattern="KK"),
    "tiny_mla": lambda: _tiny("tiny_mla", pattern="MM", **_TINY_MLA),
    "tiny_kimi_linear": lambda: _tiny("tiny_kimi_linear", pattern="KKKM" * 2, attnres_block=4, **_TINY_MLA, **_TINY_MOE),
    "tiny_k3": lambda: _tiny("tiny_k3", pattern="KKKM" * 3 + "M", ffn_kind="situ", moe_activation="situ",
                             moe_latent_dim=32, shared_hidden=48, q_lora_rank=24, mla_output_gate=True,
                             kda_gate="bounded", kda_output_gate="full", attnres_block=4,
                             **_TINY_MLA, **dict(_TINY_MOE, num_shared_experts=2)),
}


def config_names() -> list[str]:
    return sorted(CONFIGS)


def get_config(name: str, /, **overrides: Any) -> ModelConfig:
    """The named config, optionally with field overrides (validated; ``name=`` among them renames the copy)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; valid names: {config_names()}")
    cfg = CONFIGS[name]()
    return cfg.replace(**overrides) if overrides else cfg
