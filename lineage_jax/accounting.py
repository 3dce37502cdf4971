"""Parameter, FLOP, cache and state arithmetic — from abstract shapes, never by hand.

Every count comes from the Decoder itself built under ``nnx.eval_shape`` (no
memory is allocated, so ``kimi_k3``'s 2.78T parameters cost nothing), walked with
the logical-axis metadata every parameter carries.

Definitions:

* ``total`` — every ``nnx.Param`` (router score-correction biases are buffers, not
  parameters, and are not counted).
* ``active`` — what one token touches in a forward pass: everything except the
  input embedding table and the position table (gathers, not matmuls), with routed
  experts counted at ``top_k / num_experts``. The LM head counts (also when tied).
"""

from __future__ import annotations

import functools
from typing import Union

import numpy as np
from flax import nnx

from lineage_jax.memory._validate import require_bool, require_positive_int
from lineage_jax.layers.memory_mixer import RULES
from lineage_jax.models.config import MIXERS, ModelConfig, get_config

ConfigLike = Union[ModelConfig, str]


def _cfg(config: ConfigLike, fn: str = "accounting") -> ModelConfig:
    if isinstance(config, str):
        return get_config(config)
    if not isinstance(config, ModelConfig):
        raise ValueError(f"{fn}: `config` must be a ModelConfig or a config name, got {type(config).__name__}")
    return config


@functools.lru_cache(maxsize=32)
def _param_table(config: ModelConfig) -> tuple[tuple[str, tuple[int, ...], tuple], ...]:
    from lineage_jax.models.decoder import Decoder  # local: the accountant is importable without building models

    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    rows = []
    for path, var in nnx.iter_graph(abstract):
        if isinstance(var, nnx.Param):
            axes = var.get_metadata().get("logical_axes") or ()
            rows.append(("/".join(str(p) for p in path), tuple(var.shape), tuple(axes)))
    return tuple(rows)


def param_table(config: ConfigLike) -> list[dict]:
    """One row per parameter array: ``{"path", "shape", "axes", "size", "component"}``."""
    cfg = _cfg(config, "param_table")
    return [dict(path=p, shape=s, axes=a, size=int(np.prod(s, dtype=np.int64)), component=_component(p, a))
            for p, s, a in _param_table(cfg)]


def _component(path: str, axes: tuple) -> str:
    parts = path.split("/")
    if parts[0] == "embed":
        return "embedding"
    if parts[0] == "pos":
        return "positions"
    if parts[0] == "head":
        return "lm_head"
    if "experts" in axes and "expert_mlp" in axes:
        return "routed_experts"
    if "ffn" in parts:
        if "shared" in parts:
            return "shared_experts"
        if "router" in parts:
            return "router"
        if any(p in ("down_proj", "up_proj", "latent_norm") for p in parts):
            return "moe_latent_proj"
        return "dense_ffn"
    if "mixer" in parts:
        return "mixer"
    if "res_query" in parts or parts[0] == "final_query":
        return "attnres"
    return "norms"


def component_counts(config: ConfigLike) -> dict[str, int]:
    """Parameters per component (embedding, lm_head, mixer, dense_ffn, router, routed_experts, ...)."""
    out: dict[str, int] = {}
    for row in param_table(config):
        out[row["component"]] = out.get(row["component"], 0) + row["size"]
    return out


def param_counts(config: ConfigLike) -> dict[str, int]:
    """``{"total": int, "active": int}`` (see the module docstring for what counts as active)."""
    cfg = _cfg(config, "param_counts")
    comp = component_counts(cfg)
    total = sum(comp.values())
    routed = comp.get("routed_experts", 0)
    active_routed = routed * cfg.top_k // cfg.num_experts if cfg.num_experts else 0
    active = total - comp.get("embedding", 0) - comp.get("positions", 0) - routed + active_routed
    if cfg.tie_embeddings:
        active += comp.get("embedding", 0)  # the tied table is the LM head's matmul
    return {"total": int(total), "active": int(active)}


def _count(cfg: ModelConfig, kind: str) -> int:
    return sum(1 for ch in cfg.pattern if MIXERS[ch] == kind)


def cache_bytes_per_token(config: ConfigLike, dtype_bytes: int = 2) -> int:
    """Bytes the *growing* caches add per token of context, all layers, one sequence.

    Softmax layers store a key and a value per KV head (``2 · Hkv · head_dim``);
    MLA layers store one latent plus the shared rope key (``kv_lora + rope``).
    """
    cfg = _cfg(config, "cache_bytes_per_token")
    require_positive_int("cache_bytes_per_token", "dtype_bytes", dtype_bytes)
    hkv = cfg.num_kv_heads or cfg.num_heads
    per_softmax = 2 * hkv * cfg.resolved_head_dim
    per_mla = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return int(dtype_bytes * (_count(cfg, "softmax") * per_softmax + _count(cfg, "mla") * per_mla))


def state_bytes(config: ConfigLike, dtype_bytes: int = 4, *, include_conv: bool = False) -> int:
    """Bytes of the *fixed* recurrent states of one sequence (independent of context).

    Each fixed-state layer holds ``H · K · V`` (``H``: the value heads of the delta rules;
    linear attention also its normalizer ``H · K``). With ``include_conv``, the short-conv
    buffers (``(conv_size − 1) · (2 H_qk K + H_v K)`` per layer; a normalized rule's values have
    ``H_qk`` heads) are added.
    """
    cfg = _cfg(config, "state_bytes")
    require_positive_int("state_bytes", "dtype_bytes", dtype_bytes)
    include_conv = require_bool("state_bytes", "include_conv", include_conv)
    H, K = cfg.num_heads, cfg.resolved_head_dim
    Hv = cfg.num_v_heads or H
    total = 0
    for ch in cfg.pattern:
        rule = RULES.get(MIXERS[ch])
        if rule is None:  # softmax / MLA: a growing cache, not a state
            continue
        if rule.normalize:  # S and the normalizer z, per query head
            total += H * K * K + H * K
        else:
            total += Hv * K * K
        if include_conv and rule.conv and cfg.conv_size:
            total += (cfg.conv_size - 1) * (2 * H + (H if rule.normalize else Hv)) * K
    return int(dtype_bytes * total)


def flops_per_token(config: ConfigLike, seq_len: int) -> float:
    """Forward FLOPs per token, averaged over a causal sequence of ``seq_len`` tokens.

    ``2 · active`` for the matmuls, plus what each mixer does beyond its weights:

    * softmax / MLA (expanded for training): scores and weighted values against
      ``(seq_len + 1) / 2`` keys on average: ``2 · H · (d_qk + d_v) · (seq_len + 1) / 2``;
    * fixed-state rules in chunked form (chunk ``C = min(chunk_size, seq_len)``), per
      head: state read ``2KV``, state update ``2KV`` (plus ``2KV`` for the delta
      rules' correction ``W S``), and the intra-chunk causal attention ``C (K + V)``
      (plus ``C K`` for the decayed key overlaps of the delta rules). This is the
      chunked form's ``2Ld² + 2LCd`` cost per token (Yang et al. 2023, arXiv:2312.06635),
      with the delta-rule terms added (Yang et al. 2024, arXiv:2406.06484).
    """
    cfg = _cfg(config, "flops_per_token")
    require_positive_int("flops_per_token", "seq_len", seq_len)
    total = 2.0 * param_counts(cfg)["active"]
    H, hd = cfg.num_heads, cfg.resolved_head_dim
    ctx = (seq_len + 1) / 2
    C = min(cfg.chunk_size or 64, seq_len)
    for ch in cfg.pattern:
        kind = MIXERS[ch]
        if kind == "softmax":
            total += 2 * H * (2 * hd) * ctx
        elif kind == "mla":
            total += 2 * H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * ctx
        else:
            K = V = hd
            delta = RULES[kind].erase
            Hv = H if RULES[kind].normalize else (cfg.num_v_heads or H)  # the rule runs once per value head
            total += Hv * ((4 + 2 * delta) * K * V + C * (K + V) + delta * C * K)
    return float(total)
