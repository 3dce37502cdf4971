"""The eight-row scorecard of the lineage, measured: who remembers, who forgets, what it costs.

    python -m experiments.scorecard [--quick] [--out results]
    python -m experiments.scorecard --only gpt2,linear,deltanet,gdn --out part_a     # split a long run
    python -m experiments.scorecard --merge part_a,part_b --out results              # and join the parts
    python -m experiments.scorecard --budget wide         # the first, roomier budget (see WIDE)
    python -m experiments.scorecard --budget evict        # 4x the facts: past a layer's key capacity (see EVICT)
    python -m experiments.scorecard --only gpt2,gpt2_nope  # diagnostic: GPT-2 without positions
    python -m experiments.scorecard --decode-only         # the decode column alone, untrained models

For each architecture of the lineage — GPT-2 softmax + KV cache, linear attention,
DeltaNet, Gated DeltaNet, KDA, MLA, the Kimi Linear 3:1 hybrid and a K3-style hybrid
(latent MoE + SiTU + AttnRes + bounded KDA gate) — at one width and depth:

* **memory per layer** at 1K and 1M tokens of context (bytes, from
  ``lineage_jax.accounting`` at a reference width of 16 heads × 128, bf16 caches,
  fp32 states);
* **accuracy on the four eviction probes** (``lineage_jax.data``: recall = MQAR,
  overwrite, fade, mixed half-lives) after the *same* training budget: one model
  per architecture trained on a mixture of the four probes, scored per probe on
  held-out sequences (accuracy over answer positions), and per query kind — fade's doc A
  vs doc B, mixed half-lives' long-lived facts vs junk, overwrite's original vs re-bound
  keys: the splits are where the failure modes show;
* **decode time per token** of that trained model after a prefilled context.

Fairness: every architecture gets the same width, depth (4 layers), FFN, optimizer,
steps, batch and data, and the same learning-rate search: one copy per learning rate of
the budget, all trained together as one vmapped program (``experiments.trainer.LRSweep``),
the copy with the best mean accuracy on a separate validation mixture scored on the
held-out probes; fixed-state mixers all use the short causal conv (size 4),
softmax uses learned positions (GPT-2) and the pure-MLA model RoPE (DeepSeek), the
hybrids NoPE MLA (Kimi). ``--quick`` (:data:`QUICK`: two layers, six facts per probe, 800
steps) runs in about 9 minutes on 2 idle CPU cores and separates the first-order claim — linear
attention fails recall and overwrite where the delta rules solve them; the
default (``PRESSURE``: every probe's live facts reach a head's key dimension) is sized for
one GPU: on an H200 all eight took 13 min (2026-11-29: 431 s for linear attention, DeltaNet,
GDN and KDA in two processes, 357 s for the other four, start-up included) — split it with
``--only`` to run it in parts (the JSON is rewritten after every
architecture, a cut call keeps what it finished) and join the parts with ``--merge``.

**Verdicts**: a predicted failure is confirmed when the architecture scores more than
``MARGIN`` below the probe's median over the architectures run — a gap of a point or two
between two models at 0.97–1.00 is run-to-run noise, not a failure mode.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

from experiments import common as C
from experiments import trainer as T
from experiments.architectures import ARCHITECTURES, EXTRA_ARCHITECTURES, EXTRA_KEYS, KEYS
from experiments.architectures import model_config as architecture_config
from lineage_jax import accounting
from lineage_jax import data as D
from lineage_jax.models import ModelConfig

NAME = "scorecard"
PROBES = ("mqar", "overwrite", "fade", "mixed_half_lives")
PROBE_LABELS = {"mqar": "recall", "overwrite": "overwrite", "fade": "fade", "mixed_half_lives": "mixed half-lives"}

# The rows (ARCHITECTURES: the card; EXTRA_ARCHITECTURES: diagnostic rows, run only when named
# in --only) and their short keys come from experiments.architectures.

# The predictions, stated before measuring: which architectures fail which probe. Linear attention
# only adds to its state, so it cannot recall past its capacity nor overwrite (the delta rule's
# motivation: Schlag et al. 2021, arXiv:2102.11174); DeltaNet has no forgetting, so stale facts
# crowd fresh ones (Gated DeltaNet's motivation: Yang, Kautz, Hatamizadeh 2024, arXiv:2412.06464);
# one scalar gate per head cannot keep long-lived facts while fading junk (KDA's per-channel gate:
# Kimi Team 2025, arXiv:2510.26692).
PREDICTED_FAIL = {
    "mqar": ["Linear attention"],
    "overwrite": ["Linear attention"],
    "fade": ["Linear attention", "DeltaNet"],
    "mixed_half_lives": ["Linear attention", "Gated DeltaNet"],
}


@dataclasses.dataclass(frozen=True)
class Budget:
    d_model: int
    head_dim: int
    seq_len: int
    batch: int
    steps: int
    lrs: tuple  # each architecture trains one copy per peak lr (one vmapped program); the copy
                # with the best mean accuracy on a validation mixture is scored
    vocab: int
    num_facts: int
    eval_sequences: int  # held-out rows per probe (and rows of the validation mixture)
    max_train_rows: int  # distinct training rows: min(steps × batch, this); more steps reuse them
    decode_context: int
    decode_tokens: int
    # Probe sizes beyond num_facts (defaults: the first full budget's). fade: doc A's facts (None:
    # num_facts); mixed half-lives: long-lived facts (None: num_facts // 2) and the junk queries' lag.
    fade_facts_a: Optional[int] = None
    mixed_facts: Optional[int] = None
    mixed_max_lag: int = 4
    layers: Optional[int] = None  # keep the last ``layers`` letters of each pattern (KKKM -> KM at 2); None: all


# The CPU budget (``--quick``): two layers at d 64, six facts per probe, 800 steps at lr 6e-3.
# Measured on a 2-core CPU (2026-12-01): linear attention 0.07 recall / 0.15 overwrite,
# DeltaNet 0.99 / 1.00, Gated DeltaNet 0.97 / 0.99, KDA 0.98 / 0.99, both hybrids 0.98 / 0.99;
# GPT-2 and MLA (softmax attention) stay at 0.07-0.22 — softmax learns these probes only with a
# longer budget (the default one), so the quick card reports no verdict for them.
QUICK = Budget(d_model=64, head_dim=16, seq_len=64, batch=32, steps=800, lrs=(6e-3,), vocab=64, num_facts=6,
               eval_sequences=128, max_train_rows=25_600, decode_context=256, decode_tokens=16, layers=2)
LEARNED = 0.5  # a row whose best probe stays below this learned nothing in its budget: no verdict
WIDE = Budget(d_model=256, head_dim=64, seq_len=256, batch=64, steps=3000, lrs=(1e-3, 3e-3), vocab=512, num_facts=24,
              eval_sequences=512, max_train_rows=60_000, decode_context=4096, decode_tokens=64)
# The default: capacity pressure. WIDE (the first full budget, ``--budget wide``) put no pressure
# on fade / mixed half-lives (24 + 24 facts against 4 heads × 64 key dims per layer: DeltaNet and
# GDN scored 1.00 on every probe on an H200), so the predictions for them could not be
# tested. Here every probe's live facts reach a head's key dim (32): mqar / overwrite 32 facts;
# fade 32 + 32 facts with seq_len = 4·64, so doc B is written and queried exactly once (no
# re-write passes); mixed 16 long-lived facts under a junk stream with lags up to 16. On the
# H200 (2026-11-29, docs/results.md) DeltaNet, GDN, KDA, MLA and both hybrids still reach
# 0.95–1.00 on every probe and query kind here: the predicted per-kind gaps are at most
# a few points at this width.
PRESSURE = Budget(d_model=128, head_dim=32, seq_len=256, batch=64, steps=3000, lrs=(1e-3, 3e-3), vocab=512,
                  num_facts=32, eval_sequences=512, max_train_rows=60_000, decode_context=4096, decode_tokens=64,
                  fade_facts_a=32, mixed_facts=16, mixed_max_lag=16)
# Forcing eviction (``--budget evict``; designed 2026-11-29, not yet run): the same model as
# PRESSURE, 4× the facts. 128 live facts = 4× a head's key dim and all 128 key dims of a layer's
# 4 heads: no single head, nor a layer whose heads split the facts with any slack, holds every
# fact exactly, so the memory must choose what to evict (the 4-layer model's 512 key dims could
# still hold them only by spreading facts over layers as well) — where the finer
# predictions (DeltaNet fades badly without a gate, GDN's scalar gate cannot keep long-lived
# facts under junk while KDA's per-channel gate can) should show, if anywhere; softmax/MLA
# caches grow instead. seq_len 1024 = 4 × (128 + 128) fills fade exactly
# once; batch 16 keeps PRESSURE's 16K tokens per step; vocab 1024 gives the 256 distinct keys
# fade needs. Estimated ≈ 1.2–2× PRESSURE's H200 time (same tokens; softmax rows attend 4×
# further).
EVICT = Budget(d_model=128, head_dim=32, seq_len=1024, batch=16, steps=3000, lrs=(1e-3, 3e-3), vocab=1024,
               num_facts=128, eval_sequences=512, max_train_rows=30_000, decode_context=4096, decode_tokens=64,
               fade_facts_a=128, mixed_facts=64, mixed_max_lag=16)
BUDGETS = {"pressure": PRESSURE, "wide": WIDE, "evict": EVICT}
MARGIN = 0.05  # a predicted failure must score this far below the probe's median (see the module doc)


def model_config(label: str, pattern: str, extra: dict, b: Budget) -> ModelConfig:
    """A row's config at this budget's width and depth, with room for the decode column."""
    return architecture_config(label, pattern, extra, d_model=b.d_model, head_dim=b.head_dim, vocab=b.vocab,
                               max_seq_len=max(b.seq_len, b.decode_context + b.decode_tokens), layers=b.layers)


def reference_config(pattern: str) -> ModelConfig:
    """The memory columns' reference width: 16 heads × 128, MLA latent 512 + rope 64."""
    return ModelConfig(pattern=pattern, d_model=2048, num_heads=16, head_dim=128, kv_lora_rank=512,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_hidden=8192)


def memory_per_layer(pattern: str, context: int) -> float:
    ref = reference_config(pattern)
    total = accounting.cache_bytes_per_token(ref, dtype_bytes=2) * context + accounting.state_bytes(ref, dtype_bytes=4)
    return total / ref.num_layers


def make_probes(b: Budget, seed: int):
    kw = dict(vocab_size=b.vocab, seq_len=b.seq_len, seed=seed)
    return {
        "mqar": D.get_task("mqar", num_kv_pairs=b.num_facts, **kw),
        "overwrite": D.get_task("overwrite", num_facts=b.num_facts, **kw),
        "fade": D.get_task("fade", num_facts=b.num_facts, num_facts_a=b.fade_facts_a, **kw),
        "mixed_half_lives": D.get_task("mixed_half_lives", max_lag=b.mixed_max_lag,
                                       num_facts=b.mixed_facts or max(2, b.num_facts // 2), **kw),
    }


def run(quick: bool = False, out: str = "results", seed: int = 0, steps: Optional[int] = None,
        only: Optional[list[str]] = None, compile_workers: Optional[int] = None,
        merge: Optional[list[str]] = None, budget: str = "pressure", decode_only: bool = False,
        eval_sequences: Optional[int] = None) -> dict:
    """Train, score and cost every architecture (``only``: a subset of ``KEYS``; ``budget``: a key
    of ``BUDGETS``, ignored with ``quick``). ``steps`` and ``eval_sequences`` (held-out rows per
    probe and validation rows) override the budget's, e.g. for a smoke run.

    ``merge``: instead of training, join the records of earlier calls (their ``--out`` roots or
    ``scorecard.json`` paths) into one record, table and plot.

    ``decode_only``: skip training and time only the decode column, on freshly initialised
    models (:func:`decode_column`).
    """
    if decode_only and (merge or steps is not None or eval_sequences is not None):
        raise ValueError(f"decode_only: trains nothing, so it takes neither `merge`, `steps` nor `eval_sequences` "
                         f"(got merge={merge!r}, steps={steps!r}, eval_sequences={eval_sequences!r})")
    C.refuse_with_merge(merge, **{"--quick": quick, "--seed": seed != 0, "--steps": steps is not None,
                                  "--only": only is not None, "--compile-workers": compile_workers is not None,
                                  "--budget": budget != "pressure", "--eval-sequences": eval_sequences is not None})
    if merge:
        return merged(merge, out)
    if budget not in BUDGETS:
        raise ValueError(f"budget: unknown budget {budget!r}; valid: {sorted(BUDGETS)}")
    b = QUICK if quick else BUDGETS[budget]
    named = {**KEYS, **EXTRA_KEYS}
    if only is not None:
        unknown = sorted(set(only) - set(named))
        if unknown:
            raise ValueError(f"only: unknown architecture(s) {unknown}; valid: {sorted(named)}")
    wanted = None if only is None else {named[k] for k in only}
    archs = [a for a in ARCHITECTURES + (EXTRA_ARCHITECTURES if only else []) if wanted is None or a[0] in wanted]
    if steps is not None:
        b = dataclasses.replace(b, steps=steps, max_train_rows=min(b.max_train_rows, max(steps * b.batch, b.batch)))
    if eval_sequences is not None:
        b = dataclasses.replace(b, eval_sequences=eval_sequences)
    record = C.provenance(NAME, quick)
    record["budget"] = dataclasses.asdict(b)
    record["budget_name"] = "quick" if quick else budget
    if decode_only:
        return decode_column(archs, b, seed, record, out)
    record["predicted_fail"] = PREDICTED_FAIL
    n_eval = b.eval_sequences
    train = T.stack_rows(T.Mixture(list(make_probes(b, seed).values())), min(b.steps * b.batch, b.max_train_rows))
    val = T.stack_rows(T.Mixture(list(make_probes(b, seed + 2_000_003).values())), n_eval)
    test_tasks = make_probes(b, seed + 1_000_003)
    test = {p: T.stack_rows(task, n_eval) for p, task in test_tasks.items()}
    kinds = {p: kind_masks(task, test[p]) for p, task in test_tasks.items()}
    cfgs = [model_config(label, pattern, extra, b) for label, pattern, extra in archs]
    jobs = [(T.LRSweep(cfg, lrs=b.lrs, steps=b.steps, batch=b.batch, seed=seed),
             dict(train_rows=len(train["tokens"]), seq_len=b.seq_len, eval_shapes=[(len(b.lrs), n_eval, b.seq_len)]))
            for cfg in cfgs]
    rows = []
    bar = C.progress(desc="scorecard", total=b.steps * len(archs), unit="step")
    bar.write(f"scorecard: {len(archs)} architectures x {b.steps} steps ({record['budget_name']} budget); "
              f"compiling the first ...")
    for i, ((label, pattern, _), cfg, (sweep, compile_s)) in enumerate(
            zip(archs, cfgs, T.compiled_ahead(jobs, compile_workers))):
        bar.write(f"[{i + 1}/{len(archs)}] {label}: training ({cfg.num_layers} layers, compiled in {compile_s:.0f} s)")
        bar.set_postfix_str(label)
        t0 = time.perf_counter()
        losses = sweep.train(train, bar=bar)  # [chunks, lrs]
        train_s = time.perf_counter() - t0
        bar.write(f"[{i + 1}/{len(archs)}] {label}: scoring the probes and timing decode ...")
        val_acc = sweep.accuracy(val)
        best = int(np.argmax(val_acc))
        acc, by_kind = {}, {}
        for p in PROBES:
            hits, scored = sweep.evaluate(test[p], copies=range(len(b.lrs)))
            acc[p] = float(hits[best].sum() / max(float(scored.sum()), 1.0))
            by_kind[p] = {}
            for kind, mask in kinds[p].items():  # the same rows, scored on one query kind only
                hits, scored = sweep.evaluate(dict(test[p], mask=mask), copies=range(len(b.lrs)))
                by_kind[p][kind] = float(hits[best].sum() / max(float(scored.sum()), 1.0))
        model = sweep.model(best)
        rows.append({
            "architecture": label, "pattern": pattern, "trained_pattern": cfg.pattern,
            "params": accounting.param_counts(cfg)["total"],
            "memory_per_layer_1k": memory_per_layer(pattern, 1 << 10),
            "memory_per_layer_1m": memory_per_layer(pattern, 1 << 20),
            "accuracy": acc, "accuracy_by_kind": by_kind, "best_lr": b.lrs[best], "val_accuracy_per_lr": val_acc.tolist(),
            "final_loss": float(losses[-1, best]), "loss_curve": losses[:, best].tolist(),
            "train_s": train_s, "compile_s": compile_s,
            "decode_ms_per_token": T.decode_ms_per_token(model, b.vocab, b.decode_context, b.decode_tokens, seed=seed),
        })
        # Written after every architecture: a run stopped early keeps what it measured.
        partial = dict(record, rows=rows, prediction_check=check_predictions(rows),
                       complete=len(rows) == len(archs))
        result = C.finish(partial, NAME, out, plot(rows, b))
    bar.close()
    return result


DECODE_NAME = NAME + "_decode"


def decode_column(archs: list, b: Budget, seed: int, record: dict, out: str) -> dict:
    """The card's decode column alone: ms per token after a ``decode_context`` prefill, timed
    like the card (``trainer.decode_ms_per_token``) on freshly initialised models.

    A decode step's cost does not depend on the weights' values — except through MoE routing,
    whose load balance differs between random and trained routers (the expert matmuls are the
    same size either way). Written to ``<out>/scorecard_decode/`` so it never replaces a card."""
    from flax import nnx

    from lineage_jax.models import Decoder

    rows = []
    for label, pattern, extra in C.progress(archs, desc="decode", unit="arch"):
        cfg = model_config(label, pattern, extra, b)
        model = Decoder(cfg, rngs=nnx.Rngs(seed))
        rows.append({"architecture": label, "pattern": pattern, "trained_pattern": cfg.pattern,
                     "params": accounting.param_counts(cfg)["total"],
                     "decode_ms_per_token": T.decode_ms_per_token(model, b.vocab, b.decode_context, b.decode_tokens,
                                                                  seed=seed)})
        result = C.finish(dict(record, decode_only=True, rows=rows, complete=len(rows) == len(archs)),
                          DECODE_NAME, out, decode_plot(rows, b))
    return result


def decode_plot(rows: list[dict], b: Budget):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    y = np.arange(len(rows))
    ax.barh(y, [r["decode_ms_per_token"] for r in rows], color="C2")
    ax.set_yticks(y, [r["architecture"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"decode ms per token (batch 1, after {b.decode_context} tokens of context)")
    ax.set_title(f"scorecard decode column (d {b.d_model}, untrained weights)")
    fig.tight_layout()
    return fig


def kind_masks(task, rows: dict) -> dict[str, np.ndarray]:
    """Per scored query kind of ``task`` (e.g. fade: "a", "b"), the mask of ``rows`` (rows 0..n-1 of
    ``task``, :func:`trainer.stack_rows`) restricted to that kind's answer positions."""
    n = len(rows["mask"])
    kinds = np.stack([task.info(i)["kinds"] for i in range(n)])
    return {name: (rows["mask"] * (kinds == j + 1)).astype(rows["mask"].dtype)
            for j, name in enumerate(task.KINDS) if name in task.SCORED}


def merged(sources: Sequence[str], out: str) -> dict:
    """One record from the records of several calls: the same budget and seed-independent data
    settings, disjoint architectures; rows in the scorecard's order, predictions re-checked."""
    records = C.load_records(NAME, sources)
    defaults = {f.name: f.default for f in dataclasses.fields(Budget) if f.default is not dataclasses.MISSING}
    for rec in records:
        rec["budget"] = {**defaults, **rec["budget"]}  # records written before a field existed had its default
    for r, src in zip(records[1:], sources[1:]):
        if r["budget"] != records[0]["budget"] or r["quick"] != records[0]["quick"]:
            diff = sorted(k for k in r["budget"] if r["budget"][k] != records[0]["budget"].get(k))
            raise ValueError(f"merge: {src!r} has another budget than {sources[0]!r} (differs in {diff or ['quick']})")
    rows = [row for r in records for row in r["rows"]]
    names = [row["architecture"] for row in rows]
    if len(set(names)) < len(names):
        raise ValueError(f"merge: an architecture appears in more than one record: {sorted(names)}")
    order = [a[0] for a in ARCHITECTURES]
    rows.sort(key=lambda row: order.index(row["architecture"]) if row["architecture"] in order else len(order))
    b = Budget(**{k: tuple(v) if isinstance(v, list) else v for k, v in records[0]["budget"].items()})
    record = dict(records[0], rows=rows, prediction_check=check_predictions(rows),
                  complete=set(names) >= set(order), merged_from=[
                      {"source": str(s), "date": r["date"], "git_commit": r["git_commit"]} for s, r in zip(sources, records)])
    return C.finish(record, NAME, out, plot(rows, b))


def untaught(rows: list[dict]) -> list[str]:
    """Rows that learned no probe in their budget (best accuracy below ``LEARNED``) and are not
    predicted to fail any: their scores say nothing about the architecture, only the budget."""
    predicted = {n for names in PREDICTED_FAIL.values() for n in names}
    return [r["architecture"] for r in rows
            if r["architecture"] not in predicted and max(r["accuracy"].values()) < LEARNED]


def check_predictions(rows: list[dict]) -> dict:
    """Per probe: did the architectures predicted to fail (``PREDICTED_FAIL``) score more than ``MARGIN`` below
    the probe's median over the rows that learned (``untaught`` rows excluded), and how does the
    best row score?"""
    skip = set(untaught(rows))
    checks = {}
    for p in PROBES:
        scores = {r["architecture"]: r["accuracy"][p] for r in rows if r["architecture"] not in skip}
        if not scores:
            continue
        median = float(np.median(list(scores.values())))
        best = max(scores, key=scores.get)
        checks[p] = {name: {"accuracy": scores[name], "median": median, "best": best, "best_accuracy": scores[best],
                            "confirmed": scores[name] < median - MARGIN}
                     for name in PREDICTED_FAIL[p] if name in scores}
    return checks


def plot(rows: list[dict], b: Budget):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.3, 1]})
    acc = np.array([[r["accuracy"][p] for p in PROBES] for r in rows])
    im = ax1.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax1.set_xticks(range(len(PROBES)), [PROBE_LABELS[p] for p in PROBES])
    ax1.set_yticks(range(len(rows)), [r["architecture"] for r in rows])
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            ax1.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", color="w" if acc[i, j] < 0.6 else "k")
    ax1.set_title(f"eviction probes: accuracy after {b.steps} steps (same budget)")
    fig.colorbar(im, ax=ax1, fraction=0.03)
    y = np.arange(len(rows))
    ax2.barh(y - 0.2, [r["memory_per_layer_1k"] for r in rows], 0.4, label="1K tokens")
    ax2.barh(y + 0.2, [r["memory_per_layer_1m"] for r in rows], 0.4, label="1M tokens")
    ax2.set_xscale("log")
    ax2.set_yticks(y, [f"{r['architecture']}\n{r['decode_ms_per_token']:.2f} ms/token" for r in rows], fontsize=7)
    ax2.invert_yaxis()
    ax2.set_xlabel("memory per layer (bytes; 16 heads × 128, bf16 cache / fp32 state)")
    ax2.legend()
    ax2.set_title("what it costs")
    fig.tight_layout()
    return fig


def fmt_binary(n: float) -> str:
    """Bytes in binary units, as the README's tables (1 MiB = 2^20 bytes)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def table(record: dict) -> str:
    if record.get("decode_only"):
        b = record["budget"]
        return C.format_table(["architecture", "params", "decode ms/tok"],
                              [[r["architecture"], f"{r['params']:,}", f"{r['decode_ms_per_token']:.2f}"]
                               for r in record["rows"]],
                              f"Scorecard decode column ({record['budget_name']}: d={b['d_model']}, untrained weights, "
                              f"{b['decode_tokens']} tokens after {b['decode_context']}; "
                              f"device {record['device']['description']})")
    rows = []
    for r in record["rows"]:
        rows.append([r["architecture"], fmt_binary(r["memory_per_layer_1k"]), fmt_binary(r["memory_per_layer_1m"]),
                     *[f"{r['accuracy'][p]:.2f}" for p in PROBES], f"{r['decode_ms_per_token']:.2f}"])
    headers = ["architecture", "mem/layer 1K", "mem/layer 1M", *[PROBE_LABELS[p] for p in PROBES], "decode ms/tok"]
    b = record["budget"]
    name = record.get("budget_name", "quick" if record["quick"] else "wide")
    title = (f"Scorecard ({name}: d={b['d_model']}, {b.get('layers') or 4} layers, {b['steps']} steps × "
             f"{b['batch']} × {b['seq_len']} tokens; device {record['device']['description']})")
    lines = [C.format_table(headers, rows, title)]
    split = [r for r in record["rows"] if r.get("accuracy_by_kind")]
    if split:  # the failure modes live in the splits: fade's doc B vs A, mixed's long-lived facts vs junk
        cols = [(p, k) for p in PROBES for k in split[0]["accuracy_by_kind"][p]]
        lines += ["", C.format_table(["architecture", *[f"{PROBE_LABELS[p]}: {k}" for p, k in cols]],
                                     [[r["architecture"], *[f"{r['accuracy_by_kind'][p][k]:.2f}" for p, k in cols]]
                                      for r in split], "Accuracy per query kind")]
    lines += ["", "Predictions, stated before measuring by the lineage's source documents: which architecture "
                  "fails which probe.", f"A failure is confirmed when the row scores more than {MARGIN:.2f} below the "
                  "probe's median over the rows that learned the probes.", ""]
    for p, names in record["prediction_check"].items():
        if not names:
            lines.append(f"  {PROBE_LABELS[p]}: the architectures predicted to fail were not run")
        for n, v in names.items():
            word = "confirmed" if v["confirmed"] else "not confirmed"
            lines.append(f"  predicted: {n} fails {PROBE_LABELS[p]} — {word}: {v['accuracy']:.2f} vs median "
                         f"{v['median']:.2f} (best: {v['best']} {v['best_accuracy']:.2f})")
    missing = untaught(record["rows"])
    if missing:
        lines += ["", f"Not taught in this budget (no probe above {LEARNED}; no verdict from these rows): "
                  + ", ".join(missing) + "."]
        if record.get("quick"):
            lines.append("  With the default budget on a GPU, MLA and softmax attention with RoPE learn the probes; "
                         "GPT-2 with learned positions only in part (docs/results.md).")
    lines += ["", "Memory per layer: KV cache or state at 16 heads x 128 (bf16 cache, float32 state), "
                  "in binary units (1 MiB = 2^20 bytes)."]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = C.make_parser(NAME, __doc__.splitlines()[0])
    parser._option_string_actions["--quick"].help = (
        "the CPU budget: two layers, six facts per probe, 800 steps; about 9 minutes on 2 idle CPU cores "
        "(linear attention fails recall/overwrite, the delta rules solve them; softmax rows are not taught)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--steps", type=C.positive_int, default=None, help="override the training steps")
    parser.add_argument("--eval-sequences", type=C.positive_int, default=None,
                        help="override the held-out rows per probe (and the validation rows), e.g. for a smoke run")
    parser.add_argument("--compile-workers", type=C.positive_int, default=None,
                        help="threads compiling the next architectures while one trains (default: cores - 1, at most 8)")
    parser.add_argument("--only", type=lambda t: t.split(","), default=None,
                        help=f"comma-separated subset of: {','.join(KEYS)}; "
                             f"diagnostic rows (not part of the card): {','.join(EXTRA_KEYS)}")
    parser.add_argument("--budget", default="pressure", choices=sorted(BUDGETS),
                        help="full-size budget (ignored with --quick): pressure (the default: probes at capacity), "
                             "wide (d 256, no capacity pressure) or evict (4x the facts of pressure: past capacity)")
    parser.add_argument("--merge", type=lambda t: t.split(","), default=None,
                        help="join earlier calls' records (their --out roots or scorecard.json paths) instead of training")
    parser.add_argument("--decode-only", action="store_true",
                        help="time only the decode column, on untrained models (written to scorecard_decode/)")
    return C.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
