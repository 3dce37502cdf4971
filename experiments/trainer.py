"""Train-and-score plumbing shared by the experiments that train small models.

``LRSweep`` trains one model with the library's own train step (``lineage_jax.train.step``)
at several peak learning rates as a single vmapped program over a device-resident dataset
of ``{"tokens", "targets", "mask"}`` rows (:func:`stack_rows` of the synthetic probes of
``lineage_jax.data``, or packed text) — a best-of-n lr search for about the price of one
run — and scores the answer positions of held-out rows; ``compiled_ahead`` compiles upcoming
sweeps in a thread pool while the current one trains; ``decode_ms_per_token`` times
single-token decode after a prefilled context; ``text_rows``, ``LMSweep`` (an ``LRSweep``
that also scores validation loss) and ``run_sweeps`` train language models on the byte corpus.
The scorecard, MQAR, NIAH, LM and AttnRes experiments all train through these, so they differ
only in what they train on and what they vary (and import no other experiment).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments import common as C
from lineage_jax import data as D
from lineage_jax.models import Decoder, ModelConfig, inference_steps
from lineage_jax.train.config import TrainConfig
from lineage_jax.train.step import init_state, make_train_step


class Mixture:
    """Random access over several datasets, interleaved (example ``i`` comes from dataset ``i % n``)."""

    def __init__(self, datasets: Sequence):
        if not datasets:
            raise ValueError("Mixture: datasets must be non-empty")
        self.datasets = list(datasets)

    def __len__(self):
        return min(len(t) for t in self.datasets) * len(self.datasets)

    def __getitem__(self, i):
        n = len(self.datasets)
        return self.datasets[int(i) % n][int(i) // n]


def decode_ms_per_token(model: Decoder, vocab: int, context: int, tokens: int, batch: int = 1, seed: int = 0) -> float:
    """Median wall-clock ms of one jitted decode step after prefilling ``context`` random tokens.

    Through :func:`lineage_jax.models.inference_steps` (split once, ``jax.jit``, cache donated):
    timing through ``nnx.jit`` measured its per-call graph walk as well (on the CPU an unscanned
    4-layer hybrid with MoE timed 2.5× a scanned KDA stack that way, 1.6× this way: 3.99 / 1.58
    -> 1.04 / 0.64 ms; the scorecard's first H200 decode column had this bias). Timed on
    ``model.unscanned()`` (per-layer caches, as served; since 2026-11-30 — the H200 columns
    recorded before were timed scanned).
    """
    ctx = jax.random.randint(jax.random.key(seed), (batch, context), 2, vocab)
    served = model.unscanned()
    cache = served.init_cache(batch, context + tokens + 1)
    state, prefill, step = inference_steps(served)
    _, cache = prefill(state, ctx, cache)
    tok = jnp.zeros((batch,), jnp.int32)
    logits, cache = step(state, tok, cache)  # compile
    jax.block_until_ready(logits)
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        logits, cache = step(state, tok, cache)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


# ----------------------------------------------------------------------------
# Best of several learning rates, trained as one program.
# ----------------------------------------------------------------------------
FIELDS = ("tokens", "targets", "mask")


def stack_rows(dataset, n: int, start: int = 0) -> dict[str, np.ndarray]:
    """Rows ``start .. start + n - 1`` of a random-access dataset as arrays ``[n, T]`` (tokens, targets, mask)."""
    rows = [dataset[i] for i in range(start, start + n)]
    return {k: np.stack([r[k] for r in rows]) for k in FIELDS}


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is ``<= at_most`` (at least 1)."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def scaled_optimizer(tx: optax.GradientTransformation, factor) -> optax.GradientTransformation:
    """``tx`` with its update multiplied by ``factor`` (a traced scalar is fine).

    For the library's AdamW (clip, then ``-lr_t · (adam_direction + wd · p)``, ``lr_t`` linear in
    the peak lr) this *is* AdamW at peak lr ``factor · lr``: the weight decay is decoupled, so
    it scales with the step, and nothing before the last scale depends on the lr.
    """
    return optax.chain(tx, optax.scale(factor))


class LRSweep:
    """``len(lrs)`` copies of one model, each trained at its own peak learning rate, as one program.

    The copies start from the same initialization and see the same batches; their
    ``TrainState``s are stacked on a leading axis and one ``jax.vmap``-ed train step
    advances all of them, each with its optimizer update scaled by ``lr_i / max(lrs)``
    (:func:`scaled_optimizer`). A best-of-n learning-rate search therefore costs one
    compilation and one launch per step, not n. ``steps`` are run in on-device
    ``lax.scan`` chunks of ``chunk`` steps (one dispatch and one loss read-back per chunk)
    over a dataset that lives on the device (:func:`stack_rows`; each epoch a fresh
    permutation), so small models are not launch- or input-bound.

    ``compile(train_rows, seq_len, eval_shapes)`` builds every executable ahead of time
    and is thread-safe, so a script can compile the next runs in a thread pool
    while this one trains (XLA compiles without the GIL); ``train`` and
    ``evaluate`` compile on first use otherwise.
    """

    def __init__(self, cfg: ModelConfig, *, lrs: Sequence[float], steps: int, batch: int, seed: int = 0,
                 warmup_frac: float = 0.05, weight_decay: float = 0.1, log_every: Optional[int] = None,
                 eval_tokens: int = 1 << 15):
        if not lrs or any(not (isinstance(lr, (int, float)) and lr > 0) for lr in lrs):
            raise ValueError(f"lrs: need one or more positive learning rates, got {lrs!r}")
        self.cfg, self.lrs, self.steps, self.batch, self.seed = cfg, tuple(float(lr) for lr in lrs), steps, batch, seed
        self.tc = TrainConfig(config="custom", steps=steps, batch_size=batch, seq_len=cfg.max_seq_len, lr=max(self.lrs),
                              warmup_steps=max(1, int(steps * warmup_frac)), weight_decay=weight_decay, seed=seed)
        self.chunk = largest_divisor(steps, log_every or max(1, steps // 10))
        self.eval_tokens = eval_tokens
        self.factors = np.array([lr / self.tc.lr for lr in self.lrs], np.float32)
        self.states = None  # the stacked TrainState after ``train``
        self._fns = None
        self._exe: dict = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ programs
    def _programs(self):
        """Trace the stacked init once; build the jitted init / train-chunk / evaluate functions."""
        with self._lock:
            if self._fns is None:
                n, tc, captured = len(self.lrs), self.tc, {}

                def init():
                    graphdef, state, tx = init_state(self.cfg, tc)
                    captured.update(graphdef=graphdef, tx=tx)
                    state = state._replace(opt_state=scaled_optimizer(tx, 1.0).init(state.params))
                    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), state)

                traced = jax.jit(init).trace()
                graphdef, tx = captured["graphdef"], captured["tx"]

                def one_step(state, factor, batch):
                    state, metrics = make_train_step(graphdef, scaled_optimizer(tx, factor), tc)(state, batch)
                    return state, metrics["loss"]

                step = jax.vmap(one_step, in_axes=(0, 0, None))

                def train_chunk(states, factors, data, idx_KB):
                    def body(states, idx_B):
                        return step(states, factors, {k: v[idx_B] for k, v in data.items()})
                    return jax.lax.scan(body, states, idx_KB)  # losses [K, n]

                def evaluate(params, rest, data, rows_per_batch):
                    """Per copy and row: correctly predicted and scored positions, ``[n, M]`` each."""
                    def score(params, rest, d):
                        logits = nnx.merge(graphdef, params, rest)(d["tokens"])
                        hit = (jnp.argmax(logits, -1) == d["targets"]) * d["mask"]
                        return hit.sum(-1)

                    batched = {k: v.reshape(-1, rows_per_batch, *v.shape[1:]) for k, v in data.items()}
                    hits = jax.lax.map(lambda d: jax.vmap(score, in_axes=(0, 0, None))(params, rest, d), batched)
                    return jnp.moveaxis(hits, 1, 0).reshape(hits.shape[1], -1), data["mask"].sum(-1)

                self._fns = dict(init=traced.lower(), state_shape=traced.out_info, graphdef=graphdef,
                                 train=jax.jit(train_chunk, donate_argnums=0),
                                 evaluate=jax.jit(evaluate, static_argnums=3))
        return self._fns

    def _executable(self, key, lower):
        with self._lock:  # a caller that needs an executable another thread is building waits for it
            if key not in self._exe:
                self._exe[key] = lower().compile()
            return self._exe[key]

    def _data_shapes(self, rows: int, seq_len: int) -> dict:
        sds = jax.ShapeDtypeStruct
        return {"tokens": sds((rows, seq_len), jnp.int32), "targets": sds((rows, seq_len), jnp.int32),
                "mask": sds((rows, seq_len), jnp.float32)}

    def _init_exe(self):
        return self._executable("init", lambda: self._programs()["init"])

    def _train_exe(self, rows: int, seq_len: int):
        def lower():
            f = self._programs()
            return f["train"].lower(f["state_shape"], jax.ShapeDtypeStruct(self.factors.shape, jnp.float32),
                                    self._data_shapes(rows, seq_len),
                                    jax.ShapeDtypeStruct((self.chunk, self.batch), jnp.int32))
        return self._executable(("train", rows, seq_len), lower)

    def _eval_exe(self, copies: int, rows: int, seq_len: int):
        def lower():
            f = self._programs()
            shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct((copies, *s.shape[1:]), s.dtype), f["state_shape"])
            return f["evaluate"].lower(shape.params, shape.rest, self._data_shapes(rows, seq_len),
                                       self.eval_rows_per_batch(rows, seq_len))
        return self._executable(("eval", copies, rows, seq_len), lower)

    def eval_rows_per_batch(self, rows: int, seq_len: int) -> int:
        """Rows per evaluation batch: about ``eval_tokens`` tokens per copy (a divisor of ``rows``)."""
        return largest_divisor(rows, max(1, self.eval_tokens // seq_len))

    def compile(self, train_rows: int, seq_len: int, eval_shapes: Sequence[tuple[int, int, int]] = ()) -> "LRSweep":
        """Build the executables ahead of use: init, the train chunk for a ``[train_rows, seq_len]``
        dataset, and evaluation for each ``(copies, rows, seq_len)`` in ``eval_shapes``."""
        self._init_exe()
        self._train_exe(train_rows, seq_len)
        for shape in eval_shapes:
            self._eval_exe(*shape)
        return self

    # ------------------------------------------------------------------ running
    def train(self, data: dict, bar=None, on_chunk: Optional[Callable[[int], None]] = None) -> np.ndarray:
        """Train every copy from scratch on ``data`` (arrays ``[N, T]``, see :func:`stack_rows`).

        Returns the mean training loss of each ``chunk``-step interval, ``[steps // chunk, len(lrs)]``.
        ``on_chunk(steps_done)``, if given, runs after every chunk with ``self.states`` holding the
        current states (e.g. to record a validation curve through :meth:`model`).
        """
        rows, seq_len = data["tokens"].shape
        if rows < self.batch:
            raise ValueError(f"data: {rows} rows, fewer than one batch of {self.batch}")
        run_chunk = self._train_exe(rows, seq_len)
        states = self._init_exe()()
        data = {k: jnp.asarray(data[k]) for k in FIELDS}
        factors = jnp.asarray(self.factors)
        order = epoch_batches(rows, self.batch, self.steps, self.seed).reshape(-1, self.chunk, self.batch)
        losses = []
        for idx in order:
            states, loss_KN = run_chunk(states, factors, data, jnp.asarray(idx))
            losses.append(loss_KN.mean(0))
            if bar is not None:
                bar.update(self.chunk)
                bar.set_postfix(model=str(self.cfg.name)[:18], loss=f"{float(jnp.min(losses[-1])):.3f}")
            if on_chunk is not None:
                self.states = states
                on_chunk(len(losses) * self.chunk)
        self.states = states
        return np.asarray(jnp.stack(losses))

    def evaluate(self, data: dict, copies: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray]:
        """Score trained copies (default: all) on ``data`` (arrays ``[M, T]``).

        Returns ``(hits [copies, M], scored [M])``: per row, the answer positions predicted
        right (argmax, teacher-forced) and the answer positions scored.
        """
        if self.states is None:
            raise RuntimeError("LRSweep.evaluate: call train first")
        copies = list(range(len(self.lrs))) if copies is None else list(copies)
        rows, seq_len = data["tokens"].shape
        exe = self._eval_exe(len(copies), rows, seq_len)
        pick = jnp.asarray(copies)
        params, rest = (jax.tree.map(lambda x: x[pick], s) for s in (self.states.params, self.states.rest))
        hits, scored = exe(params, rest, {k: jnp.asarray(data[k]) for k in FIELDS})
        return np.asarray(hits), np.asarray(scored)

    def accuracy(self, data: dict) -> np.ndarray:
        """Per copy: answer positions right / answer positions scored, over all rows of ``data``."""
        hits, scored = self.evaluate(data)
        return hits.sum(-1) / max(float(scored.sum()), 1.0)

    def model(self, copy: int) -> Decoder:
        """Copy ``copy``'s trained model as a ``Decoder``."""
        if self.states is None:
            raise RuntimeError("LRSweep.model: call train first")
        params, rest = (jax.tree.map(lambda x: x[copy], s) for s in (self.states.params, self.states.rest))
        return nnx.merge(self._programs()["graphdef"], params, rest)


def epoch_batches(rows: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """``[steps, batch]`` row indices: consecutive batches of a fresh permutation per epoch."""
    rng = np.random.default_rng(seed)
    per_epoch = rows // batch
    epochs = -(-steps // per_epoch)
    order = np.concatenate([rng.permutation(rows)[: per_epoch * batch] for _ in range(epochs)])
    return order[: steps * batch].reshape(steps, batch).astype(np.int32)


def compiled_ahead(jobs: Sequence[tuple[LRSweep, dict]], workers: Optional[int] = None) -> Iterator[tuple[LRSweep, float]]:
    """Yield ``(sweep, compile_seconds)`` for each ``(sweep, compile_kwargs)`` job, in order, compiling
    up to ``workers`` jobs ahead in a thread pool while the caller trains the current one.

    Small models are compile-bound: on a GPU box with many cores this hides most of the
    compile time behind training. ``workers`` defaults to ``cpu_count - 1`` (at most 8).
    """
    workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1))

    def build(sweep, kwargs):
        t0 = time.perf_counter()
        sweep.compile(**kwargs)
        return sweep, time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        futures = [pool.submit(build, sweep, kwargs) for sweep, kwargs in jobs]
        try:
            for i, future in enumerate(futures):
                futures[i] = None  # the caller owns the sweep (and its trained state) from here
                yield future.result()
        finally:
            for future in futures:
                if future is not None:
                    future.cancel()


# ----------------------------------------------------------------------------
# Language-model training on the byte corpus: text rows, validation loss, sweeps with curves
# (experiments.lm, experiments.attnres).
# ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def text_rows(split: str, seq_len: int, rows: int) -> dict:
    """``rows`` packed rows of the corpus ``split`` (byte tokens), spread evenly over it, on the device.

    Fewer when the split is smaller (the validation split: ~250K bytes on CPython 3.11).
    """
    source = D.PackedSource(D.tokenize_corpus(D.load_corpus(None, split), "byte"), seq_len)
    picked = [source[int(i)] for i in np.unique(np.linspace(0, len(source) - 1, min(rows, len(source))).astype(int))]
    return jax.device_put(stack_rows(picked, len(picked)))


class LMSweep(LRSweep):
    """An :class:`LRSweep` that also scores the masked next-token loss of every
    copy on fixed rows, with that program compiled ahead (``compile(..., val_rows=M)``) like the rest."""

    def _val_exe(self, rows: int, seq_len: int):
        def lower():
            f = self._programs()
            graphdef, rows_per_batch = f["graphdef"], self.eval_rows_per_batch(rows, seq_len)

            def losses(params, rest, data):
                def nll_sum(params, rest, d):
                    logits = nnx.merge(graphdef, params, rest)(d["tokens"])
                    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
                    nll = -jnp.take_along_axis(logp, d["targets"][..., None], axis=-1)[..., 0]
                    return jnp.sum(nll * d["mask"])

                batched = {k: v.reshape(-1, rows_per_batch, *v.shape[1:]) for k, v in data.items()}
                sums = jax.lax.map(lambda d: jax.vmap(nll_sum, in_axes=(0, 0, None))(params, rest, d), batched)
                return sums.sum(0) / jnp.maximum(data["mask"].sum(), 1.0)

            shape = f["state_shape"]
            return jax.jit(losses).lower(shape.params, shape.rest, self._data_shapes(rows, seq_len))
        return self._executable(("val", rows, seq_len), lower)

    def compile(self, train_rows: int, seq_len: int, eval_shapes=(), val_rows: Optional[int] = None) -> "LMSweep":
        super().compile(train_rows, seq_len, eval_shapes)
        if val_rows:
            self._val_exe(val_rows, seq_len)
        return self

    def val_loss(self, data: dict) -> np.ndarray:
        """Per copy: mean masked next-token loss (nats per token) over all rows of ``data``."""
        if self.states is None:
            raise RuntimeError("LMSweep.val_loss: call train first")
        rows, seq_len = data["tokens"].shape
        exe = self._val_exe(rows, seq_len)
        return np.asarray(exe(self.states.params, self.states.rest, {k: data[k] for k in FIELDS}))


def train_with_curve(sweep: LMSweep, train: dict, val: dict, bar=None) -> dict:
    """Train ``sweep`` on ``train`` scoring ``val`` after every chunk; the best lr's curves and scores.
    ``train_s`` is the run's wall time, the validation passes after each chunk included."""
    points = []
    t0 = time.perf_counter()
    train_losses = sweep.train(train, bar=bar, on_chunk=lambda step: points.append((step, sweep.val_loss(val))))
    train_s = time.perf_counter() - t0
    val_steps = [s for s, _ in points]
    val_LC = np.stack([v for _, v in points])  # [evals, copies]
    best = int(np.argmin(val_LC[-1]))
    return {"lrs": list(sweep.lrs), "val_loss_per_lr": val_LC[-1], "best_lr": sweep.lrs[best],
            "val_loss": float(val_LC[-1, best]), "val_steps": val_steps, "val_curve": val_LC[:, best],
            "train_steps": [sweep.chunk * (i + 1) for i in range(len(train_losses))],
            "train_curve": train_losses[:, best], "train_s": train_s, "best_copy": best}


def run_sweeps(plan: Sequence[tuple[str, LMSweep]], train: dict, val: dict, desc: str,
               compile_workers: Optional[int] = None,
               on_result: Optional[Callable[[dict], None]] = None) -> dict[str, dict]:
    """Train every ``(name, sweep)`` of ``plan`` (compiling ahead in threads); ``{name: train_with_curve(...)}``.

    ``on_result(results so far)`` runs after each sweep (the scripts save a partial JSON there)."""
    seq_len = train["tokens"].shape[1]
    jobs = [(sweep, dict(train_rows=train["tokens"].shape[0], seq_len=seq_len, val_rows=val["tokens"].shape[0]))
            for _, sweep in plan]
    bar = C.progress(desc=desc, total=sum(sweep.steps for _, sweep in plan), unit="step")
    results = {}
    for (name, _), (sweep, compile_s) in zip(plan, compiled_ahead(jobs, compile_workers)):
        results[name] = dict(train_with_curve(sweep, train, val, bar), compile_s=compile_s)
        if on_result is not None:
            on_result(results)
    bar.close()
    return results


if __name__ == "__main__":
    C.library_module("trainer", [f"python -m experiments.{n}" for n in ("scorecard", "mqar", "niah", "lm", "attnres")])
