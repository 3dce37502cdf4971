"""RULER S-NIAH-1: passkey retrieval accuracy against context length, per architecture.

    python -m experiments.niah [--quick] [--out results] [--archs gpt2,kda,...] [--steps N] [--seed S]
        [--d-model 128] [--train-len 512] [--eval-lens 256,1024,8192] [--lrs 1e-3,3e-3]

A five-digit passkey ("The pass key is 31415. Remember it.") hides at a random depth of
a noise haystack (RULER's repeated "The grass is green. The sky is blue. ..."), and the
sequence ends "What is the pass key? The pass key is" (``lineage_jax.data.PasskeyNIAH``,
byte tokens). Each architecture of the scorecard (4-layer patterns, ``scorecard.KEYS``)
is trained on passkey sequences of one length (loss on the answer digits only), then
scored on held-out sequences at several context lengths, shorter and longer than trained.

**Measured**, per architecture and context length: *passkey accuracy* — the fraction of
sequences whose passkey is reproduced exactly (every digit's teacher-forced argmax right,
which is what greedy decoding would emit: RULER's metric); *digit accuracy*; and passkey
accuracy by needle depth (``depth_bins`` equal bins over the depths of the same held-out
sequences, no extra passes). The prediction (Yang, Kautz, Hatamizadeh, "Gated Delta
Networks: Improving Mamba2 with Delta Rule", 2024, arXiv:2412.06464: Mamba2 99 -> 30% on
S-NIAH-1 from 1K to 8K): pure-decay and additive memories fade as the haystack grows; attention and the
delta rules hold. Out-of-length caveats are part of the result: GPT-2's learned positions
are untrained beyond the training length and RoPE-MLA extrapolates poorly, while NoPE
(the hybrids' MLA) and the fixed-state memories have nothing position-specific to break.

**Fairness**: same width (d = 128, 64-wide heads), depth (4), FFN, optimizer, steps,
batch and the same training sequences in the same order for every architecture; each is
trained at the best of ``lrs`` (all copies train at once: ``trainer.LRSweep``), chosen on a
separate validation set at the training length, then that one copy is scored everywhere.

**Budgets**: full — train at 512 tokens, batch 32 (16K tokens/step), 1200 steps at lr 3e-3
(one rate: in a 3e-3 vs 1e-2 trial at 600 steps no architecture gained from 1e-2; ``--lrs``
sweeps several, each costing about one more step's work), score 256 sequences at
256 ... 8192 tokens (16× the training length).
Measured on one H200 (``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false``): 11-32 ms per step
(13-38 s of training per architecture) and 30-150 s of compile each, mostly hidden behind
training by the thread pool: all eight in 255 s (4.4 minutes with start-up). The budget
matters: DeltaNet learns the task within ~150 steps, linear attention and Gated DeltaNet
within ~1000, GPT-2 is still improving at 1200, and KDA, MLA and the two hybrids were still
near chance (loss ln 10 per digit) at 1200 — read those rows as "not learned within this
budget", not as "cannot retrieve". ``--quick`` (2 CPU cores, ~2
minutes): GPT-2 and DeltaNet at d = 64, trained at 256 tokens for 150 steps of 8 sequences,
scored at 256 ... 1024 — a smoke run of the pipeline, not a result.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from experiments import architectures as A
from experiments import common as C
from experiments import trainer as T
from lineage_jax import accounting
from lineage_jax import data as D

NAME = "niah"
KEYS = tuple(A.KEYS)
TOKENIZER = "byte"


@dataclasses.dataclass(frozen=True)
class Budget:
    archs: tuple[str, ...]
    d_model: int
    train_len: int
    eval_lens: tuple[int, ...]
    steps: int
    batch: int
    lrs: tuple[float, ...]
    max_train_rows: int  # distinct training sequences: min(steps × batch, this)
    eval_rows: int  # per context length (and for the validation set that picks the lr)
    depth_bins: int = 5
    layers: int = 4


FULL = Budget(archs=KEYS, d_model=128, train_len=512, eval_lens=(256, 512, 1024, 2048, 4096, 8192), steps=1200,
              batch=32, lrs=(3e-3,), max_train_rows=40_000, eval_rows=256)
QUICK = Budget(archs=("gpt2", "deltanet"), d_model=64, train_len=256, eval_lens=(256, 512, 1024), steps=150,
               batch=8, lrs=(3e-3,), max_train_rows=1200, eval_rows=32)


def _check_length(L: int, arg: str) -> int:
    try:
        D.PasskeyNIAH(seq_len=L, tokenizer=TOKENIZER)
    except ValueError as e:
        raise ValueError(f"{arg}: {e}") from None
    return int(L)


def make_budget(quick: bool, archs=None, steps=None, d_model=None, train_len=None, eval_lens=None, lrs=None) -> Budget:
    """The quick or full budget with the caller's overrides, validated (errors name the argument)."""
    b = QUICK if quick else FULL
    if steps is not None and steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    if lrs is not None and (not lrs or any(not lr > 0 for lr in lrs)):
        raise ValueError(f"lrs: need positive learning rates, got {lrs!r}")
    if eval_lens is not None and not eval_lens:
        raise ValueError("eval_lens: give at least one context length")
    return dataclasses.replace(
        b, archs=tuple(a[0] for a in A.select(archs or b.archs, b.layers)), steps=steps or b.steps,
        d_model=b.d_model if d_model is None else A.check_widths([d_model], "d_model")[0],
        train_len=b.train_len if train_len is None else _check_length(train_len, "train_len"),
        eval_lens=b.eval_lens if eval_lens is None else tuple(sorted({_check_length(L, "eval_lens")
                                                                      for L in eval_lens})),
        lrs=b.lrs if lrs is None else tuple(float(lr) for lr in lrs))


def passkey_set(L: int, rows: int, seed: int) -> tuple[dict, np.ndarray]:
    """``rows`` passkey sequences of ``L`` tokens (uniform depth) and each one's needle depth."""
    task = D.PasskeyNIAH(seq_len=L, tokenizer=TOKENIZER, seed=seed)
    return T.stack_rows(task, rows), np.array([task.info(i)["depth"] for i in range(rows)])


def scores(hits: np.ndarray, scored: np.ndarray, depths: np.ndarray, bins: int) -> dict:
    """Passkey (all digits) and digit accuracy of one copy's ``hits [M]``, overall and by depth bin."""
    exact = hits == scored
    which = np.minimum((depths * bins).astype(int), bins - 1)
    return {"passkey_accuracy": float(exact.mean()), "digit_accuracy": float(hits.sum() / scored.sum()),
            "by_depth": [float(exact[which == j].mean()) if (which == j).any() else None for j in range(bins)]}


def run(quick: bool = False, out: str = "results", seed: int = 0, steps: Optional[int] = None,
        archs: Optional[list[str]] = None, d_model: Optional[int] = None, train_len: Optional[int] = None,
        eval_lens: Optional[list[int]] = None, lrs: Optional[list[float]] = None,
        compile_workers: Optional[int] = None) -> dict:
    """Train every architecture at ``train_len``; score passkey retrieval at each ``eval_lens`` length."""
    b = make_budget(quick, archs, steps, d_model, train_len, eval_lens, lrs)
    arch_table = A.select(b.archs, b.layers)
    vocab = D.PasskeyNIAH(seq_len=b.train_len, tokenizer=TOKENIZER).vocab_size
    max_len = max(b.train_len, *b.eval_lens)
    train_rows = min(b.steps * b.batch, b.max_train_rows)
    jobs = []
    for key, label, pattern, extra in arch_table:
        cfg = A.wide_head_config(label, pattern, extra, b.d_model, max_len, vocab)  # positions / caches for every length
        sweep = T.LRSweep(cfg, lrs=b.lrs, steps=b.steps, batch=b.batch, seed=seed)
        shapes = [(len(b.lrs), b.eval_rows, b.train_len)] + [(1, b.eval_rows, L) for L in b.eval_lens]
        jobs.append((sweep, dict(train_rows=train_rows, seq_len=b.train_len, eval_shapes=shapes)))

    record = C.provenance(NAME, quick)
    record["budget"] = dataclasses.asdict(b)
    t_start = time.perf_counter()
    train = jax.device_put(T.stack_rows(D.PasskeyNIAH(seq_len=b.train_len, tokenizer=TOKENIZER, seed=seed), train_rows))
    val, _ = passkey_set(b.train_len, b.eval_rows, seed + 1)
    tests = {L: passkey_set(L, b.eval_rows, seed + 1_000_003) for L in b.eval_lens}
    results = []
    bar = C.progress(desc="niah", total=b.steps * len(arch_table), unit="step")
    for (key, label, pattern, _), (sweep, compile_s) in zip(arch_table, T.compiled_ahead(jobs, compile_workers)):
        t0 = time.perf_counter()
        losses = sweep.train(train, bar=bar)
        train_s = time.perf_counter() - t0
        hits, scored = sweep.evaluate(val)
        val_acc = (hits == scored).mean(-1)
        best = int(np.argmax(val_acc))
        per_length = {}
        for L, (test, depths) in tests.items():
            hits, scored = sweep.evaluate(test, copies=[best])
            per_length[L] = scores(hits[0], scored, depths, b.depth_bins)
        results.append({
            "arch": key, "architecture": label, "pattern": pattern,
            "params": accounting.param_counts(sweep.cfg)["total"],
            "lrs": list(b.lrs), "val_passkey_accuracy_per_lr": val_acc, "best_lr": b.lrs[best],
            "final_loss_per_lr": losses[-1], "loss_curve": losses[:, best], "train_s": train_s, "compile_s": compile_s,
            "by_length": {str(L): s for L, s in per_length.items()},
        })
    bar.close()
    record["wall_s"] = time.perf_counter() - t_start
    record["runs"] = results
    return C.finish(record, NAME, out, plot(results, b))


def plot(results: list[dict], b: Budget):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    centers = (np.arange(b.depth_bins) + 0.5) / b.depth_bins
    longest = str(max(b.eval_lens))
    for i, r in enumerate(results):
        ax1.plot(b.eval_lens, [r["by_length"][str(L)]["passkey_accuracy"] for L in b.eval_lens], marker="o",
                 color=f"C{i}", label=r["architecture"])
        depth = [np.nan if a is None else a for a in r["by_length"][longest]["by_depth"]]
        ax2.plot(centers, depth, marker="o", color=f"C{i}")
    ax1.axvline(b.train_len, color="gray", ls="--", lw=1)
    ax1.text(b.train_len, 0.5, " trained here", color="gray", fontsize=8, rotation=90, va="center")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(b.eval_lens, [C.fmt_tokens(L) for L in b.eval_lens])
    ax1.set_xlabel("context length (byte tokens)")
    ax1.set_ylabel("passkey accuracy (exact match)")
    ax1.set_title(f"S-NIAH-1 passkey: trained at {C.fmt_tokens(b.train_len)}, {b.steps} steps × {b.batch}")
    ax2.set_xlabel("needle depth (0 = start of haystack)")
    ax2.set_title(f"by needle depth at {C.fmt_tokens(int(longest))} tokens")
    for ax in (ax1, ax2):
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    return fig


def table(record: dict) -> str:
    b = record["budget"]
    lens = [str(L) for L in b["eval_lens"]]
    rows = [[r["architecture"], *[f"{r['by_length'][L]['passkey_accuracy']:.2f}" for L in lens],
             " ".join(f"{a:.1f}" if a is not None else "-" for a in r["by_length"][lens[-1]]["by_depth"]),
             f"{r['best_lr']:.0e}", f"{r['train_s']:.1f}"] for r in record["runs"]]
    headers = ["architecture", *[C.fmt_tokens(int(L)) for L in lens], f"by depth @{C.fmt_tokens(int(lens[-1]))}", "lr",
               "train s"]
    title = (f"S-NIAH-1 passkey accuracy ({'quick' if record['quick'] else 'full'}: d={b['d_model']}, "
             f"{b['layers']} layers, trained at {b['train_len']} tokens, {b['steps']} steps × {b['batch']}, "
             f"best of lrs {b['lrs']}; device {record['device']['description']}; wall {record['wall_s']:.0f} s)")
    return C.format_table(headers, rows, title)


def main(argv=None) -> dict:
    parser = C.make_parser(NAME, __doc__.splitlines()[0], quick_help=(
        "the CPU budget: GPT-2 and DeltaNet at d 64, trained at 256 tokens for 150 steps; about 2 minutes on "
        "2 CPU cores (a smoke run, not a result); options given explicitly keep their values"))
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--steps", type=C.positive_int, default=None, help="training steps per architecture")
    parser.add_argument("--archs", type=lambda t: t.split(","), default=None,
                        help=f"comma-separated subset of: {','.join(KEYS)}; "
                             f"diagnostic rows (run only when named): {','.join(A.EXTRA_KEYS)}")
    parser.add_argument("--compile-workers", type=C.positive_int, default=None,
                        help="threads compiling upcoming architectures (default: cores - 1, at most 8)")
    parser.add_argument("--d-model", type=C.positive_int, default=None, help="model width (default 128)")
    parser.add_argument("--train-len", type=C.positive_int, default=None, help="training context (default 512)")
    parser.add_argument("--eval-lens", type=lambda t: [int(v) for v in t.split(",")], default=None,
                        help="comma-separated evaluation contexts (default 256,512,...,8192)")
    parser.add_argument("--lrs", type=C.floats, default=None, help="comma-separated peak learning rates")
    return C.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
