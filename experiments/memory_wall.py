"""The memory wall: cache and state bytes of one sequence vs context.

    python -m experiments.memory_wall [--quick] [--out results]

Every byte count comes from :mod:`lineage_jax.accounting` applied to a model config:
``cache_bytes_per_token`` (bf16, 2 bytes — the growing K/V or MLA-latent caches)
and ``state_bytes`` (fp32, 4 bytes — the fixed recurrent states). Lines:

* GPT-2 small (MHA, the library's ``gpt2_small``);
* a 70B GQA model (Llama-2-70B's shape: 80 layers, 64 query heads, 8 KV heads,
  head_dim 128, d_model 8192);
* a hypothetical dense 2.8T-scale MHA model (216 layers, d_model 32768, 256 heads
  of 128 — chosen so the accountant counts ≈ 2.78T parameters, K3's total);
* Kimi K3's MLA layers only (the compressed latent shelf), K3's KDA states only
  (flat), and the K3 hybrid total (shelf + states);
* one H200's HBM (141 GB) as the ceiling.

Context runs over log-spaced powers of two from 1K (1,024) to 1M (1,048,576) tokens;
bytes are printed in decimal units (1 MB = 10⁶ B, as the seed and the H200 spec use).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from experiments import common
from lineage_jax import accounting as A
from lineage_jax.models.config import MIXERS, ModelConfig, get_config

NAME = "memory_wall"
CACHE_DTYPE_BYTES = 2  # bf16 K/V and latent caches
STATE_DTYPE_BYTES = 4  # fp32 recurrent states (docs/design.md: the state is float32 always)
WEIGHT_DTYPE_BYTES = 2  # bf16 weights, for the "cache outweighs the model" comparison
H200_HBM_BYTES = 141e9
TABLE_CONTEXTS = (1 << 10, 1 << 17, 1 << 20)  # 1K, 128K, 1M


def llama2_70b() -> ModelConfig:
    """Llama-2-70B's shape: GQA with 8 KV heads (the accountant counts 68.98B parameters)."""
    return ModelConfig(name="llama2_70b", vocab_size=32000, d_model=8192, pattern="S" * 80, num_heads=64,
                       num_kv_heads=8, head_dim=128, ffn_kind="swiglu", ffn_hidden=28672, norm="rmsnorm",
                       max_seq_len=4096)


def dense_2p8t_mha() -> ModelConfig:
    """A hypothetical dense 2.8T-scale model with vanilla multi-head attention (GPT-style block)."""
    return ModelConfig(name="dense_2p8t_mha", vocab_size=50304, d_model=32768, pattern="S" * 216, num_heads=256,
                       head_dim=128, ffn_kind="gelu", ffn_hidden=4 * 32768, norm="layernorm", attn_bias=True,
                       tie_embeddings=True, max_seq_len=1 << 20)


def contexts(quick: bool) -> np.ndarray:
    """Powers of two from 2¹⁰ to 2²⁰: every octave (quick) or every quarter octave."""
    exps = np.linspace(10, 20, 11 if quick else 41)
    return np.unique(np.round(2.0 ** exps).astype(np.int64))


def lines(quick: bool = False) -> dict:
    """``{line: {"per_token": B/token, "fixed": B, "bytes": [...], ...}}`` over :func:`contexts`."""
    ctx = contexts(quick)
    k3 = get_config("kimi_k3")
    # K3's KDA layers add no growing cache and its MLA layers no fixed state, so the
    # accountant's cache term is the MLA shelf and its state term the KDA states.
    specs = [
        ("GPT-2 small (MHA)", get_config("gpt2_small"), "cache"),
        ("70B GQA (Llama-2-70B shape)", llama2_70b(), "cache"),
        ("dense 2.8T MHA (hypothetical)", dense_2p8t_mha(), "cache"),
        ("K3: MLA layers only", k3, "cache"),
        ("K3: KDA states only", k3, "state"),
        ("K3 hybrid total", k3, "both"),
    ]
    out = {}
    for label, cfg, what in common.progress(specs, desc="accounting", unit="model"):
        per_token = A.cache_bytes_per_token(cfg, CACHE_DTYPE_BYTES) if what in ("cache", "both") else 0
        fixed = A.state_bytes(cfg, STATE_DTYPE_BYTES) if what in ("state", "both") else 0
        counts = A.param_counts(cfg)
        hkv = cfg.num_kv_heads or cfg.num_heads
        n_layers = {kind: sum(1 for ch in cfg.pattern if MIXERS[ch] == kind) for kind in sorted(set(MIXERS.values()))}
        total = per_token * ctx + fixed
        out[label] = {
            "config": cfg.name,
            "layers": {k: v for k, v in n_layers.items() if v},
            "heads": cfg.num_heads, "kv_heads": hkv if n_layers.get("softmax") else None,
            "head_dim": cfg.resolved_head_dim,
            "params_total": counts["total"],
            "cache_bytes_per_token": per_token,
            "state_bytes": fixed,
            "bytes": total,
            "weights_bytes_bf16": counts["total"] * WEIGHT_DTYPE_BYTES,
            # context (tokens) at which this one sequence's memory fills an H200 / outweighs the weights
            "fills_h200_at_tokens": _crossing(H200_HBM_BYTES, per_token, fixed),
            "exceeds_weights_at_tokens": _crossing(counts["total"] * WEIGHT_DTYPE_BYTES, per_token, fixed),
        }
    return {"contexts": ctx, "lines": out}


def _crossing(level: float, per_token: int, fixed: int) -> Optional[float]:
    """Tokens at which ``per_token · T + fixed`` reaches ``level`` (None: never; 0: already)."""
    if fixed >= level:
        return 0.0
    if per_token == 0:
        return None
    return (level - fixed) / per_token


def _plot(res: dict):
    plt = common.plt
    ctx = np.asarray(res["contexts"])
    fig, ax = plt.subplots(figsize=(9.5, 6.2))
    styles = ["-", "-", "-", "--", ":", "-"]
    for (label, line), style in zip(res["lines"].items(), styles):
        ax.plot(ctx, line["bytes"], style, lw=2.2, label=f"{label}  ({common.fmt_bytes(line['cache_bytes_per_token'])}/token"
                + (f" + {common.fmt_bytes(line['state_bytes'])} state)" if line["state_bytes"] else ")"))
    ax.axhline(H200_HBM_BYTES, color="k", lw=1.5, ls="-.", label="one H200's HBM (141 GB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [1 << e for e in range(10, 21, 2)]
    ax.set_xticks(ticks, [common.fmt_tokens(t) for t in ticks])
    ax.set_xlabel("context (tokens, one sequence)")
    ax.set_ylabel("cache + state bytes (bf16 caches, fp32 states)")
    ax.set_title("The memory wall: growing caches vs fixed states (lineage_jax.accounting)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def run(quick: bool = False, out: str = "results") -> dict:
    """Compute every line; write ``<out>/memory_wall/memory_wall.{json,png}``; return the record.

    ``quick``: 11 contexts (every octave) instead of 41 (every quarter octave).
    """
    res = lines(quick)
    ctx = list(res["contexts"])
    table_rows = {label: {common.fmt_tokens(t): line["bytes"][ctx.index(t)] for t in TABLE_CONTEXTS}
                  for label, line in res["lines"].items()}
    record = dict(common.provenance(NAME, quick), cache_dtype_bytes=CACHE_DTYPE_BYTES,
                  state_dtype_bytes=STATE_DTYPE_BYTES, h200_hbm_bytes=H200_HBM_BYTES, table=table_rows, **res)
    return common.finish(record, NAME, out, _plot(res))


def table(r: dict) -> str:
    headers = ["memory of one sequence", "B/token", "fixed"] + [f"@{k}" for k in next(iter(r["table"].values()))] + ["fills H200 at"]
    rows = []
    for label, line in r["lines"].items():
        fill = line["fills_h200_at_tokens"]
        rows.append([label, f"{line['cache_bytes_per_token']:,}", common.fmt_bytes(line["state_bytes"])]
                    + [common.fmt_bytes(v) for v in r["table"][label].values()]
                    + ["never" if fill is None else f"{fill:,.0f} tok"])
    rows.append(["H200 HBM", "", common.fmt_bytes(r["h200_hbm_bytes"])] + [""] * (len(headers) - 3))
    return common.format_table(headers, rows, title="The memory wall (bf16 caches, fp32 states; decimal units)")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = common.make_parser(NAME, "Cache / state bytes vs context for GPT-2, a 70B GQA model, a dense 2.8T MHA model and Kimi K3.")
    return common.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
