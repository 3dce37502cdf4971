"""Language modelling at equal parameters: every architecture of the lineage on real text.

    python -m experiments.lm [--quick] [--out results] [--archs gpt2,kda,...] [--steps N]
        [--lrs 1e-3,3e-3] [--match total|active] [--no-ablation]

**Data**: the embedded corpus (``lineage_jax.data``: this interpreter's standard-library
sources, byte tokenizer, vocab 256), packed into rows of ``seq_len`` tokens; training rows
are spread evenly over the *train* split, validation rows over the *val* split (split by
file-name hash, so no file is in both). Rows are packed without state resets (the mask
drops every cross-document target), identically for every architecture.

**Main table**: the scorecard's eight architectures (``architectures.ARCHITECTURES``: GPT-2
softmax with learned positions, linear attention, DeltaNet, Gated DeltaNet, KDA, MLA with
RoPE, the Kimi Linear 3:1 KDA:MLA hybrid with MoE, and a K3-style hybrid with latent MoE,
SiTU, the bounded gate and AttnRes), each repeated to ``layers`` layers. **Measured**: the
masked next-token loss (nats per byte; bits per byte = loss / ln 2) on the fixed validation
rows, every ``steps / evals`` steps, at the best of ``lrs`` (chosen on the final validation
loss).

**Equal parameters**: the budget is the GPT-2 row's non-embedding parameter count
(``accounting.param_counts(cfg)["total"]`` minus the embedding and position tables; the LM
head counts). Every other model gets its FFN width — ``ffn_hidden`` for dense models,
``moe_hidden`` (routed and shared experts) for MoE models — set so that its count matches;
parameters are affine in that width, so two abstract counts fix it, and a third checks it
(all within ``tolerance``, printed). ``--match active`` matches the parameters a token
touches instead (``param_counts(cfg)["active"]``); with the default, MoE rows hold the same
parameters but touch fewer per token (both counts are printed).

**Hybrid-ratio ablation** (Kimi Linear found 3:1 best): the Kimi Linear row with only the
layer pattern changed — KDA:MLA 1:1 (``KMKM…``), 3:1 (``KKKM…``, the main-table model, not
retrained), 7:1 (``KKKKKKKM``) and MLA only (NoPE, as in the hybrids) — at the same depth and
re-matched to the same budget.

**Fairness**: same width, depth, heads, optimizer (AdamW, warmup + cosine, wd 0.1, clip 1),
steps, batch, learning-rate grid and the same rows in the same order for every model; no
per-architecture tuning beyond the lr grid. All learning rates of one model train as one
program (``trainer.LRSweep``) and the next models compile in a thread pool while one trains.

**Budgets**: ``--quick`` (2 CPU cores, ≲4 min): GPT-2, KDA and Kimi Linear plus the ablation
(6 models), d 64, 4 heads × 16, 8 layers, 60 steps of 8 × 64 tokens, one lr — a smoke run of
the pipeline, not a result (``--archs`` adds the others, ~25 s of CPU compile each). Full: d 256, 4 heads × 64,
8 layers, 600 steps of 32 × 256 tokens (4.9M bytes, < half an epoch), lrs 1e-3 and 3e-3:
11 models; small models are compile/launch bound (~20–40 s of compile each, overlapped with
training), about 7 minutes on one H200 (409 s, 2026-11-29).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import numpy as np

from experiments import architectures as A
from experiments import common as C
from experiments.trainer import LMSweep, run_sweeps, text_rows  # noqa: F401 (this script's tools, shared)
from lineage_jax import accounting
from lineage_jax.models import ModelConfig

NAME = "lm"
VOCAB = 256  # the byte tokenizer
KEYS = tuple(A.KEYS)  # gpt2, linear, deltanet, gdn, kda, mla, kimi_linear, k3
REFERENCE = "gpt2"  # whose parameter count is the budget
ABLATION = (("1:1", "KM"), ("3:1", "KKKM"), ("7:1", "KKKKKKKM"), ("MLA only", "M"))  # (KDA:MLA, repeating unit)
ABLATION_BASE = "kimi_linear"
MATCH = ("total", "active")


@dataclasses.dataclass(frozen=True)
class Budget:
    archs: tuple[str, ...]
    d_model: int
    head_dim: int
    layers: int
    seq_len: int
    batch: int
    steps: int
    lrs: tuple[float, ...]
    val_rows: int
    evals: int  # validation points per run
    match: str = "total"
    tolerance: float = 0.02
    ablation: bool = True

    @property
    def train_rows(self) -> int:
        """Distinct training rows (spread over the train split): one per example seen, capped by the split."""
        return self.steps * self.batch


FULL = Budget(archs=KEYS, d_model=256, head_dim=64, layers=8, seq_len=256, batch=32, steps=600, lrs=(1e-3, 3e-3),
              val_rows=256, evals=12)
QUICK = Budget(archs=("gpt2", "kda", "kimi_linear"), d_model=64, head_dim=16, layers=8, seq_len=64, batch=8, steps=60,
               lrs=(3e-3,), val_rows=32, evals=4)


def make_budget(quick: bool, archs=None, steps=None, lrs=None, match=None, ablation=True) -> Budget:
    b = QUICK if quick else FULL
    archs = tuple(archs) if archs is not None else b.archs
    unknown = [k for k in archs if k not in KEYS]
    if unknown or not archs:
        raise ValueError(f"archs: unknown architecture(s) {unknown or list(archs)}; valid: {','.join(KEYS)}")
    if lrs is not None and (not lrs or any(not lr > 0 for lr in lrs)):
        raise ValueError(f"lrs: need one or more positive learning rates, got {lrs!r}")
    if steps is not None and steps < b.evals:
        raise ValueError(f"steps: must be >= {b.evals} (one per validation point), got {steps}")
    if match is not None and match not in MATCH:
        raise ValueError(f"match: must be one of {MATCH}, got {match!r}")
    steps = steps or b.steps
    return dataclasses.replace(b, archs=archs, steps=steps, lrs=tuple(float(lr) for lr in (lrs or b.lrs)),
                               match=match or b.match, ablation=bool(ablation))


def bits_per_byte(nats: float) -> float:
    return nats / math.log(2)


# ----------------------------------------------------------------------------
# Configs at equal parameters.
# ----------------------------------------------------------------------------
def base_config(label: str, pattern: str, extra: dict, b: Budget) -> ModelConfig:
    """The scorecard's recipe (FFN 4d, MoE experts d wide, MLA sizes from the head) at this width."""
    return A.model_config(label, pattern, extra, d_model=b.d_model, head_dim=b.head_dim, vocab=VOCAB,
                          max_seq_len=b.seq_len, chunk_size=min(64, b.seq_len))


def budget_params(cfg: ModelConfig, match: str) -> int:
    """What is matched: non-embedding parameters ("total") or parameters a token touches ("active")."""
    if match == "active":
        return accounting.param_counts(cfg)["active"]
    parts = accounting.component_counts(cfg)
    return sum(parts.values()) - parts.get("embedding", 0) - parts.get("positions", 0)


def ffn_knob(cfg: ModelConfig) -> str:
    return "moe_hidden" if cfg.num_experts else "ffn_hidden"


def match_params(cfg: ModelConfig, target: int, match: str, tolerance: float) -> ModelConfig:
    """``cfg`` with its FFN width (:func:`ffn_knob`) set so :func:`budget_params` is closest to ``target``."""
    knob = ffn_knob(cfg)
    x0 = getattr(cfg, knob)
    p0, p1 = budget_params(cfg, match), budget_params(cfg.replace(**{knob: 2 * x0}), match)
    x = round(x0 + (target - p0) * x0 / (p1 - p0))  # affine in the width
    if x < 1:
        raise ValueError(f"match: {cfg.name} has {p0 - (p1 - p0):,} parameters outside its FFN, more than the "
                         f"budget {target:,}; widen the model or pick a cheaper reference")
    matched = cfg.replace(**{knob: x})
    error = budget_params(matched, match) / target - 1
    if abs(error) > tolerance:
        raise ValueError(f"match: {cfg.name} lands {error:+.1%} from the budget at {knob}={x} "
                         f"(tolerance {tolerance:.0%}); the width is too coarse at this size")
    return matched


def architecture_table(b: Budget) -> tuple[list[tuple[str, str, ModelConfig]], list[tuple[str, str, ModelConfig]]]:
    """``(main, ablation)``: ``(key, label, unmatched config)`` rows at this budget's depth."""
    if b.layers % 8:
        raise ValueError(f"layers: must be a multiple of 8 (the 7:1 ablation unit), got {b.layers}")
    table = {label: (pattern, extra) for label, pattern, extra in A.ARCHITECTURES}
    main = []
    for key in dict.fromkeys((REFERENCE, *b.archs)):
        pattern, extra = table[A.KEYS[key]]
        main.append((key, A.KEYS[key], base_config(A.KEYS[key], pattern * (b.layers // len(pattern)), extra, b)))
    ablation = []
    if b.ablation:
        _, extra = table[A.KEYS[ABLATION_BASE]]
        for ratio, unit in ABLATION:
            label = f"Kimi Linear {ratio}" if unit != "M" else "Kimi Linear, MLA only"
            ablation.append((ratio, label, base_config(label, unit * (b.layers // len(unit)), extra, b)))
    return main, ablation


# ----------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------
def run(quick: bool = False, out: str = "results", seed: int = 0, archs: Optional[Sequence[str]] = None,
        steps: Optional[int] = None, lrs: Optional[Sequence[float]] = None, match: Optional[str] = None,
        no_ablation: bool = False, compile_workers: Optional[int] = None) -> dict:
    """Train every architecture (and the ablation) at equal parameters; validation loss (see the module doc)."""
    b = make_budget(quick, archs, steps, lrs, match, ablation=not no_ablation)
    main, ablation = architecture_table(b)
    target = budget_params(main[0][2], b.match)  # the reference row, unmatched
    configs: dict[ModelConfig, LMSweep] = {}  # one run per distinct model (the ablation's 3:1 is the main row)
    rows = []
    for section, entries in (("main", main), ("ablation", ablation)):
        for key, label, cfg in entries:
            if section == "main" and key not in b.archs:
                continue
            cfg = match_params(cfg, target, b.match, b.tolerance)
            same = cfg.replace(name="")
            if same not in configs:
                configs[same] = LMSweep(cfg, lrs=b.lrs, steps=b.steps, batch=b.batch, seed=seed,
                                        log_every=b.steps // b.evals)
            counts = accounting.param_counts(cfg)
            rows.append({"section": section, "key": key, "architecture": label, "pattern": cfg.pattern,
                         "config": same, "ffn_knob": ffn_knob(cfg), "ffn_width": getattr(cfg, ffn_knob(cfg)),
                         "params_matched": budget_params(cfg, b.match), "params_total": counts["total"],
                         "params_active": counts["active"],
                         "match_error": budget_params(cfg, b.match) / target - 1})

    train = text_rows("train", b.seq_len, b.train_rows)
    val = text_rows("val", b.seq_len, b.val_rows)
    t_start = time.perf_counter()
    names = {same: sweep.cfg.name for same, sweep in configs.items()}
    partial = dict(C.provenance(NAME, quick), budget=dataclasses.asdict(b), target_params=target)
    results = run_sweeps(list(configs.items()), train, val, "lm", compile_workers, on_result=lambda done: C.save_partial(
        dict(partial, finished={names[c]: r for c, r in done.items()}), NAME, out))
    for row in rows:
        row.update(results[row.pop("config")])

    record = C.provenance(NAME, quick)
    record.update(budget=dataclasses.asdict(b), target_params=target, wall_s=time.perf_counter() - t_start,
                  data={"train_rows": int(train["tokens"].shape[0]), "val_rows": int(val["tokens"].shape[0]),
                        "seq_len": b.seq_len, "corpus": "stdlib (byte tokens)"},
                  rows=rows)
    return C.finish(record, NAME, out, plot(record))


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------
def plot(record: dict):
    import matplotlib.pyplot as plt

    b = record["budget"]
    main = [r for r in record["rows"] if r["section"] == "main"]
    abl = [r for r in record["rows"] if r["section"] == "ablation"]
    fig, axes = plt.subplots(1, 3 if abl else 2, figsize=(18 if abl else 12.5, 5.2),
                             gridspec_kw={"width_ratios": [1.2, 1.2, 0.8] if abl else [1, 1]})
    ax = axes[0]
    y = np.arange(len(main))
    ax.barh(y, [r["val_loss"] for r in main], color=[f"C{i}" for i in range(len(main))])
    ax.set_yticks(y, [f"{r['architecture'][:30]}\n{r['params_matched'] / 1e6:.2f}M" for r in main], fontsize=7)
    ax.invert_yaxis()
    lo = min(r["val_loss"] for r in main)
    ax.set_xlim(lo * 0.95, max(r["val_loss"] for r in main) * 1.02)
    for i, r in enumerate(main):
        ax.text(r["val_loss"], i, f" {r['val_loss']:.3f}", va="center", fontsize=7)
    ax.set_xlabel("validation loss (nats / byte)")
    ax.set_title(f"equal {b['match']} parameters ({record['target_params'] / 1e6:.2f}M), {b['steps']} steps",
                 fontsize=10)
    ax = axes[1]
    for i, r in enumerate(main):
        ax.plot(r["val_steps"], r["val_curve"], "o-", ms=3, color=f"C{i}", label=r["architecture"][:30])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title("validation loss during training (best lr)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if abl:
        ax = axes[2]
        best = min(r["val_loss"] for r in abl)
        ax.bar(range(len(abl)), [r["val_loss"] for r in abl],
               color=["C3" if r["val_loss"] == best else "C7" for r in abl])
        ax.set_xticks(range(len(abl)), [f"{r['key']}\n{r['pattern']}" for r in abl], fontsize=8)
        ax.set_ylim(best * 0.97, max(r["val_loss"] for r in abl) * 1.01)
        ax.set_ylabel("validation loss (nats / byte)")
        ax.set_title("KDA:MLA ratio (Kimi Linear: 3:1 best)", fontsize=10)
    fig.suptitle(f"Byte-level LM on the stdlib corpus: d {b['d_model']}, {b['layers']} layers, "
                 f"{b['batch']}×{b['seq_len']} tokens/step; {record['device']['description']}")
    fig.tight_layout()
    return fig


def table(record: dict) -> str:
    b = record["budget"]

    def rows_of(section):
        out = []
        for r in (r for r in record["rows"] if r["section"] == section):
            out.append([r["architecture"], r["pattern"], f"{r['params_matched']:,}", f"{100 * r['match_error']:+.2f}%",
                        f"{r['params_active']:,}", f"{r['ffn_knob']}={r['ffn_width']}", f"{r['best_lr']:.0e}",
                        f"{r['val_loss']:.4f}", f"{bits_per_byte(r['val_loss']):.3f}"])
        return out

    headers = ["architecture", "pattern", f"params ({b['match']})", "vs budget", "active", "FFN width", "best lr",
               "val loss", "bits/byte"]
    title = (f"LM at equal parameters ({'quick' if record['quick'] else 'full'}: budget {record['target_params']:,} "
             f"{b['match']} non-embedding params = GPT-2 row; d {b['d_model']}, {b['layers']} layers, {b['steps']} "
             f"steps × {b['batch']} × {b['seq_len']} bytes, lrs {b['lrs']}; {record['data']['val_rows']} val rows; "
             f"{record['device']['description']}; wall {record['wall_s']:.0f} s)")
    lines = [C.format_table(headers, rows_of("main"), title)]
    abl = [r for r in record["rows"] if r["section"] == "ablation"]
    if abl:
        best = min(abl, key=lambda r: r["val_loss"])
        lines += ["", C.format_table(headers, rows_of("ablation"),
                                     "Hybrid-ratio ablation (KDA:MLA, same depth and budget)"),
                  f"best ratio here: {best['key']} (Kimi Linear found 3:1 best)"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = C.make_parser(NAME, __doc__.splitlines()[0], quick_help=(
        "the CPU budget: GPT-2, KDA, Kimi Linear and the ablation at d 64, 60 steps; up to about 4 minutes on "
        "2 CPU cores (a smoke run, not a result); options given explicitly keep their values"))
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--archs", type=lambda t: t.split(","), default=None,
                        help=f"comma-separated subset of: {','.join(KEYS)}")
    parser.add_argument("--steps", type=C.positive_int, default=None, help="training steps per model")
    parser.add_argument("--lrs", type=C.floats, default=None, help="comma-separated peak learning rates")
    parser.add_argument("--match", choices=MATCH, default=None,
                        help="match non-embedding 'total' parameters (default) or 'active' ones")
    parser.add_argument("--no-ablation", action="store_true", help="skip the KDA:MLA ratio ablation")
    parser.add_argument("--compile-workers", type=C.positive_int, default=None,
                        help="threads compiling upcoming models (default: cores - 1, at most 8)")
    return C.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
