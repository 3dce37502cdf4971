"""Training throughput on one accelerator: the lineage's architectures against plain JAX, in one process.

Every row trains the same size of model on the same batch with the same optimizer (AdamW,
float32 master weights, bfloat16 activations), through the library's own jitted train step
(``lineage_jax.train.step``) — except ``reference``, a plain-JAX transformer written in this
file (:func:`reference_step`: scanned layers, RoPE, SwiGLU, ``jax.nn.dot_product_attention``,
no library code), the yardstick a researcher would otherwise write in ninety lines.

Rows (12 layers, d 2048, 16 heads x 128, SwiGLU 5632, byte vocabulary at the default size):

=============  ================================================================
``reference``  plain JAX (cuDNN attention on GPUs, XLA elsewhere)
``softmax``    ``S`` x 12 with RoPE
``hybrid``     ``KKKM`` x 3: KDA + MLA, the Kimi Linear 3:1 pattern, dense FFNs
``mla``        ``M`` x 12 (kv_lora 512, nope 128 + rope 64, v 128)
``kda``        ``K`` x 12
``gdn``        ``G`` x 12
``moe``        ``KKKM`` x 3 with MoE FFNs after the first layer: 64 experts, top 8, one shared
               expert, expert width chosen so the active parameters equal the dense rows'
=============  ================================================================

The library rows run their scanned layer groups unrolled (``ModelConfig.scan_unroll=True``;
``--set scan_unroll=false`` for the looped scan): their parameters stay stacked, and no Pallas
kernel's operand or result is copied out of or into a stacked buffer on every loop iteration (on
one H200 the hybrid at batch 1 x 32768 trains 1.08x faster unrolled, ``docs/benchmarks.md``).

Per row and batch shape it reports tokens/s (median over windows of ``--window`` steps, each
synchronized, after ``--warmup`` steps), model FLOP utilisation (``3 ×
accounting.flops_per_token`` per token over the device's dense bf16 peak) and the step's memory
as XLA assigned it (arguments + temporaries of the compiled step; the allocator may use 95% of a
GPU's memory, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` unless set). A row that does not fit is
recorded as ``"oom"`` and the run goes on. ``--isolate`` runs each row in a fresh process (the
default keeps every row in one process). Writes ``train_bench.json`` and a bar chart
``train_bench.png`` (tokens/s per row, one group per shape, the reference's as a line).
``--profile N`` also profiles N steps of every row (:mod:`experiments.op_profile`: GPU busy time
per step by kind — matmul, attention, Pallas kernels, XLA fusions, memory — and the largest
kernels, each XLA fusion with the JAX operations and source lines it fused) into the row's record
and the printed table.

Usage::

    python -m experiments.train_bench                               # every row, 4x4096 and 1x32768
    python -m experiments.train_bench --rows reference,softmax --shapes 8x4096 --remat dots
    python -m experiments.train_bench --quick                       # tiny sizes: a CPU smoke run

``--quick`` trains a tiny model (:data:`QUICK`); it also sets ``--shapes 2x64 --steps 4 --warmup 1
--window 2``, each only where the option is left unset.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import statistics
import time
import traceback
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common as C
from experiments import op_profile
from lineage_jax import accounting
from lineage_jax.models import ModelConfig
from lineage_jax.memory.options import BACKENDS as MEMORY_BACKENDS
from lineage_jax.models.config import ATTENTION_IMPLS, REMAT_POLICIES
from lineage_jax.train.config import TrainConfig, apply_overrides
from lineage_jax.train.loop import peak_flops
from lineage_jax.train.step import init_state, jit_steps

# The benchmark owns the accelerator: XLA's GPU allocator may use 95% of its memory (JAX's default
# is 75%), for every row alike. Read when the backend starts; an explicit setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

NAME = "train_bench"
ROWS = ("reference", "softmax", "hybrid", "mla", "kda", "gdn", "moe")
DEFAULT_SHAPES = "4x4096,1x32768"
# The timing options' values, and those of --quick; an option the caller sets keeps its value.
DEFAULTS = dict(shapes=DEFAULT_SHAPES, steps=20, warmup=3, window=5)
QUICK_RUN = dict(shapes="2x64", steps=4, warmup=1, window=2)


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int = 12
    d_model: int = 2048
    heads: int = 16
    head_dim: int = 128
    ffn: int = 5632
    vocab: int = 256
    experts: int = 64
    top_k: int = 8


QUICK = Size(layers=4, d_model=64, heads=4, head_dim=16, ffn=128, vocab=256, experts=8, top_k=2)


def model_config(row: str, size: Size, remat: str, attention_impl: str = "auto",
                 memory_backend: str = "auto", overrides: tuple = ()) -> ModelConfig:
    """The library's config of ``row`` at ``size`` (``reference`` maps to the softmax row's config,
    used for its FLOP count)."""
    L = size.layers
    mla = dict(kv_lora_rank=4 * size.head_dim, qk_nope_head_dim=size.head_dim, qk_rope_head_dim=size.head_dim // 2,
               v_head_dim=size.head_dim)
    pattern = {"reference": "S" * L, "softmax": "S" * L, "hybrid": "KKKM" * (L // 4), "mla": "M" * L,
               "kda": "K" * L, "gdn": "G" * L, "moe": "KKKM" * (L // 4)}[row]
    kw = dict(name=f"train_bench_{row}", vocab_size=size.vocab, d_model=size.d_model, pattern=pattern,
              num_heads=size.heads, head_dim=size.head_dim, ffn_kind="swiglu", ffn_hidden=size.ffn,
              norm="rmsnorm", dtype="bfloat16", remat=remat, attention_impl=attention_impl,
              memory_backend=memory_backend, max_seq_len=1 << 20, scan_unroll=True)
    if row in ("reference", "softmax"):
        kw["positions"] = "rope"
    if "M" in pattern:
        kw.update(mla)
    if row == "moe":
        # Active FFN parameters per token = the dense rows': (top_k + shared) experts of width h.
        hidden = max(16, int(round(size.ffn / (size.top_k + 1) / 16)) * 16)
        kw.update(num_experts=size.experts, top_k=size.top_k, moe_hidden=hidden, num_shared_experts=1,
                  first_dense_layers=1)
    cfg = ModelConfig(**kw)
    if overrides:
        check_overrides(overrides)
        _, cfg = apply_overrides(TrainConfig(), cfg, [f"model.{o}" for o in overrides])
    return cfg


def check_overrides(overrides) -> None:
    """Each ``--set`` item is ``field=value`` with ``field`` a ``ModelConfig`` field (the only kind
    train_bench takes: the training settings are its own); a ``ValueError`` naming ``--set`` otherwise."""
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    for item in overrides:
        key, sep, _ = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set: expected FIELD=VALUE, got {item!r}")
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            raise ValueError(f"--set: unknown key {key!r}: train_bench's --set takes ModelConfig fields only "
                             f"(lineage_jax/models/config.py){hint}")


# ---------------------------------------------------------------------------- the plain-JAX reference
def reference_init(key, size: Size):
    """Parameters of the reference transformer (float32), layers stacked for ``lax.scan``."""
    L, D, H, Dh, F, V = size.layers, size.d_model, size.heads, size.head_dim, size.ffn, size.vocab
    ks = jax.random.split(key, 8)
    n = lambda k, shape, fan_in: jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5
    return {
        "embed": jax.random.normal(ks[0], (V, D), jnp.float32) * 0.02,
        "layers": {"ln1": jnp.ones((L, D)), "ln2": jnp.ones((L, D)),
                   "wqkv": n(ks[1], (L, D, 3, H, Dh), D), "wo": n(ks[2], (L, H, Dh, D), H * Dh),
                   "wg": n(ks[3], (L, D, F), D), "wu": n(ks[4], (L, D, F), D), "wd": n(ks[5], (L, F, D), F)},
        "ln_f": jnp.ones((D,)), "head": n(ks[6], (D, V), D),
    }


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * w).astype(jnp.bfloat16)


def _rope(x, theta=10000.0):
    T, half = x.shape[1], x.shape[-1] // 2
    ang = jnp.arange(T)[:, None] * theta ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def reference_loss(params, tokens, targets, remat: str):
    bf = jnp.bfloat16
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"

    def layer(h, p):
        x = _rms(h, p["ln1"])
        q, k, v = jnp.einsum("btd,dchk->cbthk", x, p["wqkv"].astype(bf))
        o = jax.nn.dot_product_attention(_rope(q), _rope(k), v, is_causal=True, implementation=impl)
        h = h + jnp.einsum("bthk,hkd->btd", o, p["wo"].astype(bf))
        x = _rms(h, p["ln2"])
        f = jax.nn.silu(x @ p["wg"].astype(bf)) * (x @ p["wu"].astype(bf))
        return h + f @ p["wd"].astype(bf), None

    from lineage_jax.models.decoder import remat_policy
    policy = remat_policy(remat)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)
    h = params["embed"][tokens].astype(bf)
    h, _ = jax.lax.scan(layer, h, params["layers"])
    logits = _rms(h, params["ln_f"]).astype(jnp.float32) @ params["head"]
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def reference_step(size: Size, remat: str, tx):
    """``(state, jitted step)`` of the plain-JAX reference: ``step(state, batch) -> (state, loss)``."""
    params = reference_init(jax.random.key(0), size)
    state = (params, tx.init(params))

    def step(state, batch):
        params, opt = state
        loss, grads = jax.value_and_grad(reference_loss)(params, batch["tokens"], batch["targets"], remat)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": loss}

    return state, jax.jit(step, donate_argnums=(0,))


# ---------------------------------------------------------------------------- measurement
def _batch(B: int, T: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, vocab, size=(B, T + 1), dtype=np.int32)
    return {"tokens": jnp.asarray(data[:, :-1]), "targets": jnp.asarray(data[:, 1:])}


def _memory(compiled) -> Optional[int]:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:
        return None


def _is_oom(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def measure(row: str, B: int, T: int, size: Size, *, remat: str, steps: int, warmup: int, window: int,
            attention_impl: str = "auto", memory_backend: str = "auto", overrides: tuple = (), bar=None,
            profile: int = 0) -> dict:
    """Train ``row`` at batch ``B x T`` for ``warmup + steps`` steps; tokens/s, MFU, memory."""
    cfg = model_config(row, size, remat, attention_impl, memory_backend, overrides)
    tc = TrainConfig(config="custom", batch_size=B, seq_len=T, lr=1e-4, warmup_steps=0, moe_bias_rule="none",
                     progress=False)
    batch = _batch(B, T, size.vocab)
    t0 = time.perf_counter()
    if row == "reference":
        tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
        state, step = reference_step(size, remat, tx)
    else:
        graphdef, state, tx = init_state(cfg, tc)
        step, _ = jit_steps(graphdef, tx, tc, state)
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = _memory(compiled)
    losses, times = [], []
    for i in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    n_windows = max(1, steps // window)
    for _ in range(n_windows):
        t = time.perf_counter()
        for _ in range(window):
            state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))  # synchronizes
        times.append((time.perf_counter() - t) / window)
        if bar is not None:
            bar.update(window)
    step_s = statistics.median(times)
    prof = None
    if profile:
        box = [state]

        def once(run=compiled):
            box[0], m = run(box[0], batch)
            return m["loss"]
        prof = op_profile.profile(once, profile, hlo=compiled.as_text())
        state = box[0]
    tokens_s = B * T / step_s
    flops = 3 * accounting.flops_per_token(cfg, T)
    peak = peak_flops()
    del state, compiled, step
    return {"row": row, "batch": B, "seq_len": T, "remat": remat, "status": "ok", "step_s": step_s,
            "tokens_per_s": tokens_s, "mfu": tokens_s * flops / peak if peak else None,
            "memory_bytes": mem, "compile_s": compile_s, "losses": losses,
            "params": accounting.param_counts(cfg), **({"profile": prof} if prof else {})}


def _isolated(row, B, T, remat, *, steps, warmup, window, attention_impl, memory_backend, overrides, quick,
              profile=0) -> dict:
    """One measurement in a fresh Python process (its own allocator: no fragmentation left by
    earlier rows), read back from that process's JSON."""
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "experiments.train_bench", "--rows", row, "--shapes", f"{B}x{T}", "--remat", remat,
               "--steps", str(steps), "--warmup", str(warmup), "--window", str(window), "--attention-impl",
               attention_impl, "--memory-backend", memory_backend, "--profile", str(profile), "--out", tmp] + (
                   ["--quick"] if quick else [])
        for o in overrides:
            cmd += ["--set", o]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(C.REPO_ROOT))
        try:
            with open(f"{tmp}/{NAME}/{NAME}.json") as f:
                return json.load(f)["results"][0]
        except (OSError, ValueError, KeyError, IndexError):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            return {"row": row, "batch": B, "seq_len": T, "remat": remat, "status": "error",
                    "error": f"subprocess exited {proc.returncode}: {tail[0][:300]}"}


def run(quick: bool = False, out: str = "results", rows: Optional[str] = None, shapes: Optional[str] = None,
        remat: Optional[str] = None, steps: Optional[int] = None, warmup: Optional[int] = None,
        window: Optional[int] = None, attention_impl: str = "auto", memory_backend: str = "auto",
        overrides: Optional[list] = None, isolate: bool = False, profile: int = 0,
        merge: Optional[list] = None) -> dict:
    """Time every row of ``rows`` (default: all) at every shape of ``shapes`` (module docstring).
    ``shapes``, ``steps``, ``warmup`` and ``window`` left ``None`` take :data:`DEFAULTS`, or with
    ``quick`` :data:`QUICK_RUN`. ``merge``: instead, join the records of earlier calls (their
    ``--out`` roots or ``train_bench.json`` paths; the same model size) into one record, table and
    figure."""
    C.refuse_with_merge(merge, **{
        "--quick": quick, "--rows": rows is not None, "--shapes": shapes is not None, "--remat": remat is not None,
        "--steps": steps is not None, "--warmup": warmup is not None, "--window": window is not None,
        "--attention-impl": attention_impl != "auto", "--memory-backend": memory_backend != "auto",
        "--set": bool(overrides), "--isolate": bool(isolate), "--profile": bool(profile)})
    if merge:
        return merged(merge, out)
    given = dict(shapes=shapes, steps=steps, warmup=warmup, window=window)
    shapes, steps, warmup, window = (v if v is not None else (QUICK_RUN if quick else DEFAULTS)[k]
                                     for k, v in given.items())
    rows = ",".join(ROWS) if rows is None else rows
    remat = "dots" if remat is None else remat
    names = [r.strip() for r in rows.split(",") if r.strip()]
    bad = sorted(set(names) - set(ROWS))
    if bad or not names:
        raise ValueError(f"--rows: unknown row(s) {bad}; choose from {', '.join(ROWS)}")
    size = QUICK if quick else Size()
    # checked before anything runs: the flags' values as the library rows' configs take them
    for flag, kw in (("--attention-impl", dict(attention_impl=attention_impl)),
                     ("--memory-backend", dict(memory_backend=memory_backend))):
        try:
            model_config("hybrid", QUICK, "none", **kw)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    overrides = tuple(overrides or ())
    for o in overrides:
        for row in names:  # every row asked for: a field may be checked only where it is used (MoE's by moe)
            try:
                model_config(row, size, "none", overrides=(o,))
            except ValueError as e:
                raise ValueError(str(e) if str(e).startswith("--set") else f"--set {o} (row {row}): {e}") from None
    remats = [r.strip() for r in remat.split(",")]
    for r in remats:
        if r not in REMAT_POLICIES:
            raise ValueError(f"--remat: {r!r} is not one of {REMAT_POLICIES}")
    try:
        shape_list = [tuple(int(n) for n in s.lower().split("x")) for s in shapes.split(",") if s.strip()]
        assert shape_list and all(len(s) == 2 and min(s) > 0 for s in shape_list)
    except (ValueError, AssertionError):
        raise ValueError(f"--shapes: expected BxT pairs like '4x4096,1x32768', got {shapes!r}") from None
    for flag, value in (("--steps", steps), ("--warmup", warmup), ("--window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}: must be a positive int, got {value!r}")
    record = C.provenance(NAME, quick)
    record.update(size=dataclasses.asdict(size), shapes=shape_list, remat=remats, steps=steps, warmup=warmup,
                  window=window, attention_impl=attention_impl, memory_backend=memory_backend,
                  overrides=list(overrides), isolate=bool(isolate), profile=int(profile), results=[])
    jobs = [(r, B, T, rm) for (B, T) in shape_list for rm in remats for r in names]
    n_windows = max(1, steps // window)
    with C.progress(total=len(jobs) * n_windows * window, desc="train_bench", unit="step") as bar:
        failed = []
        for row, B, T, rm in jobs:
            bar.set_postfix_str(f"{row} {B}x{T} remat={rm}" + (f", {len(failed)} failed" if failed else ""))
            done = bar.n
            if isolate:
                res = _isolated(row, B, T, rm, steps=steps, warmup=warmup, window=window,
                                attention_impl=attention_impl, memory_backend=memory_backend, overrides=overrides,
                                quick=quick, profile=profile)
                if res.get("status") == "ok":
                    bar.update(n_windows * window)
                else:
                    failed.append(f"{row} {B}x{T} {res.get('status', 'error')}")
                    _drop_steps(bar, n_windows * window, failed)
                record["results"].append(res)
                C.save_partial(record, NAME, out)
                continue
            try:
                res = measure(row, B, T, size, remat=rm, steps=steps, warmup=warmup, window=window,
                              attention_impl=attention_impl, memory_backend=memory_backend, overrides=overrides,
                              bar=bar, profile=profile)
            except Exception as e:  # one row failing (out of memory, an unsupported kernel) must not end the run
                res = {"row": row, "batch": B, "seq_len": T, "remat": rm,
                       "status": "oom" if _is_oom(e) else "error",
                       "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                if res["status"] == "error":
                    traceback.print_exc()
                failed.append(f"{row} {B}x{T} {res['status']}")
                _drop_steps(bar, n_windows * window - (bar.n - done), failed)
            record["results"].append(res)
            jax.clear_caches()
            C.save_partial(record, NAME, out)
    _ratios(record)
    return C.finish(record, NAME, out, plot(record))


def _drop_steps(bar, steps: int, failed: list) -> None:
    """A failed row's steps that will not run leave the bar's total (they are not counted as done);
    the postfix counts the failed rows (``failed``: their names)."""
    bar.total -= steps
    bar.set_postfix_str(f"{failed[-1]}: {len(failed)} failed")


def _ratios(record: dict) -> None:
    """Each row's tokens/s over the reference's at the same shape and remat (when both ran)."""
    ref = {(r["batch"], r["seq_len"], r["remat"]): r.get("tokens_per_s") for r in record["results"]
           if r["row"] == "reference" and r["status"] == "ok"}
    for r in record["results"]:
        base = ref.get((r["batch"], r["seq_len"], r["remat"]))
        r["vs_reference"] = r["tokens_per_s"] / base if base and r["status"] == "ok" else None


def plot(record: dict):
    import matplotlib.pyplot as plt

    results = record["results"]
    groups = sorted({(r["batch"], r["seq_len"], r["remat"]) for r in results})
    rows = [r for r in ROWS if any(x["row"] == r for x in results)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) * len(groups)), 4.5))
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        xs, ys, failed = [], [], []
        for g, key in enumerate(groups):
            hit = [x for x in results if x["row"] == row and (x["batch"], x["seq_len"], x["remat"]) == key]
            ok = [x["tokens_per_s"] for x in hit if x["status"] == "ok"]
            xs.append(g + i * width)
            ys.append(max(ok) if ok else 0.0)  # a merged record may hold a failed and a fresh-process run
            failed.append(bool(hit) and not ok)
        ax.bar(xs, [y / 1e3 for y in ys], width, label=row)
        for x, bad in zip(xs, failed):
            if bad:
                ax.text(x, 0, "out of memory / error", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{b}x{t}\nremat={rm}" for b, t, rm in groups])
    ax.set_ylabel("tokens / s (thousands)")
    dev = record["device"]["description"]
    ax.set_title(f"Training throughput, d {record['size']['d_model']}, {record['size']['layers']} layers ({dev})")
    ax.legend(fontsize=8, ncol=2)
    return fig


def merged(sources: list, out: str) -> dict:
    """One record from earlier calls' records (same model size): their results in order, each
    result tagged with its source's date and commit (a result that carries its own tags — from an
    earlier merge — keeps them)."""
    records = C.load_records(NAME, sources)
    for src, rec in zip(sources[1:], records[1:]):
        if rec["size"] != records[0]["size"] or rec["quick"] != records[0]["quick"]:
            raise ValueError(f"merge: {src!r} measured another model size than {sources[0]!r}")
    results = []
    for rec in records:
        results += [dict(r, date=r.get("date", rec["date"]), git_commit=r.get("git_commit", rec["git_commit"]))
                    for r in rec["results"]]
    record = {k: v for k, v in records[-1].items() if k not in ("files", "results")}
    record.update(results=results, merged_from=[{"date": r["date"], "git_commit": r["git_commit"],
                                                 "git_dirty": r["git_dirty"]} for r in records])
    return C.finish(record, NAME, out, plot(record))


def table(record: dict) -> str:
    rows = []
    for r in record["results"]:
        if r["status"] == "ok":
            rows.append([r["row"], f"{r['batch']}x{r['seq_len']}", r["remat"], f"{r['tokens_per_s'] / 1e3:.1f}K",
                         "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                         "-" if r.get("vs_reference") is None else f"{r['vs_reference']:.2f}x",
                         "-" if r["memory_bytes"] is None else C.fmt_bytes(r["memory_bytes"]),
                         f"{r['compile_s']:.0f}s"])
        else:
            rows.append([r["row"], f"{r['batch']}x{r['seq_len']}", r["remat"], r["status"], "-", "-", "-", "-"])
    text = C.format_table(["row", "batch", "remat", "tokens/s", "MFU", "vs ref", "memory", "compile"], rows,
                          title=f"train_bench on {record['device']['description']}")
    profiles = [op_profile.table(r["profile"], f"{r['row']} {r['batch']}x{r['seq_len']} remat={r['remat']}: ")
                for r in record["results"] if r.get("profile")]
    return "\n\n".join([text] + profiles)


def main(argv=None):
    p = C.make_parser(NAME, __doc__.split("\n")[0], quick_help=(
        "a tiny model on a CPU (a smoke run of a minute or two): also --shapes {shapes} --steps {steps} "
        "--warmup {warmup} --window {window}, each only where the option is left unset".format(**QUICK_RUN)))
    p.add_argument("--rows", default=None,
                   help=f"comma-separated rows from {', '.join(ROWS)} (default: all)")
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated BxT batch shapes (default: {DEFAULTS['shapes']}; "
                        f"--quick: {QUICK_RUN['shapes']})")
    p.add_argument("--remat", default=None,
                   help=f"remat policy, or several comma-separated, from {', '.join(REMAT_POLICIES)} (default: dots)")
    p.add_argument("--steps", type=C.positive_int, default=None,
                   help=f"timed steps per row (default: {DEFAULTS['steps']}; --quick: {QUICK_RUN['steps']})")
    p.add_argument("--warmup", type=C.positive_int, default=None,
                   help=f"untimed steps after compiling (default: {DEFAULTS['warmup']}; "
                        f"--quick: {QUICK_RUN['warmup']})")
    p.add_argument("--window", type=C.positive_int, default=None,
                   help=f"steps per timing window; the median window is reported (default: {DEFAULTS['window']}; "
                        f"--quick: {QUICK_RUN['window']})")
    p.add_argument("--attention-impl", dest="attention_impl", default="auto", choices=ATTENTION_IMPLS,
                   help="ModelConfig.attention_impl of the library rows (default: auto)")
    p.add_argument("--memory-backend", dest="memory_backend", default="auto", choices=MEMORY_BACKENDS,
                   help="ModelConfig.memory_backend of the library rows (default: auto)")
    p.add_argument("--isolate", action="store_true",
                   help="run each row in its own process (one allocator per row: on one H200 a 45 GiB step "
                        "buffer failed to allocate after three other rows in the same process, and fit alone)")
    p.add_argument("--profile", type=C.non_negative_int, default=0, metavar="N",
                   help="also profile N steps of every row: GPU time per kind and the largest kernels, each XLA "
                        "fusion with the operations and source lines it fused (default: 0, off)")
    p.add_argument("--set", dest="overrides", action="append", metavar="FIELD=VALUE",
                   help="a ModelConfig field for every library row, e.g. --set moe_dispatch=capacity (repeatable)")
    p.add_argument("--merge", nargs="+", metavar="RECORD",
                   help="join earlier calls' records (--out roots or train_bench.json paths) instead of running")
    return C.main_for(NAME, p, run, table, argv)


if __name__ == "__main__":
    main()
