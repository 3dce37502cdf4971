"""Attention Residuals vs the plain residual: hidden-state norm over depth, and loss.

    python -m experiments.attnres [--quick] [--out results] [--layers 32] [--d-model 128] [--block 4] [--steps N]

A PreNorm residual stream is an equal-weight running sum, ``h_l = h_0 + Σ_{i<l} f_i``: its
norm grows with depth, so every later layer's contribution is diluted. Block Attention
Residuals (Kimi K3; ``ModelConfig.attnres_block``) replace the sum by a learned softmax
over depth — over the embedding and the sums of earlier blocks of ``block`` layers — so
each sublayer reads a convex mix of sources instead of their ever-growing total.

**Models**: two deep, narrow decoders identical but for the residual — ``layers`` softmax
layers (learned positions, RMSNorm PreNorm, SwiGLU FFN 4d), plain vs AttnRes with blocks
of ``block`` layers (AttnRes adds one zero-initialised query of ``d`` per sublayer and one
for the output: ``(2·layers + 1)·d`` parameters, printed).

**Data and training**: the LM experiment's rows (``experiments.lm``: stdlib corpus, byte
tokens, packed rows spread over the train split; fixed validation rows from the val split),
the same rows in the same order, optimizer, steps, batch and learning-rate grid for both;
each scored at its best lr by final validation loss.

**Measured**:

* **hidden-state norm vs depth** after training, by an instrumented forward that runs the
  model's own layers (``Block.run``) through its own residual stream wrapped in a recorder:
  the RMS over channels (mean over validation tokens) of what layer ``l``'s mixer reads
  from the stream — the running sum ``h_l`` for the plain residual, the softmax-over-depth
  read for AttnRes — and of what the final norm reads (depth ``L``); also every
  sublayer's output RMS. The probe's logits equal the model's (tested).
* **validation loss curves** of both.
* **compute advantage**: the steps the plain model needs to reach AttnRes's final
  validation loss, divided by AttnRes's steps. The plain model's loss-vs-steps curve is its
  validation curve up to ``steps``, extended by the final losses of plain models trained for
  ``baseline_budgets × steps`` (each with its own full learning-rate schedule: a longer
  run's mid-training loss would overstate the steps needed); the crossing is interpolated
  linearly. Kimi's AttnRes report: ≈1.25× compute advantage (at scale).

**Budgets**: ``--quick`` (2 CPU cores, ≲3 min): 16 layers, d 32, blocks of 2, 120 steps of
8 × 64 bytes, one lr, baseline extension to 2× — a smoke run. Full: 32 layers, d 128
(4 heads × 32), blocks of 4 (8 blocks), 800 steps of 32 × 256 bytes, lrs 1e-3 and 3e-3,
baseline extended to 1.25× and 1.5× (bracketing the reported 1.25×): 3800 steps, about 5
minutes on one H200 (one process alone on the GPU: plain 800 steps in 50 s, AttnRes in 90 s,
plain ×1.5 in 73 s, compile ≈ 20 s each, overlapped; measured 2026-11-29). Each finished run is
saved to ``attnres.partial.json`` at once, with the depth profiles of the two compared models (probed as soon as each is trained,
before the baseline extensions), so a run cut short keeps what it trained.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import common as C
from experiments import trainer as T
from lineage_jax import accounting
from lineage_jax.models import Decoder, ModelConfig
from lineage_jax.models.decoder import residual_stream

NAME = "attnres"
VOCAB = 256  # the byte tokenizer
REPORTED_ADVANTAGE = 1.25  # Kimi's Attention Residuals report


@dataclasses.dataclass(frozen=True)
class Budget:
    d_model: int
    head_dim: int
    layers: int
    block: int  # AttnRes block size (layers)
    seq_len: int
    batch: int
    steps: int
    lrs: tuple[float, ...]
    val_rows: int
    evals: int  # validation points per run
    baseline_budgets: tuple[float, ...]  # extra plain runs, as multiples of steps (> 1)
    probe_rows: int  # validation rows for the norm probe


QUICK = Budget(d_model=32, head_dim=16, layers=16, block=2, seq_len=64, batch=8, steps=120, lrs=(3e-3,), val_rows=32,
               evals=6, baseline_budgets=(2.0,), probe_rows=8)
FULL = Budget(d_model=128, head_dim=32, layers=32, block=4, seq_len=256, batch=32, steps=800, lrs=(1e-3, 3e-3),
              val_rows=256, evals=16, baseline_budgets=(1.25, 1.5), probe_rows=32)


def make_budget(quick: bool, layers=None, block=None, steps=None, lrs=None, baseline_budgets=None,
                d_model=None) -> Budget:
    b = QUICK if quick else FULL
    if d_model is not None and (not isinstance(d_model, int) or d_model <= 0 or d_model % b.head_dim):
        raise ValueError(f"d_model: must be a positive multiple of the head width {b.head_dim}, got {d_model!r}")
    b = dataclasses.replace(b, d_model=d_model or b.d_model, layers=layers or b.layers, block=block or b.block,
                            steps=steps or b.steps,
                            lrs=tuple(float(lr) for lr in (lrs or b.lrs)),
                            baseline_budgets=tuple(sorted(baseline_budgets or b.baseline_budgets)))
    if b.layers < 2:
        raise ValueError(f"layers: need at least 2 for a depth profile, got {b.layers}")
    if not 1 <= b.block <= b.layers:
        raise ValueError(f"block: AttnRes block size must be in [1, layers={b.layers}], got {b.block}")
    if b.steps < b.evals:
        raise ValueError(f"steps: must be >= {b.evals} (one per validation point), got {b.steps}")
    if any(not lr > 0 for lr in b.lrs):
        raise ValueError(f"lrs: need positive learning rates, got {b.lrs!r}")
    if any(not m > 1 for m in b.baseline_budgets):
        raise ValueError(f"baseline_budgets: multiples of steps must be > 1, got {b.baseline_budgets!r}")
    return b


def model_config(b: Budget, attnres: bool) -> ModelConfig:
    return ModelConfig(name=f"AttnRes (blocks of {b.block})" if attnres else "plain residual", vocab_size=VOCAB,
                       d_model=b.d_model, pattern="S" * b.layers, num_heads=b.d_model // b.head_dim,
                       head_dim=b.head_dim,
                       positions="learned", max_seq_len=b.seq_len, ffn_hidden=4 * b.d_model,
                       attnres_block=b.block if attnres else 0)


# ----------------------------------------------------------------------------
# The norm probe: the model's own layers and residual stream, recorded.
# ----------------------------------------------------------------------------
def _rms(x: jax.Array) -> jax.Array:
    """RMS over channels, mean over tokens."""
    x = x.astype(jnp.float32)
    return jnp.mean(jnp.sqrt(jnp.mean(x * x, axis=-1)))


class _Recorder:
    """A residual stream that records the RMS of every read (sublayer input) and write (sublayer output)."""

    def __init__(self, stream):
        self.stream, self.reads, self.writes = stream, [], []

    def init(self, h):
        return self.stream.init(h)

    def read(self, carry, query):
        x = self.stream.read(carry, query)
        self.reads.append(_rms(x))
        return x

    def write(self, carry, out):
        self.writes.append(_rms(out))
        return self.stream.write(carry, out)

    def end_layer(self, carry, layer_idx):
        return self.stream.end_layer(carry, layer_idx)

    def final(self, carry, query):
        x = self.stream.final(carry, query)
        self.reads.append(_rms(x))
        return x


def _macrocycles(group, repeats: int):
    """The macrocycles of a layer group, unstacked when the group is scanned."""
    if repeats == 1:
        return [group]
    graphdef, state = nnx.split(group)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, r=r: a[r], state)) for r in range(repeats)]


@nnx.jit
def _probe(model: Decoder, tokens: jax.Array):
    stream = _Recorder(residual_stream(model.cfg))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    carry = stream.init(model.embed_tokens(tokens, positions))
    for (first, period, repeats), group in zip(model.groups_spec, model.groups):
        for r, macro in enumerate(_macrocycles(group, repeats)):
            for j, block in enumerate(macro.blocks):
                carry, _, _ = block.run(stream, carry, None, first + r * period + j, "train", None)
    out = stream.final(carry, None if model.final_query is None else model.final_query[...])
    return model.output_logits(out), jnp.stack(stream.reads), jnp.stack(stream.writes)


def residual_rms(model: Decoder, tokens) -> dict:
    """Per-depth RMS of the residual stream of ``model`` on ``tokens [B, T]`` (see the module doc).

    ``hidden [L + 1]``: what layer ``l``'s mixer reads (``l < L``) and what the final norm reads
    (``l = L``); ``mixer_out [L]`` / ``ffn_out [L]``: each sublayer's output; ``logits``: the
    probe's own logits (equal to ``model(tokens)``).
    """
    logits, reads, writes = _probe(model, jnp.asarray(tokens))
    return {"hidden": np.asarray(reads[0::2]), "mixer_out": np.asarray(writes[0::2]),
            "ffn_out": np.asarray(writes[1::2]), "logits": logits}


# ----------------------------------------------------------------------------
# The compute advantage.
# ----------------------------------------------------------------------------
def steps_to_reach(steps: Sequence[float], losses: Sequence[float], target: float) -> Optional[float]:
    """The first step at which the piecewise-linear curve through ``(steps, losses)`` is ``<= target``."""
    for i, (s, loss) in enumerate(zip(steps, losses)):
        if loss <= target:
            if i == 0:
                return float(s)
            s0, l0 = steps[i - 1], losses[i - 1]
            return float(s0 + (s - s0) * (l0 - target) / (l0 - loss))
    return None


def compute_advantage(plain: dict, extensions: dict[float, dict], attnres: dict, steps: int) -> dict:
    """Steps the plain model needs to reach AttnRes's final loss, over AttnRes's steps."""
    curve = [(s, v) for s, v in zip(plain["val_steps"], plain["val_curve"])]
    curve += [(m * steps, ext["val_loss"]) for m, ext in sorted(extensions.items())]
    target = attnres["val_loss"]
    reached = steps_to_reach([s for s, _ in curve], [v for _, v in curve], target)
    longest = curve[-1][0] / steps
    return {"target_loss": target, "baseline_steps": [s for s, _ in curve], "baseline_losses": [v for _, v in curve],
            "steps_needed": reached, "advantage": None if reached is None else reached / steps,
            "advantage_at_least": longest if reached is None else None, "reported": REPORTED_ADVANTAGE}


# ----------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------
def run(quick: bool = False, out: str = "results", seed: int = 0, layers: Optional[int] = None,
        block: Optional[int] = None, steps: Optional[int] = None, lrs: Optional[Sequence[float]] = None,
        baseline_budgets: Optional[Sequence[float]] = None, compile_workers: Optional[int] = None,
        d_model: Optional[int] = None) -> dict:
    """Train plain and AttnRes models, probe their depth profile, estimate the compute advantage."""
    b = make_budget(quick, layers, block, steps, lrs, baseline_budgets, d_model)
    configs = {"attnres": model_config(b, True), "plain": model_config(b, False)}
    plan = [(name, cfg, b.steps) for name, cfg in configs.items()]
    plan += [(f"plain x{m:g}", configs["plain"], round(m * b.steps)) for m in b.baseline_budgets]
    longest = max(s for _, _, s in plan)
    train = T.text_rows("train", b.seq_len, longest * b.batch)
    val = T.text_rows("val", b.seq_len, b.val_rows)

    t_start = time.perf_counter()
    sweeps = [(name, T.LMSweep(cfg, lrs=b.lrs, steps=s, batch=b.batch, seed=seed, log_every=b.steps // b.evals))
              for name, cfg, s in plan]
    probe_tokens = val["tokens"][: b.probe_rows]
    partial = dict(C.provenance(NAME, quick), budget=dataclasses.asdict(b))
    profiles = {}  # depth profiles, probed as soon as each compared model is trained

    def on_result(done: dict) -> None:
        for name in configs:
            if name in done and name not in profiles:
                profiles[name] = residual_rms(dict(sweeps)[name].model(done[name]["best_copy"]), probe_tokens)
                profiles[name].pop("logits")
        C.save_partial(dict(partial, finished=done, profiles=profiles), NAME, out)

    results = T.run_sweeps(sweeps, train, val, "attnres", compile_workers, on_result=on_result)
    models = {name: dict(results[name], label=cfg.name, params=accounting.param_counts(cfg)["total"], **profiles[name])
              for name, cfg in configs.items()}
    extensions = {m: results[f"plain x{m:g}"] for m in b.baseline_budgets}

    record = C.provenance(NAME, quick)
    record.update(budget=dataclasses.asdict(b), wall_s=time.perf_counter() - t_start, models=models,
                  baseline_extensions={f"{m:g}": r for m, r in extensions.items()},
                  advantage=compute_advantage(models["plain"], extensions, models["attnres"], b.steps))
    return C.finish(record, NAME, out, plot(record))


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------
COLORS = {"plain": "C0", "attnres": "C3"}


def plot(record: dict):
    import matplotlib.pyplot as plt

    b, models, adv = record["budget"], record["models"], record["advantage"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2))
    for name, m in models.items():
        depth = np.arange(len(m["hidden"]))
        ax1.plot(depth, m["hidden"], "o-", ms=3, color=COLORS[name], label=f"{m['label']}: stream read (hidden)")
        out = (np.asarray(m["mixer_out"]) + np.asarray(m["ffn_out"])) / 2
        ax1.plot(depth[:-1] + 0.5, out, ":", color=COLORS[name], label=f"{m['label']}: sublayer output (mean)")
    for edge in range(b["block"], b["layers"], b["block"]):
        ax1.axvline(edge, color="C3", alpha=0.12, lw=1)
    ax1.set_yscale("log")
    ax1.set_xlabel("depth (layer whose input is read; last = final norm input)")
    ax1.set_ylabel("RMS over channels (mean over tokens)")
    ax1.set_title(f"hidden-state norm vs depth after {b['steps']} steps", fontsize=10)
    ax1.grid(alpha=0.3, which="both")
    ax1.legend(fontsize=7)
    for name, m in models.items():
        ax2.plot(m["val_steps"], m["val_curve"], "o-", ms=3, color=COLORS[name],
                 label=f"{m['label']} (lr {m['best_lr']:.0e})")
    ax2.plot(adv["baseline_steps"], adv["baseline_losses"], "--", color=COLORS["plain"], alpha=0.6,
             label="plain: loss vs steps (extended by longer runs' finals)")
    ax2.axhline(adv["target_loss"], color=COLORS["attnres"], lw=0.8, ls=":")
    if adv["steps_needed"] is not None:
        ax2.axvline(adv["steps_needed"], color="k", lw=0.8, ls=":")
        ax2.annotate(f"plain reaches it at {adv['steps_needed']:.0f} steps: {adv['advantage']:.2f}×",
                     (adv["steps_needed"], adv["target_loss"]), xytext=(5, 12), textcoords="offset points", fontsize=8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("validation loss (nats / byte)")
    ax2.set_title(f"validation loss; compute advantage (reported ≈{REPORTED_ADVANTAGE}×)", fontsize=10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(f"Attention Residuals: {b['layers']} softmax layers, d {b['d_model']}, blocks of {b['block']}; "
                 f"{b['batch']}×{b['seq_len']} bytes/step; {record['device']['description']}")
    fig.tight_layout()
    return fig


def _advantage_text(adv: dict) -> str:
    if adv["advantage"] is not None:
        return (f"plain reaches AttnRes's final loss {adv['target_loss']:.4f} at step {adv['steps_needed']:.0f}: "
                f"compute advantage {adv['advantage']:.2f}× (reported ≈{adv['reported']}×)")
    return (f"plain never reaches AttnRes's final loss {adv['target_loss']:.4f} within "
            f"{adv['advantage_at_least']:g}× the steps: compute advantage > {adv['advantage_at_least']:g}× "
            f"(reported ≈{adv['reported']}×)")


def table(record: dict) -> str:
    b, models = record["budget"], record["models"]
    L = b["layers"]
    rows = []
    step_ms = lambda r, steps: f"{1e3 * r['train_s'] / steps:.1f}"  # noqa: E731  (all lrs together)
    for m in models.values():
        h = m["hidden"]
        rows.append([m["label"], f"{m['params']:,}", f"{m['best_lr']:.0e}", f"{m['val_loss']:.4f}",
                     step_ms(m, b["steps"]), f"{h[0]:.3g}", f"{h[L // 2]:.3g}", f"{h[L - 1]:.3g}", f"{h[L]:.3g}",
                     f"{max(h) / min(h):.3g}"])
    for m, r in record["baseline_extensions"].items():
        rows.append([f"plain residual, {m}× steps", "", f"{r['best_lr']:.0e}", f"{r['val_loss']:.4f}",
                     step_ms(r, round(float(m) * b["steps"])), *[""] * 5])
    title = (f"AttnRes ({'quick' if record['quick'] else 'full'}: {L} layers, d {b['d_model']}, "
             f"blocks of {b['block']}, "
             f"{b['steps']} steps × {b['batch']} × {b['seq_len']} bytes, lrs {b['lrs']}; "
             f"{record['device']['description']}; wall {record['wall_s']:.0f} s)")
    headers = ["model", "params", "best lr", "val loss", "train ms/step", "RMS in L0", f"L{L // 2}", f"L{L - 1}",
               "final", "max/min"]
    return "\n".join([C.format_table(headers, rows, title), "", _advantage_text(record["advantage"])])


def main(argv=None) -> dict:
    parser = C.make_parser(NAME, __doc__.splitlines()[0], quick_help=(
        "the CPU budget: 16 layers, d 32, blocks of 2, 120 steps; up to about 3 minutes on 2 CPU cores "
        "(a smoke run); options given explicitly keep their values"))
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--layers", type=C.positive_int, default=None, help="depth of both models")
    parser.add_argument("--d-model", type=C.positive_int, default=None,
                        help="width of both models (heads stay head_dim wide; FFN 4x): AttnRes's step cost vs width")
    parser.add_argument("--block", type=C.positive_int, default=None, help="AttnRes block size in layers")
    parser.add_argument("--steps", type=C.positive_int, default=None, help="training steps of the compared runs")
    parser.add_argument("--lrs", type=C.floats, default=None, help="comma-separated peak learning rates")
    parser.add_argument("--baseline-budgets", type=C.floats, default=None,
                        help="extra plain runs as multiples of --steps (> 1), e.g. 1.25,1.5")
    parser.add_argument("--compile-workers", type=C.positive_int, default=None,
                        help="threads compiling upcoming runs (default: cores - 1, at most 8)")
    return C.main_for(NAME, parser, run, table, argv)


if __name__ == "__main__":
    main()
