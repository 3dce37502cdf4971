"""Pure-function memories of the lineage (no Flax).

Softmax attention keeps every key and value (:mod:`.softmax`); every fixed-state
memory is one update equation with one edit each (:mod:`.core`, :mod:`.rules`)::

    S_t = Diag(α_t) S_{t-1} + k_tᵀ β_t (v_t − e · k_t Diag(α_t) S_{t-1}),   o_t = q_t S_t

Each rule has a scanned recurrence (``mode="recurrent"``), a chunked WY/UT
parallel form (``mode="chunked"``) and a one-token decode step.
"""

from lineage_jax.memory.options import MemoryOptions
from lineage_jax.memory.rules import (
    delta_corrections,
    delta_rule,
    delta_rule_step,
    gated_delta_rule,
    gated_delta_rule_step,
    kda,
    kda_step,
    linear_attention,
    linear_attention_step,
    update_rule,
    update_rule_step,
)
from lineage_jax.memory.fused import IMPLS as ATTENTION_IMPLS
from lineage_jax.memory.softmax import (
    KVCache,
    cache_read,
    init_kv_cache,
    kv_cache_from_prefill,
    reference_attention,
    resolve_read,
    softmax_attention,
    softmax_attention_extend,
    softmax_attention_step,
)

__all__ = [
    "ATTENTION_IMPLS",
    "KVCache",
    "MemoryOptions",
    "cache_read",
    "delta_corrections",
    "delta_rule",
    "delta_rule_step",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "init_kv_cache",
    "kda",
    "kda_step",
    "kv_cache_from_prefill",
    "reference_attention",
    "linear_attention",
    "linear_attention_step",
    "resolve_read",
    "softmax_attention",
    "softmax_attention_extend",
    "softmax_attention_step",
    "update_rule",
    "update_rule_step",
]
