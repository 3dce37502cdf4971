"""The parameter accountant: "22,580 GPT-2s fit in one K3", held honestly.

    python -m experiments.accountant [--quick] [--out results]

Every count is :mod:`lineage_jax.accounting` walking an abstract model
(``nnx.eval_shape``), never typed in. Three views of the headline ratio:

1. stored parameters, K3 total / GPT-2 small total (the headline "22,580" is the
   rounded 2.8T / 124M; the exact accountant ratio is reported beside it);
2. the same against GPT-2 XL (the 1.5B model the 2019 paper headlines; the
   rounded "≈1,867" is 2.8T / 1.5B). GPT-2 XL is built here: 48 layers, d_model
   1600, 25 heads, the released vocabulary of 50,257 tokens, 1,024 learned
   positions, tied embeddings (the padded 50,304 vocab is counted alongside);
3. active parameters per token, K3 active / GPT-2 small active (and per-token
   forward FLOPs at a 1,024-token context, from ``accounting.flops_per_token``);

plus where K3's parameters live, by component (``accounting.component_counts``):
routed experts ≈ 98%.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from experiments import common
from lineage_jax import accounting as A
from lineage_jax.models.config import ModelConfig, get_config

NAME = "accountant"
GPT2_XL_VOCAB = 50257  # the released GPT-2 XL vocabulary (HF "gpt2-xl"); 50304 is nanoGPT's padding
FLOPS_CONTEXT = 1024  # GPT-2's full context; per-token FLOPs are compared there

# Components grouped for the story: experts (2017's idea), attention (the memory story), the rest.
GROUPS = {
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "moe_latent_proj": "latent-MoE projections",
    "router": "routers",
    "dense_ffn": "dense FFN (layer 1)",
    "mixer": "attention: KDA + MLA mixers",
    "attnres": "AttnRes queries",
    "embedding": "embedding",
    "lm_head": "LM head",
    "positions": "positions",
    "norms": "norms",
}


def gpt2_xl(vocab_size: int = GPT2_XL_VOCAB) -> ModelConfig:
    """GPT-2 XL: GPT-2 small's block (LayerNorm, GELU 4×, biases, tied, learned positions) at 48 × 1600."""
    return get_config("gpt2_small").replace(name="gpt2_xl", vocab_size=vocab_size, d_model=1600, pattern="S" * 48,
                                            num_heads=25, ffn_hidden=4 * 1600, max_seq_len=1024)


def account(quick: bool = False) -> dict:
    """All counts and ratios (``quick`` skips the padded-vocab GPT-2 XL variant)."""
    models = {"kimi_k3": get_config("kimi_k3"), "gpt2_small": get_config("gpt2_small"), "gpt2_xl": gpt2_xl()}
    if not quick:
        models["gpt2_xl_vocab50304"] = gpt2_xl(50304)
    counts, comps, flops = {}, {}, {}
    for name, cfg in common.progress(models.items(), desc="counting", unit="model", total=len(models)):
        counts[name] = A.param_counts(cfg)
        comps[name] = A.component_counts(cfg)
        flops[name] = A.flops_per_token(cfg, FLOPS_CONTEXT)
    k3, small, xl = counts["kimi_k3"], counts["gpt2_small"], counts["gpt2_xl"]
    k3_total = k3["total"]
    shares = {c: n / k3_total for c, n in sorted(comps["kimi_k3"].items(), key=lambda kv: -kv[1])}
    res = {
        "models": {name: {"config": cfg.name, "layers": cfg.num_layers, "d_model": cfg.d_model,
                          "num_heads": cfg.num_heads, "vocab_size": cfg.vocab_size, **counts[name],
                          "flops_per_token_at_1024": flops[name], "components": comps[name]}
                   for name, cfg in models.items()},
        "gpt2_xl_vocab_size": GPT2_XL_VOCAB,
        # view 1: stored parameters
        "ratio_total_vs_gpt2_small": k3_total / small["total"],
        "seed_headline_ratio": 2.8e12 / 124e6,  # the rounded inputs of the published estimate, for comparison only
        # view 2: against the model the 2019 paper headlines
        "ratio_total_vs_gpt2_xl": k3_total / xl["total"],
        "seed_xl_ratio": 2.8e12 / 1.5e9,
        # view 3: per-token work
        "ratio_active_vs_gpt2_small_active": k3["active"] / small["active"],
        "ratio_active_vs_gpt2_small_total": k3["active"] / small["total"],
        "ratio_flops_per_token_vs_gpt2_small": flops["kimi_k3"] / flops["gpt2_small"],
        "k3_active_fraction": k3["active"] / k3_total,
        # where K3's parameters live
        "k3_component_shares": shares,
        "routed_expert_share": shares.get("routed_experts", 0.0),
        "all_expert_share": shares.get("routed_experts", 0.0) + shares.get("shared_experts", 0.0),
        "attention_share": shares.get("mixer", 0.0) + shares.get("attnres", 0.0),
        "gpt2_small_mlp_share_of_blocks": comps["gpt2_small"].get("dense_ffn", 0)
        / (comps["gpt2_small"].get("dense_ffn", 0) + comps["gpt2_small"].get("mixer", 0)),
    }
    if "gpt2_xl_vocab50304" in counts:
        res["ratio_total_vs_gpt2_xl_vocab50304"] = k3_total / counts["gpt2_xl_vocab50304"]["total"]
    return res


def _pct(share: float) -> str:
    return f"{100 * share:.3g}%" if share >= 1e-5 else f"{100 * share:.1e}%"


def _plot(res: dict):
    plt = common.plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.8), gridspec_kw={"width_ratios": [1.25, 1]})
    shares = res["k3_component_shares"]
    labels = [GROUPS.get(c, c) for c in shares]
    vals = np.asarray(list(shares.values()))
    colors = ["#c8553d" if "experts" in c or c in ("router", "moe_latent_proj") else
              "#2e6f95" if c in ("mixer", "attnres") else "#8a8a8a" for c in shares]
    y = np.arange(len(vals))[::-1]
    ax1.barh(y, vals, color=colors)
    ax1.set_xscale("log")
    ax1.set_yticks(y, labels)
    for yi, v, n in zip(y, vals, shares):
        ax1.text(v * 1.15, yi, f"{_pct(v)}  ({res['models']['kimi_k3']['components'][n] / 1e9:,.4g}B)",
                 va="center", fontsize=8)
    ax1.set_xlim(vals.min() / 2, 20)
    ax1.set_xlabel("share of K3's parameters (log)")
    total = res["models"]["kimi_k3"]["total"]
    ax1.set_title(f"Kimi K3: {total / 1e12:.4g}T parameters by component")

    bars = [
        ("total / GPT-2 small", res["ratio_total_vs_gpt2_small"], res["seed_headline_ratio"]),
        ("total / GPT-2 XL", res["ratio_total_vs_gpt2_xl"], res["seed_xl_ratio"]),
        ("active / GPT-2 small active", res["ratio_active_vs_gpt2_small_active"], None),
        (f"FLOPs/token @{FLOPS_CONTEXT} / GPT-2 small", res["ratio_flops_per_token_vs_gpt2_small"], None),
    ]
    x = np.arange(len(bars))
    ax2.bar(x, [b[1] for b in bars], color=["#c8553d", "#c8553d", "#2e6f95", "#2e6f95"])
    for xi, (_, v, seed) in zip(x, bars):
        ax2.text(xi, v * 1.1, f"{v:,.0f}×", ha="center", fontsize=9)
        if seed is not None:
            ax2.plot([xi - 0.4, xi + 0.4], [seed, seed], "k--", lw=1)
            ax2.text(xi + 0.42, seed, f"rounded {seed:,.0f}", fontsize=7, va="center")
    ax2.set_yscale("log")
    ax2.set_xticks(x, [b[0] for b in bars], rotation=15, ha="right", fontsize=8)
    ax2.set_ylabel("ratio (log)")
    ax2.set_title("Three honest views of '22,580' (dashed: the rounded headline figure)")
    fig.tight_layout()
    return fig


def run(quick: bool = False, out: str = "results") -> dict:
    """Count, compare, plot; write ``<out>/accountant/accountant.{json,png}``; return the record."""
    res = account(quick)
    record = dict(common.provenance(NAME, quick), **res)
    return common.finish(record, NAME, out, _plot(res))


def table(r: dict) -> str:
    m = r["models"]
    rows = [[name, f"{d['total']:,}", f"{d['active']:,}", f"{d['flops_per_token_at_1024']:.4g}"] for name, d in m.items()]
    t1 = common.format_table(["model", "total params", "active params", f"FLOPs/token @{FLOPS_CONTEXT}"], rows,
                             title="The accountant (lineage_jax.accounting, abstract shapes)")
    ratios = [
        ["K3 total / GPT-2 small total", f"{r['ratio_total_vs_gpt2_small']:,.2f}", f"{r['seed_headline_ratio']:,.1f} (2.8T/124M)"],
        [f"K3 total / GPT-2 XL total (vocab {r['gpt2_xl_vocab_size']})", f"{r['ratio_total_vs_gpt2_xl']:,.2f}",
         f"{r['seed_xl_ratio']:,.1f} (2.8T/1.5B)"],
        ["K3 active / GPT-2 small active", f"{r['ratio_active_vs_gpt2_small_active']:,.1f}", "'hundreds'"],
        [f"K3 / GPT-2 small FLOPs per token @{FLOPS_CONTEXT}", f"{r['ratio_flops_per_token_vs_gpt2_small']:,.1f}", ""],
        ["K3 routed-expert share", f"{100 * r['routed_expert_share']:.2f}%", "~98%"],
        ["K3 all-expert share (routed + shared)", f"{100 * r['all_expert_share']:.2f}%", "~95%+"],
        ["K3 attention share (KDA + MLA + AttnRes)", f"{100 * r['attention_share']:.2f}%", "'sub-1%'"],
        ["GPT-2 small MLP share of block params", f"{100 * r['gpt2_small_mlp_share_of_blocks']:.1f}%", "two-thirds"],
    ]
    if "ratio_total_vs_gpt2_xl_vocab50304" in r:
        ratios.insert(2, ["K3 total / GPT-2 XL total (vocab 50304)", f"{r['ratio_total_vs_gpt2_xl_vocab50304']:,.2f}", ""])
    t2 = common.format_table(["ratio", "computed", "headline"], ratios)
    t3 = common.format_table(["K3 component", "params", "share"],
                             [[GROUPS.get(c, c), f"{m['kimi_k3']['components'][c]:,}", f"{100 * s:.3f}%"]
                              for c, s in r["k3_component_shares"].items()])
    return "\n\n".join([t1, t2, t3])


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = common.make_parser(NAME, "Kimi K3 vs GPT-2: total, XL and active-parameter ratios, and K3's parameter shares.")
    return common.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
