"""The architectures the experiments compare, and the recipe that turns a row into a config.

One table for every experiment that trains the lineage side by side (``scorecard``, ``lm``,
``mqar``, ``niah``): each row is ``(label, pattern, extra)`` — a display label, a 4-layer
pattern of mixer letters (``S`` softmax, ``L`` linear attention, ``D`` DeltaNet, ``G`` Gated
DeltaNet, ``K`` KDA, ``M`` MLA) and the ``ModelConfig`` fields that make the row what it is.

* :data:`ARCHITECTURES` / :data:`KEYS`: the eight rows of the scorecard, with short keys
  (``gpt2, linear, deltanet, gdn, kda, mla, kimi_linear, k3``) for command lines.
* :data:`EXTRA_ARCHITECTURES` / :data:`EXTRA_KEYS`: diagnostic rows, run only when named;
  :func:`register_architecture` adds one (a mixer of your own, registered with
  ``lineage_jax.models.register_rule``, in a module the experiments' ``--import`` loads).
* :func:`model_config`: the shared recipe (FFN 4d, MoE experts d wide, MLA sizes from the
  head width, short causal conv) at a given width; :func:`wide_head_config` the same with
  64-wide heads (the recall experiments); :func:`select` cuts rows to fewer layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from lineage_jax.models import ModelConfig

# (label, pattern, extra config fields); KEYS give each a short name for command lines.
ARCHITECTURES = [
    ("GPT-2 (softmax + KV cache)", "SSSS", dict(positions="learned", norm="layernorm", ffn_kind="gelu", attn_bias=True)),
    ("Linear attention", "LLLL", {}),
    ("DeltaNet", "DDDD", {}),
    ("Gated DeltaNet", "GGGG", {}),
    ("KDA", "KKKK", {}),
    ("MLA", "MMMM", dict(mla_rope=True)),
    ("Kimi Linear 3:1 (KDA+MLA, MoE)", "KKKM", dict(first_dense_layers=1, num_experts=8, top_k=2, num_shared_experts=1)),
    ("K3-style (latent MoE, SiTU, AttnRes)", "KKKM", dict(
        first_dense_layers=1, num_experts=8, top_k=2, num_shared_experts=2, moe_activation="situ", ffn_kind="situ",
        kda_gate="bounded", kda_output_gate="full", mla_output_gate=True, attnres_block=2)),
]

KEYS = dict(zip(["gpt2", "linear", "deltanet", "gdn", "kda", "mla", "kimi_linear", "k3"], [a[0] for a in ARCHITECTURES]))

# Diagnostic rows, run only when named (not part of the scorecard). GPT-2 is the one
# softmax row that did not learn the probes in the scorecard's budget (H200: val accuracy 0.04 /
# 0.50 at lr 1e-3 / 3e-3, fade doc B 0.04; a second run 0.64, doc B 0.07), while MLA (RoPE,
# RMSNorm, SwiGLU) reached 1.00. GPT-2 without its learned positions (NoPE; order from the causal
# mask alone) learned nothing (H200; that run also had the default attention init — the GPT-2
# init then keyed on learned positions; it now covers every LayerNorm row), and GPT-2 with RoPE
# instead of learned positions asks whether a relative position signal is what it lacks:
# `--only gpt2,gpt2_nope,gpt2_rope`.
# Gated DeltaNet without its output gate: GDN's full SiLU output gate (as in the flash-linear-
# attention GatedDeltaNet layer) is what kept it from learning MQAR at d 64 (H200: 0.003, and
# 0.998 with the gate off — docs/results.md), so `--only gdn,gdn_nogate` (or mqar `--archs`)
# measures the gate.
# KDA without its low-rank sigmoid output gate: the same question for KDA, which learned MQAR at
# L 64 but not at (128, 8) in 600 H200 steps (0.005 at d 64, 0.086 at d 128; DeltaNet 0.99) —
# on the CPU the gate turned out a small factor (0.733 -> 0.811 at (64, 4)), so KDA with A = 1 at
# init (Mamba-2's A ~ U[1, 16] forgets up to 16x, on average 8.5x, faster before the gate learns)
# asks about the decay.
EXTRA_ARCHITECTURES = [
    ("GPT-2 without positions (NoPE)", "SSSS", dict(positions="none", norm="layernorm", ffn_kind="gelu",
                                                    attn_bias=True)),
    ("Gated DeltaNet, no output gate", "GGGG", dict(gdn_output_gate="none")),
    ("KDA, no output gate", "KKKK", dict(kda_output_gate="none")),
    ("GPT-2 with RoPE (no learned positions)", "SSSS", dict(positions="rope", norm="layernorm", ffn_kind="gelu",
                                                            attn_bias=True)),
    ("KDA, A = 1 at init (slower initial decay)", "KKKK", dict(decay_a_init="unit")),
]
EXTRA_KEYS = dict(zip(["gpt2_nope", "gdn_nogate", "kda_nogate", "gpt2_rope", "kda_unit_a"],  # KEYS stays the card
                      [a[0] for a in EXTRA_ARCHITECTURES]))



def register_architecture(key: str, label: str, pattern: str, extra: Optional[dict] = None) -> None:
    """Add a row that ``--only`` / ``--archs`` name by ``key`` (run only when named, like the diagnostic
    rows): ``pattern`` of mixer letters (a registered mixer's letter included), ``extra`` the
    ``ModelConfig`` fields that make the row what it is. For example, in a module given to ``--import``::

        register_rule("gla", Rule("X", gate="channel", erase=False, output_gate="full"))
        register_architecture("gla", "GLA", "XXXX")

    The same row again does nothing; a key or label already taken, or a pattern with a letter no
    mixer has, is a ``ValueError``."""
    from lineage_jax.models import MIXERS

    extra = {} if extra is None else extra
    row = (label, pattern, extra)
    if EXTRA_KEYS.get(key) == label and row in EXTRA_ARCHITECTURES:
        return
    if not isinstance(key, str) or not key.isidentifier():
        raise ValueError(f"register_architecture: `key` must be an identifier string, got {key!r}")
    if key in KEYS or key in EXTRA_KEYS:
        raise ValueError(f"register_architecture: `key` {key!r} is taken")
    if not isinstance(label, str) or not label or label in {a[0] for a in ARCHITECTURES + EXTRA_ARCHITECTURES}:
        raise ValueError(f"register_architecture: `label` must be a new non-empty string, got {label!r}")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(MIXERS):
        raise ValueError(f"register_architecture: `pattern` must be mixer letters ({''.join(MIXERS)}; a mixer of "
                         f"your own: lineage_jax.models.register_rule first), got {pattern!r}")
    if not isinstance(extra, dict):
        raise ValueError(f"register_architecture: `extra` must be a dict of ModelConfig fields, got {extra!r}")
    EXTRA_ARCHITECTURES.append(row)
    EXTRA_KEYS[key] = label


HEAD_DIM = 64  # the head width of wide_head_config


def model_config(label: str, pattern: str, extra: dict, *, d_model: int, head_dim: int, vocab: int,
                 max_seq_len: int, layers: Optional[int] = None, chunk_size: int = 16) -> ModelConfig:
    """A row's ``ModelConfig`` at this width: ``d_model / head_dim`` heads, FFN ``4·d_model``,
    routed experts ``d_model`` wide (latent MoE ``d_model / 2`` where the row sets
    ``moe_activation``), MLA latent ``2·head_dim`` with a RoPE part ``head_dim / 2``, causal conv
    of size 4; ``layers`` keeps the last ``layers`` letters of the pattern (``None``: all)."""
    pattern = pattern if layers is None else pattern[-layers:]
    base = dict(name=label, vocab_size=vocab, d_model=d_model, pattern=pattern, num_heads=d_model // head_dim,
                head_dim=head_dim, ffn_hidden=4 * d_model, moe_hidden=d_model, chunk_size=chunk_size,
                max_seq_len=max_seq_len, kv_lora_rank=2 * head_dim, qk_nope_head_dim=head_dim,
                qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
                moe_latent_dim=d_model // 2 if "moe_activation" in extra else None, conv_size=4)
    base.update(extra)
    return ModelConfig(**base)


def check_widths(widths: Sequence[int], arg: str = "widths") -> tuple[int, ...]:
    """Widths must give whole 64-wide heads (or one narrower head, a multiple of 16)."""
    for d in widths:
        if not isinstance(d, (int, np.integer)) or d <= 0:
            raise ValueError(f"{arg}: d_model must be a positive int, got {d!r}")
        if d % 16 or (d > HEAD_DIM and d % HEAD_DIM):
            raise ValueError(f"{arg}: d_model={d} must be a multiple of 16, and of {HEAD_DIM} above {HEAD_DIM}")
    if not widths:
        raise ValueError(f"{arg}: give at least one d_model")
    return tuple(dict.fromkeys(int(d) for d in widths))


def wide_head_config(label: str, pattern: str, extra: dict, d_model: int, seq_len: int, vocab: int) -> ModelConfig:
    """:func:`model_config` with 64-wide heads (one narrower head below ``d_model = 64``), room
    for ``seq_len`` positions and a chunk of up to 64 tokens."""
    return model_config(label, pattern, extra, d_model=d_model, head_dim=min(HEAD_DIM, d_model), vocab=vocab,
                        max_seq_len=seq_len, chunk_size=min(64, seq_len))


def select(keys: Optional[Sequence[str]], layers: int, arg: str = "archs") -> list[tuple[str, str, str, dict]]:
    """``(key, label, pattern, extra)`` of the rows named by ``keys`` (``None``: the eight of
    :data:`KEYS`; diagnostic rows of :data:`EXTRA_KEYS` when named), cut to ``layers`` layers.

    A pure pattern keeps its letter (``SSSS`` -> ``SS``); a hybrid keeps its last layer's mixer
    and fills the rest with the first (``KKKM`` -> ``KM``: 1:1 is all two layers allow).
    """
    keys = tuple(KEYS) if keys is None else tuple(keys)
    named = {**KEYS, **EXTRA_KEYS}
    unknown = [k for k in keys if k not in named]
    if unknown or not keys:
        raise ValueError(f"{arg}: unknown architecture(s) {unknown or keys!r}; valid: {','.join(named)}")
    table = {label: (pattern, extra) for label, pattern, extra in ARCHITECTURES + EXTRA_ARCHITECTURES}
    out = []
    for key in keys:
        pattern, extra = table[named[key]]
        pattern = pattern[0] * (layers - 1) + pattern[-1]
        extra = dict(extra, attnres_block=min(extra["attnres_block"], layers)) if "attnres_block" in extra else extra
        out.append((key, named[key], pattern, extra))
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m experiments.architectures``: print the rows with their command-line keys."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m experiments.architectures",
        description="List the architectures the experiments compare: the keys that scorecard --only and "
                    "mqar / niah --archs take (lm --archs: the card's rows), each row's label and 4-layer pattern.")
    parser.parse_args(argv)
    for title, keys, rows in (("card rows", KEYS, ARCHITECTURES),
                              ("diagnostic rows (run only when named)", EXTRA_KEYS, EXTRA_ARCHITECTURES)):
        print(f"{title}:")
        patterns = {label: pattern for label, pattern, _ in rows}
        for key, label in keys.items():
            print(f"  {key:<12} {patterns[label]}  {label}")


if __name__ == "__main__":
    main()
