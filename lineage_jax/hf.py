"""Hugging Face checkpoints in and out: GPT-2, Kimi Linear and DeepSeek-V3.

``load(path)`` reads a directory in the ``transformers`` layout — ``config.json`` plus
``model.safetensors`` or shards listed by ``model.safetensors.index.json`` — and returns a
:class:`~lineage_jax.models.Decoder` whose ``model(tokens)`` gives the logits ``transformers``
gives; ``save(model, path)`` writes one back in the same layout.

* **Config.** ``config.json`` maps to a :class:`~lineage_jax.models.ModelConfig`
  (:func:`config_from_hf`); anything the Decoder cannot represent (a bias on the attention, a
  non-SiLU activation, unnormalised routing weights, a RoPE scaling other than YaRN, …) raises
  :class:`HFError` naming the field.
* **Tensors.** Every parameter of the Decoder is made from named checkpoint tensors by one rule
  (transpose ``nn.Linear``'s ``[out, in]`` to ``[in, out]``, split heads, reverse the conv taps,
  stack experts, permute DeepSeek's interleaved rotary channels to the half-split layout);
  ``save`` runs the same rules backwards.
* **Streaming.** Before a byte of data is read, the safetensors headers are checked: every shard
  present, every expected tensor present with the expected shape and a handled dtype, no
  unexpected tensor. Then each parameter is built by ``jax.make_array_from_callback`` from the
  tensors it needs, read one at a time with ``safetensors`` in numpy (no torch), and placed
  straight into its sharding on ``mesh`` (``lineage_jax.parallel`` rules); for routed experts
  each device reads only its own experts. Host memory peaks at about one layer's largest
  parameter, not the checkpoint.

Supported: ``GPT2LMHeadModel``, ``KimiLinearForCausalLM`` and ``DeepseekV3ForCausalLM``
(``transformers`` >= 5.17 names; the ``mlp`` / ``block_sparse_moe`` spellings and fused
``experts.gate_up_proj`` / ``experts.down_proj`` tensors are read too). DeepSeek-V3's
multi-token-prediction layers are not part of the Decoder and are skipped with a warning;
FP8 checkpoints must be dequantized first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineage_jax.layers.common import yarn_mscale
from lineage_jax.memory._validate import is_int, require_positive_int
from lineage_jax.models.config import ModelConfig
from lineage_jax.models.decoder import Decoder

FAMILIES = ("gpt2", "kimi_linear", "deepseek_v3")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "kimi_linear": "KimiLinearForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> numpy dtype of the floats we read (BF16 through ml_dtypes, which jax ships).
_FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
try:  # pragma: no branch
    import ml_dtypes
    _FLOAT_DTYPES["BF16"] = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    pass


class HFError(ValueError):
    """A checkpoint we cannot load or a model we cannot save, with the file, field or tensor named."""


# ============================================================================ config.json
def _get(hf: dict, *names, default=None):
    for n in names:
        if n in hf and hf[n] is not None:
            return hf[n]
    return default


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise HFError(f"config.json: `{field}` {message}")


_MISSING = object()


def _number(hf: dict, names: tuple, default, kind: type, where: str):
    """The first of ``names`` set (not None) in ``hf`` as ``kind`` (int or float), else ``default``;
    :class:`HFError` naming the field when it is required and absent or of the wrong type."""
    for name in names:
        if name in hf and hf[name] is not None:
            value = hf[name]
            break
    else:
        _require(default is not _MISSING, where + names[0], "is missing")
        return default
    if kind is int:
        ok = is_int(value) or (isinstance(value, float) and value.is_integer())
    else:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    _require(ok, where + name, f"must be {'an integer' if kind is int else 'a finite number'}, got {value!r}")
    return kind(value)


def _int(hf: dict, *names: str, default=_MISSING, where: str = ""):
    return _number(hf, names, default, int, where)


def _float(hf: dict, *names: str, default=_MISSING, where: str = ""):
    return _number(hf, names, default, float, where)


def _count(hf: dict, *names: str, default=_MISSING, where: str = ""):
    """A size (layers, heads, widths, positions): an integer >= 1."""
    value = _int(hf, *names, default=default, where=where)
    present = next((n for n in names if hf.get(n) is not None), names[0])
    _require(value is None or value >= 1, where + present, f"must be >= 1, got {value!r}")
    return value


def _bool(hf: dict, name: str, default: bool, where: str = "") -> bool:
    """A flag: a JSON ``true`` / ``false`` (a string such as "false" is refused, not read as True)."""
    value = hf.get(name)
    if value is None:
        return default
    _require(isinstance(value, bool), where + name, f"must be true or false, got {value!r}")
    return value


def _model(**fields) -> ModelConfig:
    """The ModelConfig a config.json describes; what the Decoder cannot build (e.g. heads that do not divide
    the width) is an :class:`HFError` that says it comes from config.json."""
    try:
        return ModelConfig(**fields)
    except HFError:
        raise
    except ValueError as e:
        raise HFError(f"config.json describes a model the Decoder cannot build: {e}") from None


def _section(hf: dict, *names: str) -> tuple[str, dict]:
    """The first of ``names`` set in ``hf`` (a nested object, e.g. ``rope_parameters``) and its dict."""
    for name in names:
        if hf.get(name) is not None:
            _require(isinstance(hf[name], dict), name, f"must be an object, got {hf[name]!r}")
            return name, hf[name]
    return names[0], {}


def family_of_hf(hf: dict) -> str:
    """The family (``FAMILIES``) of a ``config.json`` dict, from ``model_type`` / ``architectures``."""
    mt = hf.get("model_type")
    if mt in FAMILIES:
        return mt
    archs = hf.get("architectures") or []
    _require(isinstance(archs, list), "architectures", f"must be a list of class names, got {archs!r}")
    for fam, arch in ARCHITECTURES.items():
        if arch in archs:
            return fam
    raise HFError(f"config.json: unsupported architecture (model_type={mt!r}, architectures={archs!r}); "
                  f"supported: {', '.join(f'{f} ({a})' for f, a in ARCHITECTURES.items())}")


def _first_dense(hf: dict, n_layers: int, default: int) -> int:
    types = hf.get("mlp_layer_types")
    if types is None:
        return _int(hf, "first_k_dense_replace", default=default)
    _require(isinstance(types, list), "mlp_layer_types", f"must be a list, got {types!r}")
    _require(len(types) == n_layers, "mlp_layer_types", f"has {len(types)} entries for {n_layers} layers")
    bad = sorted(set(types) - {"dense", "sparse"})
    _require(not bad, "mlp_layer_types", f"holds unknown types {bad}")
    first = types.index("sparse") if "sparse" in types else n_layers
    _require(all(t == "sparse" for t in types[first:]), "mlp_layer_types",
             "must be dense layers first, then MoE layers (the Decoder's first_dense_layers)")
    return first


def _moe_fields(hf: dict, n_layers: int, first_dense: int) -> dict:
    experts = _int(hf, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    if experts == 0 or first_dense >= n_layers:
        return dict(first_dense_layers=first_dense)
    _require(_get(hf, "norm_topk_prob", "moe_renormalize", default=True) is True, "norm_topk_prob",
             "False (unnormalised routing weights) is not supported")
    act = _get(hf, "moe_router_activation_func", default="sigmoid")
    _require(act == "sigmoid", "moe_router_activation_func", f"must be 'sigmoid', got {act!r}")
    shared = _int(hf, "n_shared_experts", "num_shared_experts", default=0)
    return dict(first_dense_layers=first_dense, num_experts=experts,
                top_k=_int(hf, "num_experts_per_tok", "num_experts_per_token"),
                moe_hidden=_int(hf, "moe_intermediate_size"), num_shared_experts=shared,
                routed_scaling_factor=_float(hf, "routed_scaling_factor", default=1.0),
                n_group=_int(hf, "n_group", "num_expert_group", default=1),
                topk_group=_int(hf, "topk_group", default=1))


def _mla_fields(hf: dict) -> dict:
    heads = _int(hf, "num_attention_heads")
    kv = _get(hf, "num_key_value_heads", default=heads)
    _require(kv == heads, "num_key_value_heads", f"must equal num_attention_heads={heads} for MLA, got {kv}")
    _require(not hf.get("attention_bias", False), "attention_bias", "True is not supported (MLA has no biases)")
    return dict(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=_int(hf, "kv_lora_rank"),
                qk_nope_head_dim=_int(hf, "qk_nope_head_dim"), qk_rope_head_dim=_int(hf, "qk_rope_head_dim"),
                v_head_dim=_int(hf, "v_head_dim"))


def _rope_fields(hf: dict, qk_head_dim: int) -> dict:
    section, params = _section(hf, "rope_parameters", "rope_scaling")
    where = section + "."
    theta = _float(params, "rope_theta", where=where, default=None)
    theta = _float(hf, "rope_theta", default=10000.0) if theta is None else theta
    kind = _get(params, "rope_type", "type", default="default")
    out = dict(rope_theta=theta)
    if kind == "default":
        return out
    _require(kind == "yarn", "rope_parameters.rope_type", f"{kind!r} is not supported (only 'default' and 'yarn')")
    orig = _int(params, "original_max_position_embeddings", where=where, default=None)
    orig = _int(hf, "original_max_position_embeddings", "max_position_embeddings") if orig is None else orig
    _require(orig > 0, where + "original_max_position_embeddings", f"must be positive, got {orig}")
    factor = _float(params, "factor", where=where, default=None)
    factor = _int(hf, "max_position_embeddings") / orig if factor is None else factor
    mscale = _float(params, "mscale", where=where, default=None)
    mscale_all = _float(params, "mscale_all_dim", where=where, default=None)
    attention_factor = _float(params, "attention_factor", where=where, default=None)
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor))
    out.update(rope_scaling="yarn", rope_factor=factor, rope_original_max_len=orig,
               rope_beta_fast=_float(params, "beta_fast", where=where, default=0.0) or 32.0,
               rope_beta_slow=_float(params, "beta_slow", where=where, default=0.0) or 1.0,
               rope_attention_factor=float(attention_factor),
               rope_truncate=_bool(params, "truncate", True, where=where))
    if mscale_all:
        out["mla_softmax_scale"] = qk_head_dim ** -0.5 * yarn_mscale(factor, mscale_all) ** 2
    return out


def _with_dtype(cfg: ModelConfig, dtype: Optional[str]) -> ModelConfig:
    return cfg if dtype is None else cfg.replace(dtype=dtype)


def config_from_hf(hf: dict, *, dtype: Optional[str] = None) -> tuple[ModelConfig, str]:
    """A ``config.json`` dict -> ``(ModelConfig, family)``.

    Raises :class:`HFError` naming the field for an unsupported architecture or any setting the
    Decoder cannot represent. ``dtype`` sets ``ModelConfig.dtype`` (the activations).
    """
    family = family_of_hf(hf)
    act = _get(hf, "hidden_act", "activation_function")
    if family == "gpt2":
        _require(act in ("gelu_new", "gelu_pytorch_tanh"), "activation_function",
                 f"must be 'gelu_new' (tanh GELU), got {act!r}")
        for field, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            _require(hf.get(field, want) == want, field, f"must be {want}, got {hf.get(field)!r}")
        d = _count(hf, "n_embd")
        cfg = _model(name="hf_gpt2", vocab_size=_count(hf, "vocab_size"), d_model=d,
                     pattern="S" * _count(hf, "n_layer"), num_heads=_count(hf, "n_head"), positions="learned",
                     max_seq_len=_count(hf, "n_positions"), norm="layernorm",
                     norm_eps=_float(hf, "layer_norm_epsilon", default=1e-5),
                     tie_embeddings=_bool(hf, "tie_word_embeddings", True), attn_bias=True,
                     ffn_kind="gelu", ffn_hidden=_int(hf, "n_inner", default=0) or 4 * d)
        return _with_dtype(cfg, dtype), family
    _require(act == "silu", "hidden_act", f"must be 'silu', got {act!r}")
    n = _count(hf, "num_hidden_layers")
    eps = _float(hf, "rms_norm_eps", default=1e-6)
    common = dict(vocab_size=_count(hf, "vocab_size"), d_model=_count(hf, "hidden_size"),
                  num_heads=_count(hf, "num_attention_heads"), norm="rmsnorm", norm_eps=eps,
                  tie_embeddings=_bool(hf, "tie_word_embeddings", False), ffn_kind="swiglu",
                  ffn_hidden=_count(hf, "intermediate_size"),
                  max_seq_len=_count(hf, "max_position_embeddings", "model_max_length", default=4096))
    if family == "kimi_linear":
        _, lin = _section(hf, "linear_attn_config")
        types = hf.get("layer_types")
        if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
            for key in ("full_attn_layers", "kda_layers"):
                layers = lin[key]
                _require(isinstance(layers, list) and all(is_int(i) and 1 <= i <= n for i in layers),
                         f"linear_attn_config.{key}", f"must list layer numbers 1..{n}, got {layers!r}")
            types = [None] * n
            for i in lin["full_attn_layers"]:
                types[i - 1] = "full_attention"
            for i in lin["kda_layers"]:
                types[i - 1] = "linear_attention"
        if types is None:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        _require(len(types) == n and set(types) <= {"full_attention", "linear_attention"}, "layer_types",
                 f"must give 'full_attention' or 'linear_attention' for each of {n} layers, got {types!r}")
        pattern = "".join("M" if t == "full_attention" else "K" for t in types)
        heads = _int(lin, "num_heads", where="linear_attn_config.", default=None)
        heads = _int(hf, "linear_num_heads", default=32) if heads is None else heads
        _require("K" not in pattern or heads == common["num_heads"], "linear_num_heads",
                 f"({heads}) must equal num_attention_heads ({common['num_heads']}): the Decoder has one head count")
        conv = _int(lin, "short_conv_kernel_size", where="linear_attn_config.", default=None)
        conv = _int(hf, "linear_conv_kernel_dim", default=4) if conv is None else conv
        _require(conv >= 2, "linear_conv_kernel_dim", f"must be >= 2, got {conv}")
        first = _first_dense(hf, n, 1)
        head_dim = _int(lin, "head_dim", where="linear_attn_config.", default=None)
        head_dim = _int(hf, "linear_head_dim", default=128) if head_dim is None else head_dim
        cfg = _model(name="hf_kimi_linear", pattern=pattern, head_dim=head_dim,
                     conv_size=conv, kda_gate="softplus", kda_output_gate="lowrank", mixer_norm_eps=eps,
                     mla_rope=False, **_mla_fields(hf), **_moe_fields(hf, n, first), **common)
        return _with_dtype(cfg, dtype), family
    # deepseek_v3
    mla = _mla_fields(hf)
    first = _first_dense(hf, n, 3)
    cfg = _model(name="hf_deepseek_v3", pattern="M" * n, head_dim=mla["v_head_dim"], mla_rope=True,
                 **_rope_fields(hf, mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]), **mla,
                 **_moe_fields(hf, n, first), **common)
    return _with_dtype(cfg, dtype), family


def family_of(cfg: ModelConfig) -> str:
    """The family whose ``transformers`` layout can hold a model of ``cfg`` (else :class:`HFError`)."""
    p = set(cfg.pattern)
    if p == {"S"} and cfg.positions == "learned" and cfg.norm == "layernorm" and cfg.ffn_kind == "gelu" \
            and cfg.attn_bias and cfg.num_experts == 0 and cfg.num_kv_heads in (None, cfg.num_heads) \
            and not cfg.attnres_block and cfg.resolved_head_dim * cfg.num_heads == cfg.d_model:
        return "gpt2"
    if cfg.norm == "rmsnorm" and cfg.ffn_kind == "swiglu" and not cfg.attnres_block and cfg.positions == "none" \
            and cfg.moe_latent_dim is None and cfg.moe_activation == "swiglu" and not cfg.mla_output_gate:
        if p <= {"K", "M"} and "K" in p and not cfg.mla_rope and cfg.kda_gate == "softplus" \
                and cfg.kda_output_gate == "lowrank" and cfg.kda_gate_rank in (None, cfg.resolved_head_dim) \
                and cfg.conv_size >= 2 and cfg.rope_scaling == "none" and cfg.mla_softmax_scale is None:
            return "kimi_linear"
        if p == {"M"} and cfg.mla_rope:
            return "deepseek_v3"
    raise HFError(f"ModelConfig {cfg.name!r} (pattern {cfg.pattern!r}) has no transformers layout here: "
                  "supported are GPT-2 (S layers, learned positions, LayerNorm, GELU, heads of d_model / num_heads, "
                  "plain residual), Kimi Linear (K and M layers, NoPE MLA at its default softmax scale, SwiGLU, "
                  "plain residual) and DeepSeek-V3 (M layers with RoPE)")


def config_to_hf(cfg: ModelConfig) -> dict:
    """``cfg`` -> the ``config.json`` dict ``transformers`` builds the same model from."""
    family = family_of(cfg)
    out: dict[str, Any] = {"architectures": [ARCHITECTURES[family]], "model_type": family, "dtype": "float32",
                           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
                           # The Decoder knows no special tokens; transformers' defaults may exceed the vocabulary.
                           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    L = cfg.num_layers
    if family == "gpt2":
        out.update(n_embd=cfg.d_model, n_layer=L, n_head=cfg.num_heads, n_positions=cfg.max_seq_len,
                   n_inner=cfg.ffn_hidden, activation_function="gelu_new",
                   layer_norm_epsilon=1e-5 if cfg.norm_eps is None else cfg.norm_eps)
        return out
    out.update(hidden_size=cfg.d_model, num_hidden_layers=L, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_heads, hidden_act="silu", intermediate_size=cfg.ffn_hidden,
               rms_norm_eps=1e-6 if cfg.norm_eps is None else cfg.norm_eps, attention_bias=False,
               max_position_embeddings=cfg.max_seq_len, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
               qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
               v_head_dim=cfg.v_head_dim, norm_topk_prob=True)
    if cfg.num_experts:
        if cfg.shared_hidden is not None and cfg.shared_hidden != cfg.moe_hidden * cfg.num_shared_experts:
            raise HFError("ModelConfig.shared_hidden: transformers' shared experts are "
                          "moe_hidden × num_shared_experts wide")
        out.update(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                   moe_intermediate_size=cfg.moe_hidden, n_shared_experts=cfg.num_shared_experts,
                   routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group, topk_group=cfg.topk_group)
    if family == "kimi_linear":
        if cfg.num_v_heads not in (None, cfg.num_heads):
            raise HFError(f"ModelConfig.num_v_heads ({cfg.num_v_heads}): Kimi Linear's KDA has one value head per "
                          f"query/key head ({cfg.num_heads})")
        for field, why in (("allow_neg_eigval", "Kimi Linear's β is σ(·) in (0, 1)"),
                           ("kda_output_gate_bias", "Kimi Linear's low-rank output gate has no bias")):
            if getattr(cfg, field):
                raise HFError(f"ModelConfig.{field}=True has no Kimi Linear layout: {why}, and a checkpoint "
                              "saved without it would load as another model")
        if cfg.mixer_norm_eps != out["rms_norm_eps"]:
            raise HFError(f"ModelConfig.mixer_norm_eps ({cfg.mixer_norm_eps}) must equal norm_eps: Kimi Linear "
                          "has one rms_norm_eps")
        out.pop("max_position_embeddings")
        n_routed = out.pop("n_routed_experts", 0)
        out.update(layer_types=["full_attention" if c == "M" else "linear_attention" for c in cfg.pattern],
                   mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(L)],
                   linear_head_dim=cfg.resolved_head_dim, linear_num_heads=cfg.num_heads,
                   linear_conv_kernel_dim=cfg.conv_size, num_local_experts=n_routed,
                   model_max_length=cfg.max_seq_len)
        return out
    # deepseek_v3: scores scale (n + r)^-0.5 · mscale(factor, mscale_all_dim)²; solve for mscale_all_dim.
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_factor, original_max_position_embeddings=cfg.rope_original_max_len,
                    beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                    attention_factor=cfg.rope_attention_factor, truncate=cfg.rope_truncate)
        if cfg.mla_softmax_scale is not None:
            m = math.sqrt(cfg.mla_softmax_scale * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** 0.5)
            if cfg.rope_factor <= 1 or m < 1:
                raise HFError("ModelConfig.mla_softmax_scale: DeepSeek-V3 can only raise the softmax scale by "
                              "YaRN's mscale² (rope_factor > 1)")
            rope.update(mscale=1.0, mscale_all_dim=(m - 1) / (0.1 * math.log(cfg.rope_factor)))
    elif cfg.mla_softmax_scale is not None:
        raise HFError("ModelConfig.mla_softmax_scale: DeepSeek-V3 sets the softmax scale only through YaRN")
    out.update(rope_parameters=rope, rope_interleave=True, first_k_dense_replace=cfg.first_dense_layers,
               num_nextn_predict_layers=0)
    if not cfg.num_experts:
        out["first_k_dense_replace"] = L
    return out


# ============================================================================ safetensors files
class Checkpoint:
    """The safetensors tensors of a checkpoint directory (one file or an index of shards).

    Construction reads only the headers (names, dtypes, shapes) and fails if a shard the index
    names is missing; :meth:`read` reads one tensor with ``safetensors`` (numpy framework).
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            content = _read_json(index)
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFError(f"{index}: no `weight_map`")
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
                    raise HFError(f"{index}: `weight_map` maps tensor {name!r} to {fname!r}, "
                                  "which is not a file name in the checkpoint directory")
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, SINGLE_FILE)):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise HFError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise HFError(f"{path}: missing shard(s) {missing} listed in {INDEX_FILE}")
        self.headers: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (file, dtype, shape)
        for fname in files:
            for name, (dt, shape) in _read_header(os.path.join(path, fname)).items():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue  # the index decides which file holds a tensor
                self.headers[name] = (fname, dt, shape)
        if weight_map is not None:
            absent = sorted(n for n in weight_map if n not in self.headers)
            if absent:
                raise HFError(f"{path}: tensor {absent[0]!r} is listed in {INDEX_FILE} under "
                              f"{weight_map[absent[0]]!r} but that file does not hold it")
        self._open: dict[str, Any] = {}

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self.headers)

    def check(self, name: str, shape: Sequence[int]) -> None:
        """Raise :class:`HFError` unless tensor ``name`` exists with ``shape`` and a handled dtype."""
        if name not in self.headers:
            raise HFError(f"{self.path}: tensor {name!r} is missing (the config needs it)")
        fname, dt, got = self.headers[name]
        if tuple(got) != tuple(shape):
            raise HFError(f"{os.path.join(self.path, fname)}: tensor {name!r} has shape {list(got)}, "
                          f"the config implies {list(shape)}")
        if dt not in _FLOAT_DTYPES:
            raise HFError(f"{os.path.join(self.path, fname)}: tensor {name!r} has dtype {dt}, which is not handled "
                          f"(handled: {', '.join(_FLOAT_DTYPES)}; dequantize FP8 checkpoints first)")

    def read(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        """Tensor ``name`` as float32 numpy (only ``rows`` of its first axis when given); a tensor holding NaN
        or infinite values is an :class:`HFError` naming it (a damaged file, or weights that diverged)."""
        fname, dt, shape = self.headers[name]
        full = os.path.join(self.path, fname)
        if dt == "BF16":
            a = _read_raw(full, name, rows).astype(np.float32)
        else:
            if fname not in self._open:
                from safetensors import safe_open
                self._open[fname] = safe_open(full, framework="numpy")
            f = self._open[fname]
            a = np.asarray(f.get_tensor(name) if rows is None else f.get_slice(name)[rows], dtype=np.float32)
        if not np.isfinite(a).all():
            raise HFError(f"{full}: tensor {name!r} holds {int(a.size - np.isfinite(a).sum())} NaN or infinite "
                          "values")
        return a

    def close(self) -> None:
        """Drop the open file handles."""
        self._open.clear()


def _read_header(file: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Names, dtypes and shapes of a safetensors file; :class:`HFError` naming the file (and tensor)
    unless the header is well formed and the file holds every byte it lists."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HFError(f"{file}: not a safetensors file (too short)")
        n = int.from_bytes(raw, "little")
        if n > size - 8:
            raise HFError(f"{file}: not a safetensors file (header of {n} bytes in a file of {size}; truncated?)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise HFError(f"{file}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise HFError(f"{file}: not a safetensors file (the header is not a JSON object)")
    data = size - 8 - n
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
              and all(is_int(d) and d >= 0 for d in v["shape"]) and isinstance(v.get("data_offsets"), list)
              and len(v["data_offsets"]) == 2 and all(is_int(o) for o in v["data_offsets"]))
        if not ok:
            raise HFError(f"{file}: tensor {name!r} has a malformed header entry {v!r}")
        begin, end = v["data_offsets"]
        if not 0 <= begin <= end <= data:
            raise HFError(f"{file}: tensor {name!r} lies at bytes [{begin}, {end}) but the file holds only {data} "
                          "bytes of data (truncated or corrupt)")
        if v["dtype"] in _FLOAT_DTYPES:
            want = math.prod(v["shape"]) * np.dtype(_FLOAT_DTYPES[v["dtype"]]).itemsize
            if end - begin != want:
                raise HFError(f"{file}: tensor {name!r} ({v['dtype']} {v['shape']}) needs {want} bytes, "
                              f"the header gives it {end - begin}")
        out[name] = (v["dtype"], tuple(v["shape"]))
    return out


def _read_raw(file: str, name: str, rows: Optional[slice]) -> np.ndarray:
    """One tensor read from the file's byte offsets (dtypes numpy lacks, e.g. BF16)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
        begin, end = info["data_offsets"]
        f.seek(8 + n + begin)
        a = np.frombuffer(f.read(end - begin), dtype=_FLOAT_DTYPES[info["dtype"]]).reshape(info["shape"])
    return a if rows is None else a[rows]


def _write(tensors: dict[str, np.ndarray], path: str, max_shard_bytes: Optional[int]) -> list[str]:
    from safetensors.numpy import save_file
    names = sorted(tensors)
    shards, size = [[]], 0
    for n in names:
        b = tensors[n].nbytes
        if max_shard_bytes and shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, group in zip(files, shards):
        save_file({n: np.ascontiguousarray(tensors[n]) for n in group}, os.path.join(path, fname),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                 "weight_map": {n: f for f, g in zip(files, shards) for n in g}}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    return files


# ============================================================================ tensor rules
@dataclasses.dataclass
class _Rule:
    """One parameter of the Decoder (``ours``: its path inside a layer, or from the model root)
    made from checkpoint tensors ``names`` of ``shapes``: ``load(read) -> array`` where
    ``read(i, rows=None)`` reads ``names[i]``; ``save(array) -> arrays`` (one per name).
    ``experts``: the rule stacks one tensor per routed expert along axis 0 (read per expert)."""

    ours: tuple
    names: tuple
    shapes: tuple
    load: Callable
    save: Callable
    experts: bool = False


def _linear(ours, name, din: int, out: Sequence[int], perm: Optional[np.ndarray] = None) -> _Rule:
    """``nn.Linear`` weight ``[prod(out), in]`` -> kernel ``[in, *out]`` (``perm`` reorders the last axis)."""
    out = tuple(out)
    inv = None if perm is None else np.argsort(perm)

    def load(read):
        k = read(0).T.reshape(din, *out)
        return k if perm is None else k[..., perm]

    def save(k):
        k = k if inv is None else k[..., inv]
        return (k.reshape(din, -1).T,)

    return _Rule(ours, (name,), ((int(np.prod(out)), din),), load, save)


def _copy(ours, name, hf_shape, our_shape) -> _Rule:
    return _Rule(ours, (name,), (tuple(hf_shape),), lambda read: read(0).reshape(our_shape),
                 lambda a: (np.asarray(a).reshape(hf_shape),))


def _experts(ours, names: Sequence[str], hf_shape, transpose: bool) -> _Rule:
    """One ``[out, in]`` tensor per expert -> ``[E, in, out]`` (``transpose``) stacked on axis 0."""
    def load(read, sel=slice(None)):
        idx = range(len(names))[sel]
        return np.stack([read(e).T if transpose else read(e) for e in idx])

    def save(a):
        return tuple(a[e].T if transpose else a[e] for e in range(a.shape[0]))

    return _Rule(ours, tuple(names), tuple(tuple(hf_shape) for _ in names), load, save, experts=True)


def _fused_experts(ours, name, E, hf_shape, part: Optional[int], width: int) -> _Rule:
    """transformers' fused ``experts.gate_up_proj [E, 2I, D]`` (``part`` 0: gate, 1: up) or
    ``experts.down_proj [E, D, I]`` (``part`` None) -> ``[E, in, out]``."""
    def load(read, sel=slice(None)):
        a = read(0, rows=sel)
        if part is not None:
            a = a[:, part * width:(part + 1) * width]
        return np.transpose(a, (0, 2, 1))

    return _Rule(ours, (name,), (tuple(hf_shape),), load, None, experts=True)


def _rope_perm(cfg: ModelConfig, interleave: bool) -> Optional[np.ndarray]:
    """Channel order turning DeepSeek's interleaved rope pairs ``(2i, 2i+1)`` into half-split ones."""
    if not interleave:
        return None
    r = cfg.qk_rope_head_dim
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def _gpt2_rules(cfg: ModelConfig, i: int, prefix: str) -> list[_Rule]:
    D, H, hd, I = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.ffn_hidden
    p = f"{prefix}h.{i}."
    rules = [_copy(("norm1", "scale"), p + "ln_1.weight", (D,), (D,)), _copy(("norm1", "bias"), p + "ln_1.bias", (D,), (D,)),
             _copy(("norm2", "scale"), p + "ln_2.weight", (D,), (D,)), _copy(("norm2", "bias"), p + "ln_2.bias", (D,), (D,))]
    for j, part in enumerate("qkv"):  # Conv1D c_attn: weight [D, 3D] (already [in, out]), bias [3D]
        rules.append(_Rule(("mixer", part, "kernel"), (p + "attn.c_attn.weight",), ((D, 3 * D),),
                           lambda read, j=j: read(0)[:, j * D:(j + 1) * D].reshape(D, H, hd), None))
        rules.append(_Rule(("mixer", part, "bias"), (p + "attn.c_attn.bias",), ((3 * D,),),
                           lambda read, j=j: read(0)[j * D:(j + 1) * D].reshape(H, hd), None))
    rules += [_copy(("mixer", "o"), p + "attn.c_proj.weight", (D, D), (H, hd, D)),
              _copy(("mixer", "o_bias"), p + "attn.c_proj.bias", (D,), (D,)),
              _copy(("ffn", "up", "kernel"), p + "mlp.c_fc.weight", (D, I), (D, I)),
              _copy(("ffn", "up", "bias"), p + "mlp.c_fc.bias", (I,), (I,)),
              _copy(("ffn", "down", "kernel"), p + "mlp.c_proj.weight", (I, D), (I, D)),
              _copy(("ffn", "down", "bias"), p + "mlp.c_proj.bias", (D,), (D,))]
    return rules


def _mlp_rules(ours: tuple, p: str, D: int, I: int) -> list[_Rule]:
    return [_linear(ours + ("gate", "kernel"), p + "gate_proj.weight", D, (I,)),
            _linear(ours + ("up", "kernel"), p + "up_proj.weight", D, (I,)),
            _linear(ours + ("down", "kernel"), p + "down_proj.weight", I, (D,))]


def _ffn_rules(cfg: ModelConfig, i: int, p: str, family: str, names: set) -> list[_Rule]:
    D = cfg.d_model
    if not cfg.is_moe(i):
        mp = p + "mlp."
        if family == "kimi_linear" and not any(n.startswith(mp) for n in names):
            mp = p + "block_sparse_moe."
        return _mlp_rules(("ffn",), mp, D, cfg.ffn_hidden)
    mp = p + "mlp."
    if family == "kimi_linear" and not any(n.startswith(mp) for n in names):
        mp = p + "block_sparse_moe."
    E, I = cfg.num_experts, cfg.moe_hidden
    rules = [_linear(("ffn", "router"), mp + "gate.weight", D, (E,)),
             _copy(("ffn", "router_bias"), mp + "gate.e_score_correction_bias", (E,), (E,))]
    if mp + "experts.gate_up_proj" in names:  # transformers' fused in-memory layout
        rules += [_fused_experts(("ffn", "w_gate"), mp + "experts.gate_up_proj", E, (E, 2 * I, D), 0, I),
                  _fused_experts(("ffn", "w_up"), mp + "experts.gate_up_proj", E, (E, 2 * I, D), 1, I),
                  _fused_experts(("ffn", "w_down"), mp + "experts.down_proj", E, (E, D, I), None, D)]
    else:
        g, u, d = ("w1", "w3", "w2") if family == "kimi_linear" else ("gate_proj", "up_proj", "down_proj")
        rules += [_experts(("ffn", "w_gate"), [f"{mp}experts.{e}.{g}.weight" for e in range(E)], (I, D), True),
                  _experts(("ffn", "w_up"), [f"{mp}experts.{e}.{u}.weight" for e in range(E)], (I, D), True),
                  _experts(("ffn", "w_down"), [f"{mp}experts.{e}.{d}.weight" for e in range(E)], (D, I), True)]
    if cfg.num_shared_experts:
        rules += _mlp_rules(("ffn", "shared"), mp + "shared_experts.", D, I * cfg.num_shared_experts)
    return rules


def _kda_rules(cfg: ModelConfig, p: str, names: set) -> list[_Rule]:
    D, H, K, W = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.conv_size
    C = H * K
    rules = [_linear(("mixer", x, "kernel"), f"{p}{x}_proj.weight", D, (H, K)) for x in "qkv"]
    # Depthwise conv: q/k/v_conv1d.weight [C, 1, W] (tap W-1 weighs the current token) -> [W, 3C] (tap 0 does).
    conv_names = tuple(f"{p}{x}_conv1d.weight" for x in "qkv")
    rules.append(_Rule(("mixer", "conv"), conv_names, ((C, 1, W),) * 3,
                       lambda read: np.concatenate([read(j) for j in range(3)], 0)[:, 0, ::-1].T.copy(),
                       lambda a: tuple(np.ascontiguousarray(a[::-1, j * C:(j + 1) * C].T[:, None, :]) for j in range(3))))
    fg = p if p + "f_a_proj.weight" in names or p + "forget_gate.f_a_proj.weight" not in names else p + "forget_gate."
    rank = cfg.kda_gate_rank or K
    rules += [_linear(("mixer", "gate_a", "kernel"), fg + "f_a_proj.weight", D, (rank,)),
              _linear(("mixer", "gate_b", "kernel"), fg + "f_b_proj.weight", rank, (H, K)),
              _copy(("mixer", "dt_bias"), fg + "dt_bias", (C,), (H, K)),
              _copy(("mixer", "A_log"), fg + "A_log", (1, 1, H, 1), (H,)),
              _linear(("mixer", "beta", "kernel"), p + "b_proj.weight", D, (H,)),
              _linear(("mixer", "out_gate_a", "kernel"), p + "g_a_proj.weight", D, (K,)),
              _linear(("mixer", "out_gate", "kernel"), p + "g_b_proj.weight", K, (H, K)),
              _copy(("mixer", "norm", "scale"), p + "o_norm.weight", (K,), (K,)),
              _Rule(("mixer", "o"), (p + "o_proj.weight",), ((D, C),), lambda read: read(0).T.reshape(H, K, D),
                    lambda a: (np.asarray(a).reshape(C, D).T,))]
    return rules


def _mla_rules(cfg: ModelConfig, p: str, perm: Optional[np.ndarray]) -> list[_Rule]:
    D, H = cfg.d_model, cfg.num_heads
    n, r, v, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qperm = None if perm is None else np.concatenate([np.arange(n), n + perm])
    rules = []
    if cfg.q_lora_rank is None:
        rules.append(_linear(("mixer", "wq", "kernel"), p + "q_proj.weight", D, (H, n + r), qperm))
    else:
        Q = cfg.q_lora_rank
        rules += [_linear(("mixer", "wq_down", "kernel"), p + "q_a_proj.weight", D, (Q,)),
                  _copy(("mixer", "q_norm", "scale"), p + "q_a_layernorm.weight", (Q,), (Q,)),
                  _linear(("mixer", "wq_up", "kernel"), p + "q_b_proj.weight", Q, (H, n + r), qperm)]
    kv_a = p + "kv_a_proj_with_mqa.weight"
    rperm = np.arange(r) if perm is None else perm
    rules += [_Rule(("mixer", "wkv_down", "kernel"), (kv_a,), ((C + r, D),), lambda read: read(0)[:C].T, None),
              _Rule(("mixer", "wk_rope", "kernel"), (kv_a,), ((C + r, D),), lambda read: read(0)[C:][rperm].T, None),
              _copy(("mixer", "kv_norm", "scale"), p + "kv_a_layernorm.weight", (C,), (C,)),
              _Rule(("mixer", "wk_up", "kernel"), (p + "kv_b_proj.weight",), ((H * (n + v), C),),
                    lambda read: read(0).reshape(H, n + v, C)[:, :n].transpose(2, 0, 1), None),
              _Rule(("mixer", "wv_up", "kernel"), (p + "kv_b_proj.weight",), ((H * (n + v), C),),
                    lambda read: read(0).reshape(H, n + v, C)[:, n:].transpose(2, 0, 1), None),
              _Rule(("mixer", "w_out"), (p + "o_proj.weight",), ((D, H * v),), lambda read: read(0).T.reshape(H, v, D),
                    lambda a: (np.asarray(a).reshape(H * v, D).T,))]
    return rules


def _layer_rules(cfg: ModelConfig, family: str, i: int, names: set, prefix: str, perm) -> list[_Rule]:
    if family == "gpt2":
        return _gpt2_rules(cfg, i, prefix)
    D = cfg.d_model
    p = f"model.layers.{i}."
    rules = [_copy(("norm1", "scale"), p + "input_layernorm.weight", (D,), (D,)),
             _copy(("norm2", "scale"), p + "post_attention_layernorm.weight", (D,), (D,))]
    rules += _kda_rules(cfg, p + "self_attn.", names) if cfg.pattern[i] == "K" else _mla_rules(cfg, p + "self_attn.", perm)
    return rules + _ffn_rules(cfg, i, p, family, names)


def _top_rules(cfg: ModelConfig, family: str, prefix: str) -> list[_Rule]:
    V, D = cfg.vocab_size, cfg.d_model
    if family == "gpt2":
        rules = [_copy(("embed",), prefix + "wte.weight", (V, D), (V, D)),
                 _copy(("pos",), prefix + "wpe.weight", (cfg.max_seq_len, D), (cfg.max_seq_len, D)),
                 _copy(("final_norm", "scale"), prefix + "ln_f.weight", (D,), (D,)),
                 _copy(("final_norm", "bias"), prefix + "ln_f.bias", (D,), (D,))]
    else:
        rules = [_copy(("embed",), "model.embed_tokens.weight", (V, D), (V, D)),
                 _copy(("final_norm", "scale"), "model.norm.weight", (D,), (D,))]
    if not cfg.tie_embeddings:
        rules.append(_linear(("head",), "lm_head.weight", D, (V,)))
    return rules


def _ignorable(name: str, cfg: ModelConfig, family: str) -> Optional[str]:
    """Why a checkpoint tensor the Decoder does not use may be skipped (None: it may not)."""
    if family == "gpt2" and re.search(r"\.attn\.(masked_)?bias$", name):
        return "GPT-2's causal-mask buffer"
    if name.endswith("rotary_emb.inv_freq"):
        return "a rotary-frequency buffer"
    if family == "gpt2" and name == "lm_head.weight" and cfg.tie_embeddings:
        return "the tied LM head"
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if family == "deepseek_v3" and (m and int(m.group(1)) >= cfg.num_layers or name.startswith("mtp.")):
        return "a multi-token-prediction layer"
    return None


# ============================================================================ load / save
def read_config(path: str) -> dict:
    """``path/config.json`` as a dict (:class:`HFError` if absent or not JSON)."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise HFError(f"{path}: not a directory")
    if not os.path.exists(file):
        raise HFError(f"{path}: no config.json")
    hf = _read_json(file)
    if not isinstance(hf, dict):
        raise HFError(f"{file}: must hold a JSON object, got {type(hf).__name__}")
    return hf


def _read_json(file: str):
    try:
        with open(file) as f:
            return json.load(f)
    except ValueError as e:
        raise HFError(f"{file}: not valid JSON ({e})") from None


def _layer_paths(model_or_abstract) -> dict[int, tuple[tuple, Optional[int]]]:
    """Layer index -> (path prefix of its block in the state, slice index in a scanned group or None)."""
    out = {}
    for g, (first, p, n) in enumerate(model_or_abstract.groups_spec):
        for r in range(n):
            for j in range(p):
                out[first + r * p + j] = (("groups", g, "blocks", j), None if n == 1 else r)
    return out


def _plan(cfg: ModelConfig, family: str, names: set, interleave: bool, prefix: str, abstract):
    """``{state path: (rule, [(layer slice index or None, ...)])}`` for every variable of the Decoder."""
    perm = _rope_perm(cfg, interleave) if family == "deepseek_v3" else None
    plan: dict[tuple, list] = {}
    for rule in _top_rules(cfg, family, prefix):
        plan[rule.ours] = [(None, rule)]
    for i, (block, r) in sorted(_layer_paths(abstract).items()):
        for rule in _layer_rules(cfg, family, i, names, prefix, perm):
            plan.setdefault(block + rule.ours, []).append((r, rule))
    return plan


def _hf_prefix(family: str, names: set) -> str:
    if family != "gpt2":
        return ""
    return "transformer." if any(n.startswith("transformer.") for n in names) else ""


def load(path: str, *, dtype: Optional[str] = None, mesh=None, rules=None, scan_layers: bool = True) -> Decoder:
    """A ``transformers`` checkpoint directory -> a :class:`~lineage_jax.models.Decoder` (``model.cfg``
    is its :class:`~lineage_jax.models.ModelConfig`).

    Args:
      path: a directory holding ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``).
      dtype: ``"float32"`` (default) or ``"bfloat16"``: the parameters' dtype and ``ModelConfig.dtype``.
        bfloat16 parameters halve an inference load's memory; they are not master weights
        (``TrainStep`` refuses them: load in float32 to train).
      mesh: a ``jax.sharding.Mesh``: each parameter is placed directly into its sharding under
        ``rules`` (``lineage_jax.parallel`` logical-axis rules; default ``DEFAULT_RULES``), each
        device reading only its part of the routed experts. None: one device.
      scan_layers: ``ModelConfig.scan_layers`` of the returned model (repeated layers stacked).

    Raises:
      HFError: unsupported architecture or config field, missing file or shard, missing or
        unexpected tensor, wrong shape or unhandled dtype — all checked before any data is read.
    """
    if dtype not in (None, "float32", "bfloat16"):
        raise HFError(f"load: `dtype` must be 'float32' or 'bfloat16', got {dtype!r}")
    hf = read_config(path)
    cfg, family = config_from_hf(hf, dtype=dtype)
    cfg = cfg.replace(scan_layers=scan_layers)
    ckpt = Checkpoint(path)
    names = ckpt.names()
    prefix = _hf_prefix(family, names)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    plan = _plan(cfg, family, names, bool(hf.get("rope_interleave", True)), prefix, abstract)

    # Every check before any data is read.
    state = nnx.state(abstract)
    leaves = {tuple(p): v for p, v in state.flat_state()}
    no_rule = sorted(set(leaves) - set(plan))
    if no_rule:  # a Decoder parameter no rule fills: a bug here, not in the checkpoint
        raise HFError(f"load: no checkpoint tensor maps to parameter {'/'.join(map(str, no_rule[0]))}")
    used = set()
    for entries in plan.values():
        for _, rule in entries:
            for name, shape in zip(rule.names, rule.shapes):
                ckpt.check(name, shape)
                used.add(name)
    skipped = {}
    for name in sorted(names - used):
        why = _ignorable(name, cfg, family)
        if why is None:
            fname = ckpt.headers[name][0]
            raise HFError(f"{os.path.join(path, fname)}: unexpected tensor {name!r} (the config does not use it; "
                          "a config that does not match its weights?)")
        skipped[why] = skipped.get(why, 0) + 1
    for why, count in skipped.items():
        if why == "a multi-token-prediction layer":
            warnings.warn(f"{path}: {count} tensors of DeepSeek-V3's multi-token-prediction layers are not loaded "
                          "(the Decoder has no MTP head)")

    param_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    shardings = None
    if mesh is not None:
        from lineage_jax.parallel import state_shardings
        shardings = {tuple(p): v.get_value() for p, v in state_shardings(abstract, mesh, rules).flat_state()}
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's own (jax.devices()[0] is process 0's)

    def build(key, var):
        entries = plan[key]
        shape = var.get_value().shape
        sharding = device if shardings is None else shardings[key]
        stacked = entries[0][0] is not None

        def one_layer(rule, sel):
            read = lambda j, rows=None: ckpt.read(rule.names[j], rows)
            if rule.experts:  # read only the experts this shard holds
                return rule.load(read, sel[0])[(slice(None),) + tuple(sel[1:])]
            return rule.load(read)[sel]

        def cb(index):
            index = tuple(index) + (slice(None),) * (len(shape) - len(index))
            if not stacked:
                return np.asarray(one_layer(entries[0][1], index), np.float32).astype(param_dtype)
            layers = sorted(entries, key=lambda e: e[0])[index[0]]
            return np.stack([one_layer(rule, index[1:]) for _, rule in layers]).astype(param_dtype)

        return jax.make_array_from_callback(shape, sharding, cb)

    values = {}
    try:
        for key, var in leaves.items():
            values[key] = build(key, var)
    finally:
        ckpt.close()
    for key, var in leaves.items():
        var.set_value(values[key])
    nnx.update(abstract, state)
    return abstract


def save(model: Decoder, path: str, *, max_shard_bytes: Optional[int] = None) -> list[str]:
    """Write ``model`` as a ``transformers`` checkpoint directory: ``config.json`` and float32
    ``model.safetensors`` (or shards of at most ``max_shard_bytes`` with an index). Returns the
    safetensors file names. Raises :class:`HFError` if the model has no transformers layout
    (:func:`family_of`), if ``path`` is a file or already holds a checkpoint (``config.json`` or
    safetensors files: nothing is overwritten; other files are left as they are), or if
    ``max_shard_bytes`` is not a positive int — all before anything is written."""
    if not isinstance(model, Decoder):
        raise HFError(f"save: `model` must be a lineage_jax Decoder, got {type(model).__name__}")
    if max_shard_bytes is not None:
        try:
            require_positive_int("save", "max_shard_bytes", max_shard_bytes)
        except ValueError as e:
            raise HFError(str(e)) from None
    if os.path.exists(path) and not os.path.isdir(path):
        raise HFError(f"save: `path` {path} exists and is not a directory")
    if os.path.isdir(path):
        taken = sorted(f for f in os.listdir(path) if f == "config.json" or f.endswith(".safetensors")
                       or f == INDEX_FILE)
        if taken:
            shown = ", ".join(taken[:3]) + (f", … ({len(taken)} files)" if len(taken) > 3 else "")
            raise HFError(f"save: `path` {path} already holds a checkpoint ({shown}); save into a new or "
                          "empty directory, or remove those files first")
    cfg = model.cfg
    family = family_of(cfg)
    hf = config_to_hf(cfg)
    prefix = "transformer." if family == "gpt2" else ""
    plan = _plan(cfg, family, set(), True, prefix, model)
    state = nnx.state(model)
    leaves = {tuple(p): v for p, v in state.flat_state()}
    tensors: dict[str, np.ndarray] = {}
    partial: dict[str, dict] = {}  # tensors that several parameters share (fused projections)
    for key, entries in plan.items():
        value = np.asarray(jax.device_get(leaves[key].get_value()), np.float32)
        for r, rule in entries:
            a = value if r is None else value[r]
            if rule.save is not None:
                for name, t in zip(rule.names, rule.save(a)):
                    tensors[name] = np.asarray(t, np.float32)
            else:
                partial.setdefault(rule.names[0], {})[rule.ours] = a
    for name, parts in partial.items():
        tensors[name] = _join(name, parts, cfg, family)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    return _write(tensors, path, max_shard_bytes)


def _join(name: str, parts: dict, cfg: ModelConfig, family: str) -> np.ndarray:
    """The checkpoint tensor that several Decoder parameters come from (inverse of their rules)."""
    D = cfg.d_model
    if name.endswith("attn.c_attn.weight"):
        return np.concatenate([parts[("mixer", x, "kernel")].reshape(D, D) for x in "qkv"], axis=1)
    if name.endswith("attn.c_attn.bias"):
        return np.concatenate([parts[("mixer", x, "bias")].reshape(D) for x in "qkv"])
    if name.endswith("kv_a_proj_with_mqa.weight"):
        rope = parts[("mixer", "wk_rope", "kernel")].T                     # [r, D]
        if family == "deepseek_v3":  # back to interleaved rope pairs (rope_interleave=True)
            rope = rope[np.argsort(_rope_perm(cfg, True))]
        return np.concatenate([parts[("mixer", "wkv_down", "kernel")].T, rope])
    if name.endswith("kv_b_proj.weight"):
        k, v = parts[("mixer", "wk_up", "kernel")], parts[("mixer", "wv_up", "kernel")]   # [C, H, n], [C, H, v]
        w = np.concatenate([k.transpose(1, 2, 0), v.transpose(1, 2, 0)], axis=1)         # [H, n + v, C]
        return w.reshape(-1, w.shape[-1])
    raise HFError(f"save: no inverse for tensor {name!r}")  # pragma: no cover
