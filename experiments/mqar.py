"""Zoology's MQAR sweep: which memories recall N key-value pairs, and how wide must they be?

    python -m experiments.mqar [--quick] [--out results] [--archs gpt2,deltanet,...]
        [--lengths 64,128,256:16] [--widths 64,128,256] [--lrs 1e-4,1e-3] [--steps N] [--seed S]
    python -m experiments.mqar --merge results_a,results_b --out results    # join split calls

Multi-query associative recall (Arora, Eyuboglu et al., *Zoology*, 2023, Figure 2): a
sequence of ``L`` tokens binds ``N`` keys to values, then queries every key once at
power-law gaps (``lineage_jax.data.MQAR``, Zoology's ``power_a = 0.01``, zeros between
queries as in Zoology's Figure 2). **Measured:** argmax accuracy over every query position
of 1000 held-out sequences, for each architecture × ``(L, N)`` × ``d_model``, best of four
learning rates. **Grid** (Zoology's): vocab 8192; ``(L, N)`` ∈ {(64, 4), (128, 8),
(256, 16), (512, 64)}; ``d_model`` ∈ {64, 128, 256}; 2 layers; learning rates
``np.logspace(-4, -2, 4)`` = 1e-4, 4.6e-4, 2.2e-3, 1e-2 (Zoology's sweep).

**Architectures**: the scorecard's eight (``scorecard.KEYS``), each cut to two layers —
``SS`` GPT-2 (learned positions), ``LL`` linear attention, ``DD`` DeltaNet, ``GG`` Gated
DeltaNet, ``KK`` KDA, ``MM`` MLA (RoPE), and the hybrids as ``KM``: a 1:1 KDA+MLA stack is
the only hybrid two layers allow (the 3:1 ratio needs four). ``kimi_linear`` keeps Kimi
Linear's FFN (dense first layer, then 8-expert top-2 MoE + a shared expert);
``k3`` adds K3's latent MoE, SiTU, the bounded KDA gate, gated outputs and AttnRes
(one block of both layers). MQAR exercises the token mixers, so the two ``KM`` rows differ
only off the mixer path; they are kept because they are scorecard rows (drop them with
``--archs``).

**Fairness**: every architecture gets the same width, 64-wide heads (1/2/4 heads at
d = 64/128/256, so every fixed-state memory holds ``d × 64`` numbers per layer), FFN 4d,
optimizer (AdamW, warmup + cosine, wd 0.1, clip 1), steps, tokens per step (Zoology's:
16K, batch 256/128/64/32 at L = 64/128/256/512) and the *same* training sequences in the
same order (one pre-generated training set per length, shared by every architecture,
width and learning rate). Each architecture is scored at its best learning rate, chosen on
the held-out accuracy — what Zoology reports.

**Cost**: the four learning rates train as one program (``trainer.LRSweep``: four stacked
copies under ``jax.vmap``, updates scaled by ``lr_i / max(lr)``, which for decoupled AdamW is
exactly training at ``lr_i``), in on-device ``lax.scan`` chunks over a device-resident
dataset, and upcoming runs compile in a thread pool while one trains.

**Budgets**: Zoology trains 64 epochs of 100K sequences (~25K steps); the full default here
is 600 steps (10M tokens) per run on up to 100K distinct sequences per length. Measured on
one H200 with ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`` (Triton GEMM autotuning
dominates these small models' compile time; with it off a run compiles ~3× faster and steps
no slower, while ``--xla_gpu_autotune_level=0`` made steps ~2.5× slower): a step of the four
copies takes 15-40 ms at d = 128 (GPT-2 15, DeltaNet 22, K3-style 24, KDA 40 ms), a run
compiles in 20-40 s (hidden behind training); the 96-run grid takes ~35-40 minutes of H200 time
(measured 2026-11-30: ≈ 20 s per run at L = 256-512, plus ≈ 40 s of start-up per call). Split
it by ``--lengths`` into calls of ~7 minutes and join them with ``--merge``; the record is also
written after every run (``complete: false`` until the last), so a call stopped by a time
limit keeps what it finished. What 600 steps buys (measured): DeltaNet solves (64, 4) within
300 steps and (256, 16) within ~750; KDA reaches 51% on (64, 4) at 300 steps; GPT-2 with
learned positions learns slowest (26% on (64, 4) after 1500 steps). So read the plot as
"recall learned within a fixed, modest budget" — ease of optimization is part of what it
shows; Zoology's "attention solves MQAR" is a statement at convergence. At L = 256 and 512 the
600-step budget is below every architecture's learning threshold (H200 grid, 2026-11-30: all
≤ 0.02): pass ``--steps`` (e.g. 1500) for those lengths, as a record of its own.
``--quick`` (2 CPU cores, 2-3 minutes): GPT-2 and DeltaNet, (L, N) = (64, 4), d = 64,
vocab 512, two learning rates, 150 steps of 4K tokens — a smoke run of the pipeline, not a
result (though DeltaNet already recalls most pairs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Optional, Sequence

import jax
import numpy as np

from experiments import architectures as A
from experiments import common as C
from experiments import trainer as T
from lineage_jax import accounting
from lineage_jax import data as D

NAME = "mqar"
ZOOLOGY_PAIRS = {64: 4, 128: 8, 256: 16, 512: 64}  # sequence length -> key-value pairs (Zoology Figure 2)
ZOOLOGY_LRS = tuple(float(f"{lr:.3g}") for lr in np.logspace(-4, -2, 4))  # 1e-4, 4.64e-4, 2.15e-3, 1e-2
KEYS = tuple(A.KEYS)  # gpt2, linear, deltanet, gdn, kda, mla, kimi_linear, k3


@dataclasses.dataclass(frozen=True)
class Budget:
    archs: tuple[str, ...]
    lengths: tuple[tuple[int, int], ...]  # (L, N pairs)
    widths: tuple[int, ...]
    lrs: tuple[float, ...]
    steps: int
    tokens_per_step: int  # batch = tokens_per_step // L
    vocab: int
    max_train_rows: int  # distinct training sequences per length: min(steps × batch, this)
    test_rows: int
    layers: int = 2


FULL = Budget(archs=KEYS, lengths=tuple(ZOOLOGY_PAIRS.items()), widths=(64, 128, 256), lrs=ZOOLOGY_LRS, steps=600,
              tokens_per_step=1 << 14, vocab=8192, max_train_rows=100_000, test_rows=1000)
QUICK = Budget(archs=("gpt2", "deltanet"), lengths=((64, 4),), widths=(64,), lrs=(2.15e-3, 1e-2), steps=150,
               tokens_per_step=1 << 12, vocab=512, max_train_rows=9600, test_rows=128)


# ----------------------------------------------------------------------------
# The sweep.
# ----------------------------------------------------------------------------
def parse_lengths(items: Sequence, arg: str = "lengths") -> tuple[tuple[int, int], ...]:
    """``64`` (Zoology's N for that L) or ``"256:16"`` (explicit N) -> ``(L, N)`` pairs."""
    out = []
    for item in items:
        try:
            L, N = (int(v) for v in str(item).split(":")) if ":" in str(item) else (int(item), ZOOLOGY_PAIRS[int(item)])
        except (KeyError, ValueError):
            raise ValueError(f"{arg}: {item!r} is not one of Zoology's lengths {sorted(ZOOLOGY_PAIRS)} "
                             "nor of the form L:pairs") from None
        if L < 4 * N or N < 1:
            raise ValueError(f"{arg}: {item!r} needs pairs >= 1 and L >= 4 × pairs")
        out.append((L, N))
    if not out:
        raise ValueError(f"{arg}: give at least one length")
    return tuple(dict.fromkeys(out))


def make_budget(quick: bool, archs=None, lengths=None, widths=None, lrs=None, steps=None) -> Budget:
    b = QUICK if quick else FULL
    if lrs is not None and (not lrs or any(not lr > 0 for lr in lrs)):
        raise ValueError(f"lrs: need positive learning rates, got {lrs!r}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    b = dataclasses.replace(
        b, archs=tuple(dict.fromkeys(a[0] for a in A.select(archs or b.archs, b.layers))),
        lengths=b.lengths if lengths is None else parse_lengths(lengths),
        widths=b.widths if widths is None else A.check_widths(widths),
        lrs=b.lrs if lrs is None else tuple(float(lr) for lr in lrs), steps=steps or b.steps)
    for L, N in b.lengths:
        if L > b.tokens_per_step:
            raise ValueError(f"lengths: L={L} exceeds the {b.tokens_per_step} tokens of a step")
        try:
            D.get_task("mqar", vocab_size=b.vocab, seq_len=L, num_kv_pairs=N)
        except ValueError as e:
            raise ValueError(f"lengths: {L}:{N}: {e}") from None
    return b


def datasets(b: Budget, L: int, N: int, seed: int) -> tuple[dict, dict]:
    """The shared training set and the held-out test set for one length (host arrays)."""
    kw = dict(vocab_size=b.vocab, seq_len=L, num_kv_pairs=N, random_non_queries=False)
    train = T.stack_rows(D.get_task("mqar", seed=seed, **kw), train_rows(b, L))
    test = T.stack_rows(D.get_task("mqar", seed=seed + 1_000_003, **kw), b.test_rows)
    return train, test


def train_rows(b: Budget, L: int) -> int:
    return min(b.steps * (b.tokens_per_step // L), b.max_train_rows)


def run(quick: bool = False, out: str = "results", seed: int = 0, steps: Optional[int] = None,
        archs: Optional[list[str]] = None, widths: Optional[list[int]] = None, lengths: Optional[list] = None,
        lrs: Optional[list[float]] = None, compile_workers: Optional[int] = None,
        merge: Optional[list[str]] = None) -> dict:
    """Train and score every architecture × length × width, best of ``lrs`` (see the module doc).

    ``merge``: instead of training, combine the runs of earlier calls (their ``--out`` roots or
    ``mqar.json`` paths; e.g. one call per ``--lengths``) into one record, table and plot.
    """
    C.refuse_with_merge(merge, **{"--quick": quick, "--seed": seed != 0, "--steps": steps is not None,
                                  "--archs": archs is not None, "--widths": widths is not None,
                                  "--lengths": lengths is not None, "--lrs": lrs is not None,
                                  "--compile-workers": compile_workers is not None})
    if merge:
        return merged(merge, out)
    b = make_budget(quick, archs, lengths, widths, lrs, steps)
    plan = [(L, N, d, arch) for L, N in b.lengths for d in b.widths for arch in A.select(b.archs, b.layers)]
    jobs = []
    for L, N, d, (key, label, pattern, extra) in plan:
        sweep = T.LRSweep(A.wide_head_config(label, pattern, extra, d, L, b.vocab), lrs=b.lrs, steps=b.steps,
                          batch=b.tokens_per_step // L, seed=seed)
        jobs.append((sweep, dict(train_rows=train_rows(b, L), seq_len=L, eval_shapes=[(len(b.lrs), b.test_rows, L)])))

    record = C.provenance(NAME, quick)
    record["budget"] = dataclasses.asdict(b)
    results, on_device, t_start = [], {}, time.perf_counter()
    bar = C.progress(desc="mqar", total=b.steps * len(plan), unit="step")
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mqar-data") as data_pool:
        host = {(L, N): data_pool.submit(datasets, b, L, N, seed) for L, N in b.lengths}  # generated ahead, in order
        compiled = T.compiled_ahead(jobs, compile_workers)
        for (L, N, d, (key, label, pattern, _)), (sweep, compile_s) in zip(plan, compiled):
            if (L, N) not in on_device:
                on_device = {(L, N): jax.device_put(host.pop((L, N)).result())}  # one length at a time
            train, test = on_device[(L, N)]
            t0 = time.perf_counter()
            losses = sweep.train(train, bar=bar)
            train_s = time.perf_counter() - t0
            acc = sweep.accuracy(test)
            best = int(np.argmax(acc))
            results.append({
                "arch": key, "architecture": label, "pattern": pattern, "seq_len": L, "num_kv_pairs": N,
                "d_model": d, "params": accounting.param_counts(sweep.cfg)["total"], "batch": sweep.batch,
                "lrs": list(b.lrs), "accuracy_per_lr": acc, "final_loss_per_lr": losses[-1],
                "best_lr": b.lrs[best], "best_accuracy": acc[best], "loss_curve": losses[:, best],
                "train_s": train_s, "compile_s": compile_s,
            })
            # Saved after every run (a call stopped by a time limit keeps what it finished).
            done = dict(record, runs=results, wall_s=time.perf_counter() - t_start, complete=len(results) == len(plan))
            saved = C.finish(done, NAME, out, plot(results, b))
    bar.close()
    return saved


def merged(sources: Sequence[str], out: str) -> dict:
    """One record from the records of several calls (same steps, vocab and lrs; disjoint runs)."""
    records = C.load_records(NAME, sources)
    same = ("steps", "vocab", "lrs", "tokens_per_step", "layers")
    for r in records[1:]:
        diff = [k for k in same if r["budget"][k] != records[0]["budget"][k]]
        if diff:
            raise ValueError(f"merge: records differ in {diff}; merge only calls of one budget")
    runs = [run for r in records for run in r["runs"]]
    keys = [(r["arch"], r["seq_len"], r["num_kv_pairs"], r["d_model"]) for r in runs]
    if len(set(keys)) < len(keys):
        raise ValueError("merge: the same (architecture, length, width) run appears in more than one record")
    budget = dict(records[0]["budget"], archs=list(dict.fromkeys(r["arch"] for r in runs)),
                  lengths=sorted({(r["seq_len"], r["num_kv_pairs"]) for r in runs}),
                  widths=sorted({r["d_model"] for r in runs}))
    record = dict(records[0], budget=budget, runs=runs, wall_s=sum(r["wall_s"] for r in records),
                  complete=all(r.get("complete", True) for r in records), merged_from=[str(s) for s in sources])
    b = Budget(**{k: tuple(map(tuple, v)) if k == "lengths" else tuple(v) if isinstance(v, list) else v
                  for k, v in budget.items()})
    return C.finish(record, NAME, out, plot(runs, b))


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------
def _style(key: str, keys: Sequence[str]) -> dict:
    """One line style per architecture, the same in every panel: a scorecard row gets its own
    colour (its place in ``KEYS``), a diagnostic row (``gdn_nogate``, ``kda_unit_a``, ...) its
    parent's colour, dashed, with its own marker."""
    if key in KEYS:
        return dict(color=f"C{KEYS.index(key)}", marker="o", linestyle="-")
    parent = next((k for k in KEYS if key.startswith(k + "_")), None)
    extra = [k for k in keys if k not in KEYS]
    i = extra.index(key) if key in extra else 0
    color = f"C{KEYS.index(parent)}" if parent else f"C{(len(KEYS) + i) % 10}"
    return dict(color=color, marker="s^Dv<>ph"[i % 8], linestyle="--")


def plot(results: list[dict], b: Budget):
    import matplotlib.pyplot as plt

    lengths = sorted({(r["seq_len"], r["num_kv_pairs"]) for r in results})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths) + 1.5, 4), sharey=True, squeeze=False)
    archs = list(dict.fromkeys((r["arch"], r["architecture"]) for r in results))
    style = {label: _style(key, [k for k, _ in archs]) for key, label in archs}
    for ax, (L, N) in zip(axes[0], lengths):
        for _, arch in archs:
            pts = sorted((r["d_model"], r["best_accuracy"]) for r in results
                         if r["architecture"] == arch and r["seq_len"] == L and r["num_kv_pairs"] == N)
            if pts:
                ax.plot(*zip(*pts), label=arch, **style[arch])
        ax.set_xscale("log", base=2)
        ax.set_xticks(b.widths, [str(w) for w in b.widths])
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("model dimension")
        ax.set_title(f"L = {L}, {N} key-value pairs")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"MQAR accuracy (best of {len(b.lrs)} lrs)")
    # The legend names every architecture drawn, not only those of the last panel (a diagnostic
    # row run at one length only would otherwise be unlabelled).
    handles = [plt.Line2D([], [], label=arch, **style[arch]) for _, arch in archs]
    axes[0][-1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle(f"MQAR, {b.layers} layers, vocab {b.vocab}, {b.steps} steps × {b.tokens_per_step} tokens")
    fig.tight_layout()
    return fig


def table(record: dict) -> str:
    b, runs = record["budget"], record["runs"]
    widths = sorted({r["d_model"] for r in runs})
    cell = {(r["architecture"], r["seq_len"], r["num_kv_pairs"], r["d_model"]): r for r in runs}
    rows = []
    for arch in dict.fromkeys(r["architecture"] for r in runs):
        for L, N in sorted({(r["seq_len"], r["num_kv_pairs"]) for r in runs}):
            row = [arch, f"{L}/{N}"]
            for d in widths:
                r = cell.get((arch, L, N, d))
                row.append("-" if r is None else f"{r['best_accuracy']:.3f} @{r['best_lr']:.0e}")
            train_s = [cell[k]["train_s"] for k in cell if k[:3] == (arch, L, N)]
            rows.append(row + [f"{sum(train_s):.1f}"])
    title = (f"MQAR ({'quick' if record['quick'] else 'full'}: {b['layers']} layers, vocab {b['vocab']}, "
             f"{b['steps']} steps × {b['tokens_per_step']} tokens, best of lrs {b['lrs']}; "
             f"device {record['device']['description']}; wall {record['wall_s']:.0f} s)")
    headers = ["architecture", "L/pairs", *[f"d={d}: acc @lr" for d in widths], "train s"]
    return C.format_table(headers, rows, title)


def main(argv=None) -> dict:
    parser = C.make_parser(NAME, __doc__.splitlines()[0], quick_help=(
        "the CPU budget: GPT-2 and DeltaNet, (L, N) = (64, 4), d 64, 150 steps; 2-3 minutes on 2 CPU cores "
        "(a smoke run, not a result); options given explicitly keep their values"))
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--steps", type=C.positive_int, default=None, help="training steps per run")
    parser.add_argument("--archs", type=lambda t: t.split(","), default=None,
                        help=f"comma-separated subset of: {','.join(KEYS)}; "
                             f"diagnostic rows (run only when named): {','.join(A.EXTRA_KEYS)}")
    parser.add_argument("--widths", type=lambda t: [int(v) for v in t.split(",")], default=None,
                        help="comma-separated d_model values (default 64,128,256)")
    parser.add_argument("--lengths", type=lambda t: t.split(","), default=None,
                        help="comma-separated L (Zoology's pairs: 64:4,128:8,256:16,512:64) or L:pairs")
    parser.add_argument("--lrs", type=C.floats, default=None, help="comma-separated peak learning rates")
    parser.add_argument("--compile-workers", type=C.positive_int, default=None,
                        help="threads compiling upcoming runs (default: cores - 1, at most 8)")
    parser.add_argument("--merge", type=lambda t: t.split(","), default=None,
                        help="comma-separated --out roots (or mqar.json files) of earlier calls: combine them into "
                             "one record, table and plot instead of training")
    return C.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
