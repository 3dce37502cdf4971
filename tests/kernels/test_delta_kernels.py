"""Pallas chunked delta-rule kernels vs their token-by-token reference (``kernels.delta.reference``:
plain jax.numpy, nothing from lineage_jax), compiled on a GPU / TPU, in interpret mode on the
CPU and for a flavour other than the machine's.

Forward output, final state and every gradient (dq, dk, dv, dβ, dg, dh0) for
DeltaNet, Gated DeltaNet (scalar-gate kernels), KDA (exact per-channel kernels) and
bounded-gate KDA (``gate_lower_bound=-5``: anchored one-matmul diagonal tiles) with
odd T, an initial state and segment resets; gates at the lower bound −5 per token,
strong gates (−20 per token), tiles of mild and of strong gates in one sequence (exact KDA's
per-tile choice of the anchored or the looped diagonal) and unbounded gates (down to −1e3 per token, no NaN/Inf
anywhere); bf16 inputs; the TPU-flavoured kernels (head-major
layout, grid-sequential state pass with a VMEM scratch, 64-token chunks); and
that the kernels lower for Triton (``cuda``) and Mosaic (``tpu``) from this CPU.

Compiled functions are cached per static configuration so that the gate-regime
tests reuse one compilation (interpret mode compiles are the cost here).
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._jaxpr import live_pallas_calls, pallas_launches

from kernels.delta import api as kd
from kernels.delta import kernels as kn
from kernels.delta import reference as kref

B, T, H, K, V = 2, 75, 2, 16, 16  # odd T: 3 chunks of 32 (GPU flavour), 2 of 64 (TPU flavour)
RULES = ("delta", "gdn", "kda", "kda_bounded")  # kda_bounded: chunk_kda(..., gate_lower_bound=-5)
BOUND = -5.0
# On a CPU one xdist worker runs this file: the interpreted kernels and the references (cached below)
# are compiled once for the tests of every gate regime, dtype and flavour instead of again on the other
# worker. On a GPU the compiled kernels are quick to build and the file spreads over every worker.
pytestmark = [pytest.mark.xdist_group("delta_kernels")] if jax.default_backend() == "cpu" else []


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def make_inputs(seed, gates="uniform", dtype=np.float32, shape=None):
    """``shape``: ``(B, T, H, K, V)`` (default the module's)."""
    B, T, H, K, V = shape or (globals()["B"], globals()["T"], globals()["H"], globals()["K"], globals()["V"])
    r = np.random.default_rng(seed)
    f = np.float32
    k = r.normal(size=(B, T, H, K))
    x = dict(
        q=r.normal(size=(B, T, H, K)).astype(f),
        k=(k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(f),
        v=r.normal(size=(B, T, H, V)).astype(f),
        beta=r.uniform(0.05, 1.0, size=(B, T, H)).astype(f),
        S0=(0.5 * r.normal(size=(B, H, K, V))).astype(f),
        w_o=r.normal(size=(B, T, H, V)).astype(f),
        w_s=r.normal(size=(B, H, K, V)).astype(f),
    )
    if gates == "uniform":
        gc, gs = -r.uniform(0, 1, (B, T, H, K)), -r.uniform(0, 1, (B, T, H))
    elif gates == "mild":  # a model's gates near 0 (−0.2·σ(z)): a chunk's decay e^{Σ g} ≈ 0.2–1, not e^{−16}
        gc, gs = -r.uniform(0, 0.1, (B, T, H, K)), -r.uniform(0, 0.1, (B, T, H))
    elif gates == "bound":  # the K3 lower bound: −5 per token (half of them), else mild
        gc = np.where(r.uniform(size=(B, T, H, K)) < 0.5, -5.0, -r.uniform(0, 0.1, (B, T, H, K)))
        gs = np.where(r.uniform(size=(B, T, H)) < 0.5, -5.0, -r.uniform(0, 0.1, (B, T, H)))
    elif gates == "floor":  # every gate at the bound (the widest in-tile span, 16 × 5), a few at 0
        gc, gs = np.full((B, T, H, K), -5.0), np.full((B, T, H), -5.0)
        gc[:, 5::13], gs[:, 5::13] = 0.0, 0.0
    elif gates == "mixed":  # mild gates, but in a few 16-token tiles some channels decay by −30 per token:
        # GPU-flavour exact KDA anchors the mild tiles and runs the exact loop on those (per-tile branch)
        gc, gs = -r.uniform(0, 1, (B, T, H, K)), -r.uniform(0, 1, (B, T, H))
        for t0 in (16, 48):
            gc[:, t0:t0 + 16, :, :3] = -30.0
            gs[:, t0:t0 + 16] = -30.0
    elif gates == "huge":  # mild gates and one of −1e4 inside every 16-token tile (the f32 gate floor's case)
        gc, gs = -r.uniform(0, 0.2, (B, T, H, K)), -r.uniform(0, 0.2, (B, T, H))
        gc[:, 7::16], gs[:, 7::16] = -1e4, -1e4
    elif gates == "strong":  # strong unbounded gates: about −20 per token
        gc, gs = -r.uniform(18, 22, (B, T, H, K)), -r.uniform(18, 22, (B, T, H))
    else:  # unbounded: heavy-tailed, some tokens near −1e3, some exactly 0
        gc = -np.abs(r.standard_cauchy((B, T, H, K))) * 3.0
        gs = -np.abs(r.standard_cauchy((B, T, H))) * 3.0
        gc[:, ::7] = -1e3
        gs[:, ::11] = -1e3
        gc[:, 3::9] = 0.0
        gc, gs = np.maximum(gc, -1e3), np.maximum(gs, -1e3)
    x["g"], x["gs"] = gc.astype(f), gs.astype(f)
    seg = np.zeros((B, T), np.int32)
    for b, cuts in zip(range(B), ([20, 32, 33, 64], [1, 50])):  # resets mid-tile, on chunk edges, adjacent
        for c in cuts:
            seg[b, c:] += 1
    x["seg"] = seg
    if dtype != np.float32:
        for n in ("q", "k", "v", "beta"):
            x[n] = np.asarray(jnp.asarray(x[n], dtype))
    return x


def _interpret(target):
    """Compiled where the kernels' flavour is the machine's, interpreted elsewhere (CPU, or the TPU
    flavour on a GPU). Interpret mode on a GPU is not float32-exact: XLA's excess-precision
    rewrites fold the bf16 splits of the GPU flavour's float32 products."""
    here = jax.default_backend()
    return here == "cpu" or (target or kd.default_target()) != here


def _rule(rule, backend, target=None, chunk_size=None, tuning=()):
    def fn(q, k, v, g, gs, beta, S0, seg):
        kw = dict(initial_state=S0, segment_ids=seg)
        if backend == "kernels":
            kw.update(target=target, interpret=_interpret(target), chunk_size=chunk_size, **dict(tuning))
            if rule == "kda":
                return kd.chunk_kda(q, k, v, g, beta, **kw)
            if rule == "kda_bounded":
                return kd.chunk_kda(q, k, v, g, beta, gate_lower_bound=BOUND, **kw)
            if rule == "gdn":
                return kd.chunk_gated_delta_rule(q, k, v, gs, beta, **kw)
            return kd.chunk_delta_rule(q, k, v, beta, **kw)
        gate = {"kda": g, "kda_bounded": g, "gdn": gs}.get(rule)  # the token-by-token reference
        return kref.recurrent(q, k, v, beta, gate, **kw)
    return fn


@functools.lru_cache(maxsize=None)
def value_and_grads(rule, backend, docs, target=None, chunk_size=None, tuning=()):
    fn = _rule(rule, backend, target, chunk_size, tuning)

    def loss(q, k, v, g, gs, beta, S0, seg, w_o, w_s):
        o, S = fn(q, k, v, g, gs, beta, S0, seg if docs else None)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(S * w_s), (o, S)

    opts = None
    if backend == "kernels" and (_interpret(target) or target == "tpu") and jax.default_backend() == "gpu":
        # Interpreted on a GPU (by Pallas, or the TPU flavour by JAX's TPU interpret mode), the kernels'
        # bf16 splits of float32 operands are XLA ops; keep XLA from folding f32 -> bf16 -> f32 round
        # trips ("excess precision") so they stay exact.
        opts = {"xla_allow_excess_precision": False}
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6), has_aux=True), compiler_options=opts)


def run(rule, backend, x, docs, **kw):
    # The reference of bounded-gate KDA is KDA's (the bound is a kernel option): one compilation.
    f = value_and_grads("kda" if backend == "reference" and rule == "kda_bounded" else rule, backend, docs, **kw)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "gs", "beta", "S0", "seg", "w_o", "w_s")]
    if backend == "reference":  # f32 copies of the (possibly bf16-rounded) inputs
        args = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    (_, (o, S)), grads = f(*args)
    return o, S, dict(zip(("dq", "dk", "dv", "dg", "dgs", "dbeta", "dS0"), grads))


def check(rule, x, docs, tol, **kw):
    o1, s1, g1 = run(rule, "kernels", x, docs, **kw)
    o0, s0, g0 = run(rule, "reference", x, docs)
    for name, a in [("o", o1), ("S", s1), *g1.items()]:
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"{rule}: non-finite {name}"
    assert rel_err(o1, o0) <= tol, ("o", rel_err(o1, o0))
    assert rel_err(s1, s0) <= tol, ("S", rel_err(s1, s0))
    used = {"delta": ("dq", "dk", "dv", "dbeta", "dS0"), "gdn": ("dq", "dk", "dv", "dgs", "dbeta", "dS0"),
            "kda": ("dq", "dk", "dv", "dg", "dbeta", "dS0")}[rule.replace("_bounded", "")]
    for name in used:
        ref = np.asarray(g0[name], np.float32)
        if np.max(np.abs(ref)) == 0:
            assert np.max(np.abs(np.asarray(g1[name], np.float32))) == 0, name
            continue
        err = rel_err(g1[name], ref)
        assert err <= tol, (rule, name, err)


def check_forward_alone(rule, x, seg, tol, **knobs):
    """The undifferentiated GPU-flavour call (compiled on a GPU, interpreted elsewhere) with launch knobs
    ``knobs``: output and final state against the reference's, to ``tol``."""
    q, k, v, beta, S0 = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta", "S0"))
    g = {"kda": x["g"], "kda_bounded": x["g"], "gdn": x["gs"]}.get(rule)
    g = None if g is None else jnp.asarray(g)
    kw = dict(initial_state=S0, segment_ids=seg, target="gpu", interpret=_interpret("gpu"), **knobs)
    if rule == "delta":
        o1, s1 = kd.chunk_delta_rule(q, k, v, beta, **kw)
    elif rule == "gdn":
        o1, s1 = kd.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    else:
        o1, s1 = kd.chunk_kda(q, k, v, g, beta, **kw, **({"gate_lower_bound": BOUND} if rule == "kda_bounded" else {}))
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    o0, s0 = kref.recurrent(f32(q), f32(k), f32(v), f32(beta), g, initial_state=S0, segment_ids=seg)
    assert rel_err(o1, o0) <= tol and rel_err(s1, s0) <= tol, (rel_err(o1, o0), rel_err(s1, s0))


@pytest.mark.parametrize("rule", ["delta", "gdn", "kda"])
def test_reference_matches_the_float64_token_loop(rule):
    """The kernels' reference itself (``kref.recurrent``) against the float64 NumPy loop of
    ``tests.memory.naive`` (no code shared): output and final state, with resets and an initial state.
    Its gradients are ``jax.grad`` of this scan."""
    from tests.memory import naive
    x = make_inputs(30)
    g = {"delta": None, "gdn": x["gs"], "kda": x["g"]}[rule]
    o, S = jax.jit(kref.recurrent)(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "beta")),
                                    None if g is None else jnp.asarray(g), initial_state=jnp.asarray(x["S0"]),
                                    segment_ids=jnp.asarray(x["seg"]))
    o_ref, S_ref = naive.delta_family(x["q"], x["k"], x["v"], beta=x["beta"], g=g, initial_state=x["S0"],
                                      segment_ids=x["seg"])
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(S, S_ref) <= 1e-5, (rel_err(o, o_ref), rel_err(S, S_ref))


# Without segment ids the kernels drop their document operand (``Cfg.docs``), the same switch for
# every gate: the default suite checks that path with KDA's per-channel gate, the other rules with -m slow.
FP32_CASES = [pytest.param(rule, True, id=f"resets-{rule}") for rule in RULES] + [
    pytest.param(rule, False, id=f"no-resets-{rule}", marks=() if rule == "kda" else pytest.mark.slow) for rule in RULES]


@pytest.mark.parametrize("rule,docs", FP32_CASES)
def test_fp32_forward_and_grads_match_the_reference(rule, docs):
    check(rule, make_inputs(0), docs, 1e-4)


@pytest.mark.parametrize("rule,gates", [(r, g) for r in ("kda", "gdn") for g in ("bound", "strong", "unbounded")]
                         + [("kda", "mixed")]
                         + [("kda_bounded", "bound"), ("kda_bounded", "floor")])
def test_extreme_gates(rule, gates):
    check(rule, make_inputs(1, gates=gates), True, 1e-4)


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_huge_gates_keep_float32_precision(rule):
    """f32: a gate of −1e4 inside a tile left the decays after it ~1e-3 off (differences of prefix sums near
    1e4); raised to ``api.GATE_FLOOR`` (−110: the same decays in f32) every output and gradient stays within
    5.4e-6 (KDA) and 5.0e-6 (GDN) of the reference on the CPU."""
    check(rule, make_inputs(2, gates="huge"), True, 2e-5)


@pytest.mark.parametrize("rule", ["kda", "delta", "gdn", "kda_bounded"])
def test_bf16_inputs(rule):
    x = make_inputs(2, dtype=jnp.bfloat16)
    check(rule, x, True, 1e-2)
    o, S, g = run(rule, "kernels", x, True)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert g["dq"].dtype == jnp.bfloat16 and g["dS0"].dtype == jnp.float32


@pytest.mark.parametrize("rule", ["gdn", "kda_bounded", pytest.param("delta", marks=pytest.mark.slow),
                                  pytest.param("kda", marks=pytest.mark.slow)])
def test_bf16_tile_forward_with_the_whole_back_solve(rule):
    """16-bit inputs with ``intra="tiles"`` (KDA's form for bounds below ``-WHOLE_SPAN / (C/2)``): the tile
    forward kernel stores only the 16×16 tile
    inverses in ``KK``, and the backward's solve kernel merges them (``kernels.intra_bwd_solve_whole``) —
    forward, final state and every gradient against the reference, with resets, to 1e-2."""
    check(rule, make_inputs(3, dtype=jnp.bfloat16), True, 1e-2, target="gpu", tuning=(("intra", "tiles"),))


@pytest.mark.parametrize("rule", ["gdn", pytest.param("kda", marks=pytest.mark.slow)])
def test_one_chunk_sequences(rule):
    """T = 20: one chunk, so the state loops run a single step — the decay they apply a step late
    (``kernels._lagged_decay``) reaches the final state and the initial state's gradient only after
    the loop; a reset at token 1 in one of the sequences."""
    x = make_inputs(5)
    for n in ("q", "k", "v", "beta", "w_o", "g", "gs", "seg"):
        x[n] = np.ascontiguousarray(x[n][:, :20])
    check(rule, x, True, 1e-4)


def test_tpu_flavour_in_interpret_mode():
    """Head-major layout, K/V padded to 128, 64-token chunks, grid-sequential state passes."""
    check("kda", make_inputs(3), True, 1e-4, target="tpu")


@pytest.mark.parametrize("rule", ["kda", pytest.param("gdn", marks=pytest.mark.slow),
                                  pytest.param("kda_bounded", marks=pytest.mark.slow)])
def test_four_tile_chunks_on_gpu_flavour(rule):
    """chunk_size=64: four 16-row tiles, six off-diagonal tile pairs. The tile-pair loops are one code
    path for every gate; exact KDA (per-channel decays, anchored or looped diagonal tiles) is the most
    general of the three here, GDN and bounded KDA at C = 64 are -m slow (at C = 32 they run above)."""
    check(rule, make_inputs(4, gates="bound"), True, 1e-4, target="gpu", chunk_size=64)


def test_unfused_output_kernel_on_gpu_flavour():
    """``fuse_output=False``: the output kernel after the state pass instead of the state pass taking
    the output (the default, tested above) — the same forward, final state and gradients."""
    check("gdn", make_inputs(0), True, 1e-4, target="gpu", tuning=(("fuse_output", False),))


@pytest.mark.parametrize("target,fuse,rule,split", [
    ("gpu", True, "kda", 1), ("gpu", False, "kda", 1), ("tpu", True, "kda", 1), ("gpu", True, "gdn", 1),
    ("gpu", False, "delta", 1), ("tpu", True, "gdn", 1), ("gpu", True, "delta", 3), ("gpu", False, "kda", 3)])
def test_forward_alone_matches_the_reference(target, fuse, rule, split):
    """An undifferentiated call keeps no residuals: with the output fused, the state pass stores no
    per-chunk state at all (and for DeltaNet and GDN reads q and k through their row factors); split
    state passes (``state_split``) keep no maps. Its output and final state equal the reference's."""
    x = make_inputs(5)
    q, k, v, beta, S0, seg = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta", "S0", "seg"))
    g = {"kda": jnp.asarray(x["g"]), "gdn": jnp.asarray(x["gs"]), "delta": None}[rule]
    fn = {"kda": kd.chunk_kda, "gdn": kd.chunk_gated_delta_rule,
          "delta": lambda q, k, v, g, beta, **kw: kd.chunk_delta_rule(q, k, v, beta, **kw)}[rule]
    o1, s1 = jax.jit(lambda *a: fn(*a, initial_state=S0, segment_ids=seg, target=target,
                                   interpret=_interpret(target), fuse_output=fuse, state_split=split))(q, k, v, g, beta)
    o0, s0 = kref.recurrent(q, k, v, beta, g, initial_state=S0, segment_ids=seg)
    assert rel_err(o1, o0) <= 1e-4 and rel_err(s1, s0) <= 1e-4
    if rule != "kda":
        return
    g = jnp.asarray(x["g"])
    with pytest.raises(ValueError, match="fuse_output"):
        kd.chunk_kda(q, k, v, g, beta, target=target, interpret=True, fuse_output=1)


def spy_transposed(monkeypatch, *names):
    """Record the ``transposed`` flag each state loop in ``names`` (``kernels.delta.kernels``) is traced
    with, ``{name: [flags]}``; clears the compilation caches that would skip the tracing."""
    seen = {name: [] for name in names}
    for name in names:
        def spy(*a, transposed=False, _loop=getattr(kn, name), _seen=seen[name], **kw):
            _seen.append(transposed)
            return _loop(*a, transposed=transposed, **kw)
        monkeypatch.setattr(kn, name, spy)
    kd._state_fwd.clear_cache()  # the state pass is traced here, not taken from another test's compilation
    value_and_grads.cache_clear()
    return seen


@pytest.mark.parametrize("rule,dtype,docs,tuning,transposed", [
    ("delta", np.float32, False, (), True), ("kda", np.float32, True, (), True),
    ("kda_bounded", jnp.bfloat16, True, (), True), ("delta", jnp.bfloat16, False, (), True),
    ("gdn", np.float32, True, (("qk_arrays", True),), True), ("gdn", np.float32, True, (), True),
    ("delta", np.float32, True, (("state_pairs", True),), False),
    pytest.param("delta", np.float32, True, (), True, marks=pytest.mark.slow),
    pytest.param("gdn", jnp.bfloat16, False, (), True, marks=pytest.mark.slow)])
def test_transposed_state(rule, dtype, docs, tuning, transposed, monkeypatch):
    """``transposed_state=True``: an undifferentiated call's GPU state pass carries ``Sᵀ`` (the output taken
    in the pass, no per-chunk state stored) — output and final state against the reference, f32 to 1e-4,
    bf16 to 1e-2, with resets and an initial state; the loop must receive ``transposed`` (not with
    ``state_pairs``). Row-factor columns (GDN without ``qk_arrays``, DeltaNet with documents) reach it with
    ``eout`` as rows. ``"auto"`` and the refusals: :func:`test_transposed_state_passes_by_default`."""
    seen = spy_transposed(monkeypatch, "state_fwd_loop")["state_fwd_loop"]
    x = make_inputs(21, dtype=dtype, shape=(1, 40, 2, 16, 16))
    seg = jnp.asarray(x["seg"]) if docs else None
    check_forward_alone(rule, x, seg, 1e-4 if dtype == np.float32 else 1e-2, transposed_state=True, **dict(tuning))
    assert seen == [transposed]


@pytest.mark.parametrize("rule,dtype,docs,split", [
    ("delta", np.float32, True, 1), ("gdn", np.float32, False, 1), ("kda", jnp.bfloat16, True, 1),
    ("gdn", jnp.bfloat16, True, 1), ("delta", jnp.bfloat16, False, 1),
    pytest.param("kda_bounded", np.float32, False, 3, marks=pytest.mark.slow)])
def test_transposed_training_passes(rule, dtype, docs, split, monkeypatch):
    """``transposed_state=True`` in a differentiated call: the training forward (``h`` and ``Ũ`` stored
    transposed back) and the Triton backward pass (``dSᵀ``; ``dh``, ``dŨ`` transposed back) — output,
    final state and every gradient against the reference, f32 to 1e-4, bf16 to 1e-2, with resets and an
    initial state; row-factor columns (f32 GDN, DeltaNet with documents) read ``eout`` as rows in both
    passes; ``split``: the passes on 3 segments of two chunks (``state_split``). Both loops must receive
    ``transposed``."""
    seen = spy_transposed(monkeypatch, "state_fwd_loop", "state_bwd_loop")
    x = make_inputs(22, dtype=dtype, shape=(1, 96 * (2 if split > 1 else 1), 2, 16, 16))  # segments of 2 chunks
    tuning = (("transposed_state", True), ("state_bwd", "triton")) + ((("state_split", split),) if split > 1 else ())
    check(rule, x, docs, 1e-4 if dtype == np.float32 else 1e-2, target="gpu", tuning=tuning)
    assert all(flags and all(flags) for flags in seen.values()), seen


@pytest.mark.parametrize("rule,transposed,dtype", [
    ("gdn", True, np.float32), ("gdn", False, np.float32), ("kda", True, jnp.bfloat16), ("kda", False, np.float32),
    pytest.param("kda_bounded", True, np.float32, marks=pytest.mark.slow),
    pytest.param("gdn", True, jnp.bfloat16, marks=pytest.mark.slow)])
def test_mild_gates_carry_the_state_across_chunks(rule, transposed, dtype):
    """Gates near 0 (``"mild"``: a chunk's decay ≈ 0.2–1, where the suite's other gates leave ≈ e^{−16} or
    less of the state to the next chunk): the state passes' decay between chunks, transposed or not,
    forward and every gradient against the reference, without resets (documents zero the decays)."""
    x = make_inputs(24, gates="mild", dtype=dtype, shape=(1, 96, 2, 16, 16))
    check(rule, x, False, 1e-4 if dtype == np.float32 else 1e-2, target="gpu",
          tuning=(("transposed_state", transposed), ("state_bwd", "triton")))


@pytest.mark.parametrize("state_dot,target,intra", [
    ("tensor", "gpu", "whole"), ("tensor", "tpu", "tiles"), ("fused", "gpu", "whole"),
    ("elementwise", "gpu", "whole"),
    pytest.param("tensor", "gpu", "tiles", marks=pytest.mark.slow),
    pytest.param("fused", "gpu", "tiles", marks=pytest.mark.slow)])
def test_state_dot_forms(state_dot, target, intra):
    """``state_dot``: GDN's ``Σ S ⊙ dS`` (the gate gradient through a chunk's decay) as the trace of 64-row
    block products (``"tensor"``), from the ``dS`` the whole-chunk scores kernel loads for ``dkout``
    (``"fused"``, the default; the tile kernels keep the elementwise products) or as elementwise products
    of both states read again. bf16 inputs at K = 128 (two blocks),
    mild gates (that term reaches ``dg``), forward and every gradient against the reference, in the whole
    and the tile scores kernels."""
    x = make_inputs(31, gates="mild", dtype=jnp.bfloat16, shape=(1, 96, 2, 128, 32))
    tuning = (("state_dot", state_dot), ("intra", intra)) if target == "gpu" else (("state_dot", state_dot),)
    check("gdn", x, False, 1e-2, target=target, tuning=tuning)
    a = [jnp.asarray(x[n]) for n in ("q", "k", "v", "gs", "beta")]
    assert kd._debug_spec(*a, state_dot=state_dot)[0].cfg.state_dot == state_dot
    assert kd._debug_spec(*a)[0].cfg.state_dot == "fused"
    with pytest.raises(ValueError, match="state_dot"):
        kd.chunk_gated_delta_rule(*a, interpret=True, state_dot="trace")


@pytest.mark.parametrize("rule", ["gdn", "kda"])
def test_one_chunk_state_passes_stay_untransposed(rule, monkeypatch):
    """A state pass over one chunk runs untransposed even with ``transposed_state=True`` (interpreted on a
    CPU, XLA folds the one-step loop's transposes into bf16 dots its CPU runtime cannot run): a bf16
    sequence of 20 tokens, its forward alone and its gradients, against the reference."""
    seen = spy_transposed(monkeypatch, "state_fwd_loop", "state_bwd_loop")
    x = make_inputs(23, dtype=jnp.bfloat16, shape=(1, 20, 2, 16, 16))
    check_forward_alone(rule, x, jnp.asarray(x["seg"]), 1e-2, transposed_state=True)
    check(rule, x, True, 1e-2, target="gpu", tuning=(("transposed_state", True), ("state_bwd", "triton")))
    assert all(flags and not any(flags) for flags in seen.values()), seen


def test_transposed_state_passes_by_default():
    """``transposed_state="auto"`` (:func:`kernels.delta.api.default_transposed_state`): on GPUs the forward
    that stores nothing ("fwd") and the backward ("bwd") always, the training forward ("train") too except
    with scalar gates (GDN), whose training forward is transposed only with 16-bit inputs on at most
    ``STATE_PROGRAMS`` programs of at most 32 value columns; nothing on TPUs. True: every pass; False: none;
    a tuple names the passes. Other values, unknown passes and any transposed pass on a TPU are refused by
    name."""
    a = ([jnp.zeros((1, 64, 2, 16), jnp.bfloat16)] * 2 + [jnp.zeros((1, 64, 2, 64), jnp.bfloat16)]  # V = 64
         + [jnp.ones((1, 64, 2), jnp.bfloat16)])
    a32 = [y.astype(jnp.float32) for y in a]
    gs, gc = -jnp.ones((1, 64, 2)), -jnp.ones((1, 64, 2, 16))
    spec = lambda args, g, **knobs: kd._debug_spec(*args[:3], g, args[3], **knobs)[0].transposed_state  # noqa: E731
    assert spec(a, None) == spec(a, gc) == spec(a, None, bv=64) == ("fwd", "train", "bwd")
    # GDN, 16-bit: 2 programs of 16 columns here; 512 programs of 32 columns at B = 8, H = 16, K = V = 128
    assert spec(a, gs) == spec(a, gs, qk_arrays=True) == ("fwd", "train", "bwd")
    assert spec(a, gs, bv=64) == ("fwd", "bwd")
    wide = [jnp.zeros((8, 64, 16, 128), jnp.bfloat16)] * 3 + [jnp.ones((8, 64, 16), jnp.bfloat16)]
    assert spec(wide, -jnp.ones((8, 64, 16))) == ("fwd", "bwd")
    assert kd.default_transposed_state("gpu", "scalar", kd.STATE_PROGRAMS, 32) == ("fwd", "train", "bwd")
    assert kd.default_transposed_state("gpu", "scalar", kd.STATE_PROGRAMS + 1, 32) == ("fwd", "bwd")
    assert kd.default_transposed_state("gpu", "scalar", kd.STATE_PROGRAMS, 128) == ("fwd", "bwd")  # split passes
    assert kd.default_transposed_state("gpu", "scalar", kd.STATE_PROGRAMS, 32, low=False) == ("fwd", "bwd")
    assert spec(a32, None) == spec(a32, gc) == ("fwd", "train", "bwd") and spec(a32, gs) == ("fwd", "bwd")
    assert spec(a32, gs, transposed_state=True) == kd.TRANSPOSED_PASSES
    assert spec(a, None, transposed_state=False) == ()
    assert spec(a, gs, transposed_state=("bwd",)) == ("bwd",)
    assert kd.default_transposed_state("tpu") == kd.default_transposed_state("tpu", "channel") == ()
    for bad in ("yes", ("fwd", "sideways")):
        with pytest.raises(ValueError, match="transposed_state"):
            kd.chunk_delta_rule(*a, target="gpu", interpret=True, transposed_state=bad)
    for bad in (True, ("bwd",)):
        with pytest.raises(ValueError, match="transposed_state"):
            kd.chunk_delta_rule(*a, target="tpu", interpret=True, transposed_state=bad)


@pytest.mark.parametrize("rule,target,dtype,fuse", [("delta", "gpu", "float32", True), ("kda", "gpu", "float32", True),
                                                    ("gdn", "gpu", "bfloat16", True), ("kda_bounded", "tpu", "float32", True),
                                                    ("gdn", "gpu", "float32", False)])
def test_split_state_passes(rule, target, dtype, fuse):
    """``state_split=P``: the state passes run P segments of every sequence at once — a first pass
    finds each segment's map of its start state, P small products chain the true starts (the
    backward: the gradients of the segments' ends, from the last back), then the ordinary passes run
    on B·P sequences (``api._state_forward``). Forward, final state and every gradient, the initial
    state's included, equal the reference's, with resets inside and on the segments' edges. T = 75:
    three 32-token chunks on the GPU flavour (P = 3, a segment per chunk), two of 64 on the TPU
    flavour (P = 2, head-major segments); with the output kernel after the split pass too."""
    x = make_inputs(9, dtype=jnp.dtype(dtype))
    P = 3 if target == "gpu" else 2
    check(rule, x, True, 1e-4 if dtype == "float32" else 1e-2, target=target,
          tuning=(("state_split", P), ("fuse_output", fuse)))


@pytest.mark.parametrize("rule,target", [("gdn", "gpu"), ("kda", "gpu"),
                                         pytest.param("kda", "tpu", marks=pytest.mark.slow)])
def test_split_state_passes_with_mild_gates(rule, target):
    """``state_split=P`` where a segment's start state still matters: mild gates (a chunk decays by
    ≈ 0.2–1) and no resets, so the chained segment starts (and their gradients) reach the outputs."""
    x = make_inputs(25, gates="mild")
    check(rule, x, False, 1e-4, target=target, tuning=(("state_split", 3 if target == "gpu" else 2),))


@pytest.mark.parametrize("rule,target,order", [("kda", "gpu", "nbh"), ("gdn", "gpu", "hnb"), ("delta", "tpu", "nhb")])
def test_grid_order(rule, target, order):
    """``grid_order``: the parallel kernels' (batch, head, chunk) grid launched in another order reads
    and writes the same blocks — forward, final state and every gradient equal the reference's."""
    check(rule, make_inputs(10), True, 1e-4, target=target, tuning=(("grid_order", order),))
    x = make_inputs(6)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="grid_order"):
        kd.chunk_delta_rule(q, k, v, beta, target=target, grid_order="bnn")


@pytest.mark.parametrize("rule,G,order", [("kda", 3, "bhn"), ("gdn", 3, "nbh"),
                                           pytest.param("delta", 3, "bhn", marks=pytest.mark.slow)])
def test_chunks_per_program(rule, G, order):
    """``chunks_per_program``: each program of the backward's intra-chunk kernels loops over G chunks
    of a G-chunk block (``kernels.ChunkView``; here all 3 chunks of a sequence) — forward, final state
    and every gradient equal the reference's, with resets and an initial state; G must divide the
    chunk count, is GPU-only and above 1 needs chunks of at most 32 tokens and, with f32 inputs, K·V below
    128·128 (all named). With
    ``grid_order`` the grouped grid is launched in that order."""
    check(rule, make_inputs(11), True, 1e-4, tuning=(("chunks_per_program", G), ("grid_order", order)))
    x = make_inputs(6)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="chunks_per_program"):
        kd.chunk_delta_rule(q, k, v, beta, chunk_size=16, target="gpu", chunks_per_program=3)
    with pytest.raises(ValueError, match="chunks_per_program"):
        kd.chunk_delta_rule(q, k, v, beta, target="tpu", chunks_per_program=2)
    with pytest.raises(ValueError, match="chunks_per_program.*chunk_size"):  # C = 64: shared memory
        kd.chunk_delta_rule(q, k, v, beta, target="gpu", interpret=True, chunks_per_program=2, chunk_size=64)
    wide = jnp.zeros((1, 64, 1, 128), jnp.float32)  # f32 at K = V = 128: shared memory again
    with pytest.raises(ValueError, match="chunks_per_program.*float32"):
        kd.chunk_delta_rule(wide, wide, wide, jnp.ones((1, 64, 1)), target="gpu", interpret=True, chunks_per_program=2)
    w16 = wide.astype(jnp.bfloat16)
    assert kd._debug_spec(w16, w16, w16, None, jnp.ones((1, 64, 1)),
                          chunks_per_program=2)[0].chunks_per_program == 2  # 16-bit inputs loop there


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="a compiled launch's shared memory: GPUs only")
@pytest.mark.parametrize("rule,T", [("delta", 128), ("kda", 128), ("gdn", 2048)])
def test_f32_launches_fit_at_full_width(rule, T):
    """f32 inputs at K = V = 128: the default launches fit a GPU's shared memory — the backward's looped
    intra-chunk kernels (an even chunk count: T = 128) asked for 339 KB (DeltaNet) and 484 KB (KDA) of an
    H200's 227 KB, and split state passes (T = 2048 with one sequence of two heads) 128 columns wide for
    233 KB. Compiled, fwd+bwd with resets and an initial state against the reference, to 1e-4."""
    x = make_inputs(13, shape=(1, T, 2, 128, 128))
    from kernels.delta import api
    q = jnp.asarray(x["q"])
    spec = api._debug_spec(q, q, jnp.asarray(x["v"]), None, jnp.asarray(x["beta"]))[0]
    assert spec.chunks_per_program == spec.solve_chunks == 1 and (spec.bv <= 64 or T < 2048)
    check(rule, x, True, 1e-4)


@pytest.mark.parametrize("rule", ["gdn", pytest.param("delta", marks=pytest.mark.slow)])
def test_default_chunk_grouping(rule):
    """16-bit inputs with an even chunk count (T = 128: 4 chunks of 32) on the GPU flavour and default
    knobs: the backward's solve kernel loops over ``PROGRAM_CHUNKS`` chunks a program for every rule, the
    scores kernel for DeltaNet and KDA only (``default_chunks_per_program``) — forward, final state and
    every gradient against the reference, with resets, an initial state and gates that carry the state."""
    from kernels.delta import api
    x = make_inputs(29, gates="mild", dtype=jnp.bfloat16, shape=(2, 128, 2, 16, 16))
    q, v, b = (jnp.asarray(x[n]) for n in ("q", "v", "beta"))
    g = jnp.asarray(x["gs"]) if rule == "gdn" else None
    s = api._debug_spec(q, q, v, g, b)[0]
    G = api.PROGRAM_CHUNKS
    assert (s.solve_chunks, s.chunks_per_program) == ((G, 1) if rule == "gdn" else (G, G))
    check(rule, x, True, 1e-2, target="gpu")


def test_default_chunks_per_program():
    """``chunks_per_program="auto"``: on GPUs ``PROGRAM_CHUNKS`` chunks a program where that divides the
    chunk count, except for the scalar gate's (GDN's) scores kernel; 1 on TPUs. An explicit value sets both
    backward kernels'."""
    from kernels.delta import api
    G = api.PROGRAM_CHUNKS
    assert api.default_chunks_per_program("gpu", "none", 4 * G) == G
    assert api.default_chunks_per_program("gpu", "channel", 4 * G) == G
    assert api.default_chunks_per_program("gpu", "scalar", 4 * G) == 1
    assert api.default_chunks_per_program("gpu", "scalar", 4 * G, kernel="solve") == G  # gate-free kernel
    assert api.default_chunks_per_program("gpu", "scalar", 4 * G + 1, kernel="solve") == 1
    with pytest.raises(ValueError, match="kernel"):
        api.default_chunks_per_program("gpu", "none", 4 * G, kernel="intra")
    assert api.default_chunks_per_program("gpu", "none", 4 * G + 1) == 1
    assert api.default_chunks_per_program("tpu", "none", 4 * G) == 1
    assert api.default_chunks_per_program("gpu", "none", 4 * G, 64) == 1  # C > 32: one chunk (shared memory)
    assert api.default_chunks_per_program("gpu", "channel", 4 * G, 32, low=False) == 1  # f32: shared memory too
    assert api.split_bv(32) == api.SPLIT_BV and api.split_bv(32, low=False) == api.split_bv(64) == 64
    x = jnp.zeros((1, 256, 2, 16), jnp.bfloat16)
    assert api._debug_spec(x, x, x, None, x[..., 0])[0].chunks_per_program == G        # 8 chunks of 32
    gdn = api._debug_spec(x, x, x, x[..., 0].astype(jnp.float32), x[..., 0])[0]
    assert (gdn.chunks_per_program, gdn.solve_chunks) == (1, G)                          # GDN: the solve kernel loops
    gdn = api._debug_spec(x, x, x, x[..., 0].astype(jnp.float32), x[..., 0], chunks_per_program=1)[0]
    assert (gdn.chunks_per_program, gdn.solve_chunks) == (1, 1)                          # explicit: both kernels
    x32 = x.astype(jnp.float32)
    assert api._debug_spec(x32, x32, x32, None, x32[..., 0])[0].chunks_per_program == 1  # f32 inputs


def test_default_state_split():
    """``default_state_split``: on GPUs, only where the unsplit passes would launch fewer than
    ``STATE_PROGRAMS`` programs of 32 value columns; then segments double until ``SPLIT_SEQUENCES``
    segments × heads while each keeps ``SPLIT_MIN_CHUNKS`` chunks and P divides the chunk count; the
    split passes run ``SPLIT_BV`` columns wide on 8 warps. Never on TPUs; an explicit P must divide
    the chunk count (named in the error)."""
    from kernels.delta import api
    m, n = api.SPLIT_MIN_CHUNKS, api.SPLIT_SEQUENCES
    assert api.default_state_split("gpu", 16, 1024, 128) == n // 16          # (1, 32768) x 16 heads
    assert api.default_state_split("gpu", 32, 1024, 128) == 1                # (2, 8192): 128 programs
    assert api.default_state_split("gpu", 1, 2 * m, 128) == 2                # segments keep m chunks
    assert api.default_state_split("gpu", 1, 2 * m - 2, 128) == 1
    assert api.default_state_split("gpu", 1, 2 * m + 1, 128) == 1            # P must divide N
    assert api.default_state_split("tpu", 1, 1024, 128) == 1
    assert api.default_warps_state(128) == 8 and api.default_warps_state(32) == 4
    assert api.default_warps_state(32, low=False) == 8 and api.default_warps_state(64, low=False) == 8
    big = jnp.zeros((1, 32768, 16, 128), jnp.bfloat16)
    s, _ = api._debug_spec(big, big, big, None, big[..., 0])
    assert (s.state_split, s.bv, s.num_warps_state) == (n // 16, api.SPLIT_BV, 8)
    s, _ = api._debug_spec(big, big, big, None, big[..., 0], chunk_size=64)  # C > 32: narrower blocks
    assert (s.state_split, s.bv, s.num_warps_state) == (n // 16, api.split_bv(64), 4) and api.split_bv(64) == 64
    s, _ = api._debug_spec(big[:, :256], big[:, :256], big[:, :256], None, big[:, :256, :, 0])
    assert (s.state_split, s.bv, s.num_warps_state) == (1, 16, 4)
    x = make_inputs(6)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    for bad in (2, 0, 1.5, True, "four"):  # T = 75: 3 chunks of 32
        with pytest.raises(ValueError, match="state_split"):
            kd.chunk_delta_rule(q, k, v, beta, target="gpu", state_split=bad)


def test_block_merge_inverse_on_gpu_flavour():
    """``inverse="blocks"``: the diagonal tiles' ``(I + A)⁻¹`` by block merges instead of forward
    substitution (the default, tested above) — the same forward, final state and gradients."""
    check("kda", make_inputs(0), True, 1e-4, target="gpu", tuning=(("inverse", "blocks"),))
    with pytest.raises(ValueError, match="inverse"):
        run("delta", "kernels", make_inputs(0), True, tuning=(("inverse", "neumann"),))


@pytest.mark.parametrize("transpose", [False, True])
def test_column_row_moves(transpose):
    """``col_to_row`` / ``row_to_col`` both ways (the masked sum of Mosaic TPU, the transpose of
    Triton) move every value exactly, infinities and the other entries of a NaN's vector included."""
    from kernels.delta.tiles import col_to_row, row_to_col
    x = np.random.default_rng(4).normal(size=(16, 1)).astype(np.float32) * 1e3
    x[3], x[7], x[11] = np.inf, -np.inf, np.nan
    row = np.asarray(jax.jit(lambda a: col_to_row(a, transpose))(jnp.asarray(x)))
    np.testing.assert_array_equal(row, x.T)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: row_to_col(a, transpose))(jnp.asarray(row))), x)


def test_mma_layouts_reads_the_ttgir():
    """``triton_compile_check --layouts``: the distinct matmul warp grids of a compiled kernel, from its TTGIR
    (a stand-in object here; the script compiles with the triton package, which the suite does not need)."""
    from types import SimpleNamespace

    from kernels.delta.triton_compile_check import mma_layouts
    enc = "#ttg.nvidia_mma<{{versionMajor = {}, versionMinor = 0, warpsPerCTA = [{}], instrShape = [16, 8]}}>\n"
    ttgir = "#mma = " + enc.format(2, "4, 1") + "#mma1 = " + enc.format(3, "4, 1") + "#mma2 = " + enc.format(2, "4, 1")
    assert mma_layouts(SimpleNamespace(asm={"ttgir": ttgir})) == "mma=v2[4,1],v3[4,1]"
    assert mma_layouts(SimpleNamespace(asm={"ttgir": "module {}"})) == "mma=none"


def test_kernel_exp():
    """``tiles.exp`` (every ``exp`` of the kernels, as ``exp2(x·log₂e)``) inside a Pallas kernel —
    compiled on a GPU (the hardware ``ex2``), interpreted elsewhere — against float64 ``exp``:
    relative error <= 1e-5 on [−87, 64] (the anchored tiles' largest exponent), exactly 1 at 0 and
    0 at −inf (masked entries), NaN kept."""
    from jax.experimental import pallas as pl

    from kernels.delta.tiles import exp
    x = np.concatenate([np.zeros(4), [-np.inf] * 4, [np.nan] * 4, [1e-30, -1e-30, -100.0, -200.0],
                        np.random.default_rng(5).uniform(-87.0, 64.0, 2032)]).astype(np.float32).reshape(16, 128)

    def kern(x_ref, o_ref):
        o_ref[...] = exp(x_ref[...])

    y = np.asarray(pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                  interpret=jax.default_backend() == "cpu")(jnp.asarray(x))).ravel()
    xs = x.ravel()
    np.testing.assert_array_equal(y[:4], 1.0)
    np.testing.assert_array_equal(y[4:8], 0.0)
    assert np.isnan(y[8:12]).all()
    assert (y[14:16] < 1e-40).all()  # e^−100, e^−200: flushed or denormal, never large
    ref = np.exp(xs[16:].astype(np.float64))
    assert np.max(np.abs(y[16:] - ref) / ref) <= 1e-5


@pytest.mark.parametrize("n", [32, 64])
def test_unit_lower_inverse_from_tile_inverses(n):
    """``unit_lower_inverse_t(..., tt=, block=16)``: the whole ``(I + a)⁻ᵀ`` merged from the transposed
    inverses of its 16×16 diagonal blocks (what the whole back-solve does with the tile kernel's ``KK``),
    against LAPACK's, to float32 accuracy (six bf16 MMAs a product); a = β ⊙ k kᵀ of unit keys, strictly lower."""
    from kernels.delta.tiles import unit_lower_inverse_t
    r = np.random.default_rng(11)
    k = r.normal(size=(n, 32))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    a = np.tril(r.uniform(0.05, 1.0, (n, 1)) * (k @ k.T), -1)
    tiles = np.zeros((n, n))
    for i in range(0, n, 16):
        tiles[i:i + 16, i:i + 16] = np.linalg.inv(np.eye(16) + a[i:i + 16, i:i + 16]).T
    f = jax.jit(lambda a, t: unit_lower_inverse_t(a, False, "blocks", tt=t, block=16),
                compiler_options={"xla_allow_excess_precision": False} if jax.default_backend() == "gpu" else None)
    got = f(jnp.asarray(a, jnp.float32), jnp.asarray(tiles, jnp.float32))
    assert rel_err(got, np.linalg.inv(np.eye(n) + a).T) <= 1e-6


@pytest.mark.parametrize("method", ["blocks", "loop"])
def test_unit_lower_inverse(method):
    """Both ways of the 16×16 unit lower inverse against LAPACK's, to float32 accuracy: random
    entries, an all-ones strict lower part (every power of it large, the inverse ±1) and one whose
    inverse grows to ~7e3."""
    from kernels.delta.tiles import unit_lower_inverse_t
    r = np.random.default_rng(9)
    cases = [np.tril(r.uniform(-1, 1, (16, 16)), -1), np.tril(np.ones((16, 16)), -1),
             -0.9 * np.tril(np.ones((16, 16)), -1)]
    # compiled by XLA here (not in a kernel): on GPUs keep it from folding the bf16 splits (excess precision)
    f = jax.jit(lambda a: unit_lower_inverse_t(a, False, method),
                compiler_options={"xla_allow_excess_precision": False} if jax.default_backend() == "gpu" else None)
    for a in cases:
        want = np.linalg.inv(np.eye(16) + a).T
        assert rel_err(f(jnp.asarray(a, jnp.float32)), want) <= 1e-6


def test_block_merge_inverse_with_three_bf16_products():
    """The block merges at ``BF16X3`` (what 16-bit inputs use on GPUs, whose solve runs at tf32):
    within 5e-5 of LAPACK's inverse, relative to its largest entry, on the cases above."""
    from kernels.delta.tiles import BF16X3, unit_lower_inverse_t
    r = np.random.default_rng(10)
    f = jax.jit(lambda a: unit_lower_inverse_t(a, False, "blocks", BF16X3),
                compiler_options={"xla_allow_excess_precision": False} if jax.default_backend() == "gpu" else None)
    for a in (np.tril(r.uniform(-1, 1, (16, 16)), -1), np.tril(np.ones((16, 16)), -1),
              -0.9 * np.tril(np.ones((16, 16)), -1), np.tril(r.uniform(0, 2, (16, 16)), -1)):
        want = np.linalg.inv(np.eye(16) + a).T
        assert rel_err(f(jnp.asarray(a, jnp.float32)), want) <= 5e-5


def test_default_inverse():
    """``inverse="auto"``: block merges for 16-bit DeltaNet and Gated DeltaNet on GPUs, forward
    substitution for KDA, float32 inputs and the TPU kernels; a call's resolved choice is in its spec."""
    from kernels.delta.api import _debug_spec, default_inverse
    assert default_inverse("gpu", "none", True) == default_inverse("gpu", "scalar", True) == "blocks"
    assert default_inverse("gpu", "channel", True) == default_inverse("gpu", "none", False) == "loop"
    assert default_inverse("tpu", "none", True) == "loop"
    q = jnp.zeros((1, 32, 1, 16), jnp.bfloat16)
    b = jnp.zeros((1, 32, 1), jnp.bfloat16)
    assert _debug_spec(q, q, q, None, b)[0].cfg.inverse == "blocks"
    assert _debug_spec(q, q, q, jnp.zeros((1, 32, 1, 16)), b)[0].cfg.inverse == "loop"
    assert _debug_spec(q.astype(jnp.float32), q, q, None, b)[0].cfg.inverse == "loop"


@pytest.mark.parametrize("gates", ["bound", "floor"])
def test_bounded_anchored_backward_on_gpu_flavour(gates):
    """The launch knob ``anchored_bwd`` beside its default ("scores", tested above): the exact loop
    in the backward's scores kernel gives the same gradients, gates at the bound included."""
    check("kda_bounded", make_inputs(1, gates=gates), True, 1e-4, target="gpu", tuning=(("anchored_bwd", "none"),))


@pytest.mark.parametrize("gates,dtype,mode,group", [
    ("mixed", np.float32, "fixup", 1), ("mixed", np.float32, "fused", 1), ("mixed", np.float32, "fixup", 3),
    pytest.param("unbounded", np.float32, "fixup", 1, marks=pytest.mark.slow),
    ("steep", jnp.bfloat16, "fixup", 1), ("mixed", jnp.bfloat16, "fused", 1),
    pytest.param("mixed", jnp.bfloat16, "fixup", 1, marks=pytest.mark.slow)])
def test_exact_kda_forward_in_two_passes(gates, dtype, mode, group):
    """``anchored_fwd="fixup"`` (the default): the bounded-gate intra-chunk kernel on every chunk (16-bit
    inputs: the whole-chunk one anchored at the middle row; f32: the tile one), then the exact one on the
    chunks it flags. "mixed" gates put tiles of −30 per token into two of the three chunks: the first
    pass's outputs there overflow, so the second pass must replace them; the third chunk keeps the first
    pass's. "steep": −7 per token (a few 0), past what the whole-chunk anchor spans (16 × 7 = 112 >
    ``WHOLE_SPAN``), so every chunk must be flagged. ``"fused"``: the exact kernel alone, on every chunk.
    ``fixup_chunks=3`` (``group``): one program of the second pass loops over all three chunks,
    redoing the flagged ones alone — there the −30 tiles sit in the second and third chunks."""
    x = make_inputs(1, gates="floor" if gates == "steep" else gates, dtype=dtype)
    if gates == "steep":
        x["g"] = x["g"] * 1.4
    if group > 1:
        g = x["g"].copy()
        g[:, 16:32, :, :3] = g[:, 16:32, :, 3:6]
        g[:, 64:, :, :3] = -30.0
        x["g"] = g
    tuning = (("anchored_fwd", mode),) + ((("fixup_chunks", group),) if group > 1 else ())
    check("kda", x, True, 1e-4 if dtype == np.float32 else 1e-2, target="gpu", tuning=tuning)


def test_fixup_chunks_refused_by_name():
    """``fixup_chunks`` must be a positive int dividing the chunk count, above 1 on GPUs only."""
    x = make_inputs(1)
    q, k, v, g, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta"))
    assert -(-q.shape[1] // 32) == 3  # three chunks of 32 (T = 75, padded)
    for bad, target in ((2, "gpu"), (0, "gpu"), (True, "gpu"), ("8", "gpu"), (3, "tpu")):
        with pytest.raises(ValueError, match="fixup_chunks"):
            kd.chunk_kda(q, k, v, g, beta, target=target, interpret=True, chunk_size=32, fixup_chunks=bad)


@pytest.mark.parametrize("rule,dtype", [("gdn", np.float32), pytest.param("delta", np.float32, marks=pytest.mark.slow),
                                        pytest.param("gdn", jnp.bfloat16, marks=pytest.mark.slow)])
def test_qk_arrays(rule, dtype):
    """``qk_arrays=True``: with a scalar gate or resets the state passes read ``q ⊙ E_in`` and
    ``k ⊙ E_out`` as arrays (kernels.row_factors "arrays") instead of ``q``, ``k`` and row factors."""
    x = make_inputs(6, dtype=dtype)
    check(rule, x, True, 1e-4 if dtype == np.float32 else 1e-2, tuning=(("qk_arrays", True),))
    if rule == "gdn":
        a = [jnp.asarray(x[n]) for n in ("q", "k", "v", "gs", "beta")]
        assert kn.row_factors(kd._debug_spec(*a, qk_arrays=True)[0].cfg) == "arrays"
        assert kn.row_factors(kd._debug_spec(*a)[0].cfg) == "columns"


def test_qk_arrays_auto():
    """``qk_arrays="auto"`` (the default): a differentiated call of 16-bit GDN (whole-chunk kernels) has the
    forward kernel write ``q ⊙ E_in``, ``k ⊙ E_out`` as arrays (:func:`api.default_qk_arrays`), an
    undifferentiated one the row-factor columns; both match the reference (the differentiated one with
    every gradient), and True / False apply to both."""
    assert kd.default_qk_arrays("gpu", "scalar", "whole")
    assert not any([kd.default_qk_arrays("gpu", "scalar", "halves"), kd.default_qk_arrays("gpu", "scalar", "tiles"),
                    kd.default_qk_arrays("gpu", "none", "whole"), kd.default_qk_arrays("tpu", "scalar", "tiles")])
    x = make_inputs(14, dtype=jnp.bfloat16)
    a = [jnp.asarray(x[n]) for n in ("q", "k", "v", "gs", "beta")]
    rows = lambda s: (kn.row_factors(s.cfg), kn.row_factors(kd._train_spec(s).cfg))  # noqa: E731
    assert rows(kd._debug_spec(*a)[0]) == ("columns", "arrays")
    assert rows(kd._debug_spec(*a, qk_arrays=False)[0]) == ("columns", "columns")
    assert rows(kd._debug_spec(*a, qk_arrays=True)[0]) == ("arrays", "arrays")
    assert rows(kd._debug_spec(*(t.astype(jnp.float32) for t in a))[0]) == ("columns", "columns")
    check("gdn", x, True, 1e-2)
    q, k, v, gs, beta = a
    kw = dict(initial_state=jnp.asarray(x["S0"]), segment_ids=jnp.asarray(x["seg"]))
    o1, s1 = jax.jit(lambda *t: kd.chunk_gated_delta_rule(*t, target="gpu", interpret=True, **kw))(q, k, v, gs, beta)
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    o0, s0 = kref.recurrent(f32(q), f32(k), f32(v), f32(beta), f32(gs), **kw)
    assert rel_err(o1, o0) <= 1e-2 and rel_err(s1, s0) <= 1e-2, (rel_err(o1, o0), rel_err(s1, s0))
    with pytest.raises(ValueError, match="qk_arrays"):
        kd.chunk_gated_delta_rule(q, k, v, gs, beta, target="gpu", interpret=True, qk_arrays="on")


@pytest.mark.parametrize("rule,T_,dtype", [("gdn", 75, np.float32), ("kda", 64, np.float32),
                                           pytest.param("delta", 64, np.float32, marks=pytest.mark.slow),
                                           pytest.param("kda_bounded", 75, np.float32, marks=pytest.mark.slow),
                                           pytest.param("gdn", 64, jnp.bfloat16, marks=pytest.mark.slow)])
def test_state_pairs(rule, T_, dtype):
    """``state_pairs=True``: the forward state pass takes two chunks a step (``kernels._pair_step``:
    the pair's ``W`` and ``U`` merged, ``Ũ`` of both from one matmul). T = 75: a pair and an odd last
    chunk; T = 64: one pair. The training forward (``h`` of both chunks stored for the backward) and
    every gradient, and the forward alone (output fused, nothing stored), against the reference,
    with resets mid-tile and on the chunks' edge."""
    x = {n: (a if n in ("S0", "w_s") else a[:, :T_]) for n, a in make_inputs(12, dtype=dtype).items()}
    tol = 1e-4 if dtype == np.float32 else 1e-2
    check(rule, x, True, tol, target="gpu", tuning=(("state_pairs", True),))
    check_forward_alone(rule, x, jnp.asarray(x["seg"]), tol, state_pairs=True)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="state_pairs"):
        kd.chunk_delta_rule(q, k, v, beta, target="gpu", interpret=True, state_pairs="yes")
    with pytest.raises(ValueError, match="state_pairs"):
        kd.chunk_delta_rule(q, k, v, beta, target="tpu", interpret=True, state_pairs=True)


@pytest.mark.parametrize("rule,gates,docs,C,dtype", [
    ("gdn", "uniform", True, None, np.float32), ("delta", "uniform", True, None, np.float32),
    ("gdn", "unbounded", True, None, np.float32), ("gdn", "bound", False, None, np.float32),
    pytest.param("delta", "uniform", False, None, np.float32, marks=pytest.mark.slow),
    pytest.param("gdn", "strong", True, None, np.float32, marks=pytest.mark.slow),
    pytest.param("gdn", "uniform", True, 16, np.float32, marks=pytest.mark.slow),
    pytest.param("gdn", "uniform", True, 64, np.float32, marks=pytest.mark.slow),
    ("gdn", "unbounded", True, None, jnp.bfloat16),
    pytest.param("delta", "uniform", True, None, jnp.bfloat16, marks=pytest.mark.slow),
    ("kda_bounded", "floor", True, None, jnp.bfloat16), ("kda", "mixed", True, None, jnp.bfloat16),
    pytest.param("kda_bounded", "bound", False, None, jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("kda", "unbounded", True, None, jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("kda", "uniform", False, 16, jnp.bfloat16, marks=pytest.mark.slow)])
def test_whole_chunk_kernels(rule, gates, docs, C, dtype):
    """``intra="whole"`` (the GPU default for 16-bit DeltaNet / GDN, :func:`api.default_intra`): the
    forward and both backward intra-chunk kernels on whole ``[C, C]`` / ``[C, D]`` operands (one matmul
    per product, the UT inverse by doubling of the whole chunk, its transpose stored whole in ``KK``'s
    upper triangle) — forward, final state and every gradient against the reference, f32 to 1e-4, bf16
    to 1e-2 (16-bit inputs form the decays from the chunk's prefix sums, f32 ones from per-tile sums:
    ``kernels._whole_gates``; the default takes this path for 16-bit inputs alone). Per-channel gates (KDA,
    16-bit inputs): the forward kernel anchors the whole chunk at its middle row (``kernels._whole_channel``:
    every gate at the −5 bound, "floor", spans 80 there), the backward runs the tile kernels; exact gates
    whose chunk spans too far ("mixed": −30 per token over 16 tokens; "unbounded") are flagged by the whole
    kernel and redone by the exact tile kernel (``anchored_fwd="fixup"``)."""
    x = make_inputs(13, gates=gates, dtype=dtype)
    check(rule, x, docs, 1e-4 if dtype == np.float32 else 1e-2, target="gpu", chunk_size=C,
          tuning=(("intra", "whole"),))


@pytest.mark.parametrize("rule,gates,docs,C,dtype", [
    ("gdn", "uniform", True, 64, np.float32), ("delta", "uniform", True, 64, np.float32),
    ("gdn", "unbounded", True, 64, jnp.bfloat16),
    pytest.param("delta", "uniform", False, 64, np.float32, marks=pytest.mark.slow),
    pytest.param("gdn", "unbounded", True, 64, np.float32, marks=pytest.mark.slow),
    pytest.param("gdn", "uniform", True, 32, np.float32, marks=pytest.mark.slow)])
def test_halves_forward_kernel(rule, gates, docs, C, dtype):
    """``intra="halves"``: the forward's intra-chunk kernel solves each half of the chunk whole and merges
    them (``kernels.intra_fwd_halves``: the cross blocks of ``A``, the scores and the inverse, the row
    factors across halves; documents counted from each half's start) — forward, final state and every
    gradient (the backward's whole-chunk kernels read its ``KK``) against the reference."""
    x = make_inputs(13, gates=gates, dtype=dtype)
    check(rule, x, docs, 1e-4 if dtype == np.float32 else 1e-2, target="gpu", chunk_size=C,
          tuning=(("intra", "halves"),))


def test_whole_chunk_kernels_are_picked_and_refused_by_name():
    """``intra="auto"`` picks the whole-chunk kernels on GPUs for 16-bit inputs only (``"halves"`` for DeltaNet /
    GDN chunks above 32 tokens; per-channel gates up to 32 tokens, where their bound keeps the anchor's span
    within ``WHOLE_SPAN``, exact ones only with ``anchored_fwd="fixup"``); a bad value, f32, too-low bounds
    or exact gates with ``anchored_fwd="fused"`` for per-channel whole chunks, per-channel halves, the TPU
    flavour and halves of fewer than 16 rows are refused naming ``intra``."""
    assert kd.default_intra("gpu", "scalar", True) == kd.default_intra("gpu", "none", True) == "whole"
    assert kd.default_intra("gpu", "scalar", False) == kd.default_intra("gpu", "channel", False) == "tiles"
    # per-channel gates: the forward kernel anchored at the chunk's middle row, while the bound keeps its span
    assert kd.default_intra("gpu", "channel", True) == kd.default_intra("gpu", "channel", True, 32, -5.0) == "whole"
    assert kd.default_intra("gpu", "channel", True, 32, -6.0) == "tiles"
    assert kd.default_intra("gpu", "channel", True, 16, -8.0) == "whole"
    # exact gates anchor the whole chunk only where a second pass redoes the chunks that span too far
    assert kd.default_intra("gpu", "channel", True, 32, None, "fused") == "tiles"
    assert kd.default_intra("gpu", "channel", True, 32, -5.0, "fused") == "whole"
    assert kd.default_intra("tpu", "none", True) == "tiles"
    assert kd.default_intra("gpu", "none", True, 64) == kd.default_intra("gpu", "scalar", True, 64) == "halves"
    assert kd.default_intra("gpu", "channel", True, 64) == kd.default_intra("gpu", "none", False, 64) == "tiles"
    a = [jnp.zeros((1, 64, 2, 16), jnp.bfloat16)] * 3 + [-jnp.ones((1, 64, 2)), jnp.ones((1, 64, 2), jnp.bfloat16)]
    assert kd._debug_spec(*a)[0].cfg.intra == "whole"
    assert kd._debug_spec(*(x.astype(jnp.float32) for x in a))[0].cfg.intra == "tiles"
    assert kd._debug_spec(*a, intra="tiles")[0].cfg.intra == "tiles"
    assert kd._debug_spec(*a, chunk_size=64)[0].cfg.intra == "halves"
    q, k, v, g, beta = a
    with pytest.raises(ValueError, match="intra"):
        kd.chunk_gated_delta_rule(q, k, v, g, beta, target="gpu", interpret=True, intra="rows")
    gk = jnp.broadcast_to(g[..., None], q.shape)
    assert kd._debug_spec(q, k, v, gk, beta, gate="channel")[0].cfg.intra == "whole"
    assert kd._debug_spec(q, k, v, gk, beta, gate="channel", gate_lower_bound=-6.0)[0].cfg.intra == "tiles"
    with pytest.raises(ValueError, match="intra.*16-bit"):
        kd.chunk_kda(*(x.astype(jnp.float32) for x in (q, k, v)), gk, beta, target="gpu", interpret=True,
                     intra="whole")
    assert kd._debug_spec(q, k, v, gk, beta, gate="channel", anchored_fwd="fused")[0].cfg.intra == "tiles"
    with pytest.raises(ValueError, match="intra.*anchored_fwd"):
        kd.chunk_kda(q, k, v, gk, beta, target="gpu", interpret=True, intra="whole", anchored_fwd="fused")
    with pytest.raises(ValueError, match="intra.*gate_lower_bound"):  # chunks of 32 anchored at row 16: -5 at most
        kd.chunk_kda(q, k, v, gk, beta, gate_lower_bound=-6.0, target="gpu", interpret=True, intra="whole")
    with pytest.raises(ValueError, match="intra"):
        kd.chunk_delta_rule(q, k, v, beta, target="tpu", interpret=True, intra="whole")
    with pytest.raises(ValueError, match="intra"):
        kd.chunk_delta_rule(q, k, v, beta, target="tpu", interpret=True, intra="halves")
    with pytest.raises(ValueError, match="intra"):
        kd.chunk_kda(q, k, v, jnp.broadcast_to(g[..., None], q.shape), beta, target="gpu", interpret=True,
                     intra="halves")
    with pytest.raises(ValueError, match="intra.*chunk_size"):
        kd.chunk_delta_rule(q, k, v, beta, target="gpu", interpret=True, intra="halves", chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size.*GPU"):  # beyond GPU_MAX_CHUNK
        kd.chunk_delta_rule(q, k, v, beta, target="gpu", interpret=True, chunk_size=2 * kd.GPU_MAX_CHUNK)


@pytest.mark.parametrize("bv,stages", [(16, 1), (32, None)])
def test_value_blocks_narrower_than_the_value_dim(bv, stages):
    """The sequential state passes split V into ``bv``-wide blocks, one program each (GPU default:
    :func:`kernels.delta.api.default_bv`): with V = 64 the blocks' forward, final state and every
    gradient equal the reference — with the loads software-pipelined (the default stages) or not
    (one stage; a launch option, so compiled GPU runs test both)."""
    r = np.random.default_rng(7)
    Bs, Ts, Hs, Ks, Vs = 1, 40, 2, 16, 64
    kk = r.normal(size=(Bs, Ts, Hs, Ks))
    q, k = r.normal(size=(Bs, Ts, Hs, Ks)), kk / np.linalg.norm(kk, axis=-1, keepdims=True)
    v, g = r.normal(size=(Bs, Ts, Hs, Vs)), -r.uniform(0, 1, (Bs, Ts, Hs, Ks))
    beta, S0 = r.uniform(0.05, 1.0, (Bs, Ts, Hs)), 0.5 * r.normal(size=(Bs, Hs, Ks, Vs))
    w_o, w_s = r.normal(size=(Bs, Ts, Hs, Vs)), r.normal(size=(Bs, Hs, Ks, Vs))
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, S0)]

    def loss(fn):
        def f(q, k, v, g, beta, S0):
            o, S = fn(q, k, v, g, beta, S0)
            return jnp.sum(o * w_o) + jnp.sum(S * w_s), (o, S)
        return jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))

    kern = lambda q, k, v, g, beta, S0: kd.chunk_kda(q, k, v, g, beta, initial_state=S0, target="gpu",
                                                     interpret=_interpret("gpu"), bv=bv, num_stages_state=stages)
    ref = lambda q, k, v, g, beta, S0: kref.recurrent(q, k, v, beta, g, initial_state=S0)
    (_, out1), g1 = loss(kern)(*args)
    (_, out0), g0 = loss(ref)(*args)
    for a, b in zip((*out1, *g1), (*out0, *g0)):
        assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("rule,dtype,split", [("delta", "float32", 1), ("kda", "float32", 1), ("gdn", "bfloat16", 1),
                                              ("kda", "bfloat16", 3)])
def test_mosaic_backward_state_pass_in_the_vjp(rule, dtype, split):
    """``state_bwd="mosaic"``: the backward state pass on the Mosaic GPU lowering inside the
    ``custom_vjp`` (compiled on a GPU, its interpreter elsewhere) — the forward, final state and every
    gradient equal the reference's, with resets, an initial state and T not a multiple of the chunk;
    also on a split sequence (``state_split``: its second backward pass on Mosaic GPU).
    K = V = 64: the widths its wgmma tiles take."""
    r = np.random.default_rng(8)
    Bs, Ts, Hs, D = 1, 70, 2, 64
    kk = r.normal(size=(Bs, Ts, Hs, D))
    q, k = r.normal(size=(Bs, Ts, Hs, D)), kk / np.linalg.norm(kk, axis=-1, keepdims=True)
    v, beta = r.normal(size=(Bs, Ts, Hs, D)), r.uniform(0.05, 1.0, (Bs, Ts, Hs))
    g = -r.uniform(0, 1, (Bs, Ts, Hs, D)) if rule == "kda" else -r.uniform(0, 1, (Bs, Ts, Hs))
    S0, w_o, w_s = 0.5 * r.normal(size=(Bs, Hs, D, D)), r.normal(size=(Bs, Ts, Hs, D)), r.normal(size=(Bs, Hs, D, D))
    seg = jnp.asarray((np.arange(Ts) >= 23) + (np.arange(Ts) >= 64), jnp.int32)[None]
    dt = jnp.dtype(dtype)
    args = [jnp.asarray(a, dt) for a in (q, k, v)] + [jnp.asarray(a, jnp.float32) for a in (g, beta, S0)]
    gate = {"delta": None, "gdn": "scalar", "kda": "channel"}[rule]

    def loss(fn):
        def f(q, k, v, g, beta, S0):
            o, S = fn(q, k, v, None if gate is None else g, beta, S0)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(S * w_s), (o, S)
        return jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))

    kern = lambda q, k, v, g, beta, S0: kd._delta(  # noqa: E731
        q, k, v, g, beta, gate=gate, scale=None, initial_state=S0, segment_ids=seg, chunk_size=None,
        target="gpu", interpret=_interpret("gpu"), state_bwd="mosaic", state_split=split)
    ref = lambda q, k, v, g, beta, S0: kref.recurrent(q, k, v, beta, g, initial_state=S0,  # noqa: E731
                                                      segment_ids=seg)
    (_, out1), g1 = loss(kern)(*args)
    (_, out0), g0 = loss(ref)(*[a.astype(jnp.float32) for a in args])
    tol = 1e-4 if dtype == "float32" else 1e-2
    for name, a, b in zip(("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"), (*out1, *g1), (*out0, *g0)):
        if name == "dg" and gate is None:
            continue
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))


def test_default_state_bwd_lowering():
    """``default_state_bwd``: Mosaic GPU for compiled 16-bit runs on a Hopper GPU with at least
    ``MOSAIC_BWD_PROGRAMS`` programs of 64 value columns and widths its tiles take, Triton otherwise
    (here, on a machine without one, always Triton); an explicit choice is validated by name."""
    from kernels.delta import api
    bf16, n = jnp.bfloat16, api.MOSAIC_BWD_PROGRAMS
    assert api.default_state_bwd(128, 32, 128, 128, bf16, False) == "mosaic"      # (8, 2048) x 16 heads
    assert api.default_state_bwd(32, 32, 128, 128, bf16, False) == "triton"       # (2, 8192): 64 programs
    assert api.default_state_bwd(64, 32, 128, 128, bf16, False) == "triton"       # (4, 4096): 128 programs
    assert api.default_state_bwd(n, 32, 128, 64, bf16, False) == "mosaic"
    assert api.default_state_bwd(n - 1, 32, 128, 64, bf16, False) == "triton"
    assert api.default_state_bwd(128, 32, 128, 128, jnp.float32, False) == "triton"
    assert api.default_state_bwd(128, 32, 128, 128, bf16, True) == "triton"       # interpreted
    assert api.default_state_bwd(128, 32, 32, 128, bf16, False) == "triton"       # K = 32
    assert api.default_state_bwd(128, 32, 128, 128, bf16, False, hopper=False) == "triton"  # no wgmma / TMA
    if not api._on_hopper():
        big = jnp.zeros((2, 64, 64, 128), bf16)
        s, _ = api._debug_spec(big, big, big, None, big[..., 0])
        assert s.state_bwd == "triton"
    z = jnp.zeros((1, 64, 2, 32), bf16)
    with pytest.raises(ValueError, match="state_bwd"):
        kd.chunk_delta_rule(z, z, z, z[..., 0], state_bwd="wgmma")
    with pytest.raises(ValueError, match="state_bwd='mosaic'.*K=32"):
        kd.chunk_delta_rule(z, z, z, z[..., 0], target="gpu", state_bwd="mosaic")
    with pytest.raises(ValueError, match="GPU lowering"):
        kd.chunk_delta_rule(z, z, z, z[..., 0], target="tpu", state_bwd="mosaic")


def test_default_value_blocks_fill_the_gpu():
    """``default_bv``: 32-wide value blocks while B·H·V/32 programs reach ``STATE_PROGRAMS``, else
    16-wide (one long sequence); never wider than V, never below 16."""
    from kernels.delta import api
    n = api.STATE_PROGRAMS
    assert api.default_bv(n // 4, 128) == 32            # (2, 8192) x 16 heads: 128 programs of 32
    assert api.default_bv(n // 4 - 1, 128) == 16
    assert api.default_bv(16, 128) == 16                # (1, 32768) x 16 heads: 128 programs of 16
    assert api.default_bv(1, 16) == 16 and api.default_bv(1024, 16) == 16
    assert api.default_bv(1024, 128) == 32
    s, _ = api._debug_spec(*(jnp.zeros((1, 64, 16, 128), jnp.bfloat16),) * 3, None,
                           jnp.zeros((1, 64, 16), jnp.bfloat16))
    assert (s.bv, s.num_stages_state) == (16, api.STATE_STAGES)


@pytest.mark.parametrize("rule,warps,fwd", [("kda", 8, 4), ("kda_bounded", 8, 4), ("delta", 4, 2), ("gdn", 4, 2)])
def test_intra_kernel_warps_follow_the_gate(rule, warps, fwd):
    """GPU launches: the backward's scores kernel runs ``default_warps_scores`` warps (8 for
    per-channel gates and f32 inputs, whose tiles spill at 4), the forward's intra-chunk kernel
    ``default_warps_fwd`` (2 for 16-bit inputs without per-channel gates), the state passes
    ``default_warps_state`` (8 for f32 inputs), every other kernel ``num_warps``; explicit
    ``num_warps_scores`` / ``num_warps_fwd`` override the defaults. Traced only (no compile)."""
    x = make_inputs(2)
    q32, k32, v32, g, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta"))

    def launches(dtype=jnp.bfloat16, **tuning):
        q, k, v = (a.astype(dtype) for a in (q32, k32, v32))

        def f(q, k, v, g, beta):
            if rule.startswith("kda"):
                bound = {"gate_lower_bound": -5.0} if rule == "kda_bounded" else {}
                o, _ = kd.chunk_kda(q, k, v, jnp.maximum(g, -5.0), beta, target="gpu", interpret=False,
                                   **bound, **tuning)
            elif rule == "gdn":
                o, _ = kd.chunk_gated_delta_rule(q, k, v, g[..., 0], beta, target="gpu", interpret=False, **tuning)
            else:
                o, _ = kd.chunk_delta_rule(q, k, v, beta, target="gpu", interpret=False, **tuning)
            return jnp.sum(o)
        jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta).jaxpr
        return {name: p.num_warps for name, p in pallas_launches(jaxpr)}

    got = launches()
    scores = [n for n in got if "intra_bwd_scores" in n]
    intra = [n for n in got if "intra_fwd" in n]
    solve = [n for n in got if "intra_bwd_solve" in n]
    assert len(scores) == 1 and got[scores[0]] == warps
    # exact per-channel gates: two forward passes (anchored_fwd="fixup"), at the same warps
    assert len(intra) == (2 if rule == "kda" else 1) and all(got[n] == fwd for n in intra)
    assert len(solve) == 1 and got[solve[0]] == 2
    # the whole back-solve for every rule and dtype (KDA and f32 inputs merge the tile inverses KK carries)
    assert "solve_whole" in solve[0]
    assert all(w == 4 for n, w in got.items() if n not in scores + intra + solve)
    assert launches(num_warps_scores=2)[scores[0]] == 2
    assert all(launches(num_warps_fwd=8)[n] == 8 for n in intra)
    assert launches(num_warps_solve=4)[solve[0]] == 4
    f32 = launches(jnp.float32)  # f32 tiles spill at 4 already
    f32_intra = [n for n in f32 if "intra_fwd" in n or "intra_bwd_solve" in n]
    assert len(f32_intra) == len(intra) + 1 and all(f32[n] == 4 for n in f32_intra)
    assert [n for n in f32 if "intra_bwd_solve" in n] == [solve[0]]  # f32: the same whole back-solve
    f32_scores = [n for n in f32 if "intra_bwd_scores" in n]  # f32: 8 warps for every rule (4 spill)
    assert len(f32_scores) == 1 and f32[f32_scores[0]] == 8
    assert launches(jnp.float32, num_warps_scores=4)[f32_scores[0]] == 4
    f32_state = [n for n in f32 if n.startswith("state_")]  # f32 state passes: 8 warps too (default_warps_state)
    assert len(f32_state) == 2 and all(f32[n] == 8 for n in f32_state)
    assert all(got[n] == 4 for n in got if n.startswith("state_"))
    with pytest.raises(ValueError, match="num_warps_scores"):
        launches(num_warps_scores=3)
    with pytest.raises(ValueError, match="num_warps_fwd"):
        launches(num_warps_fwd=0)
    with pytest.raises(ValueError, match="num_warps_solve"):
        launches(num_warps_solve=5)


@pytest.mark.parametrize("fuse,split", [(True, 1), (False, 1), (True, 3)])
@pytest.mark.parametrize("policy", ["names", "nothing"])
def test_remat_runs_each_kernel_once_when_the_residuals_are_saved(policy, fuse, split):
    """Under ``jax.checkpoint`` with the kernels' named residuals saved, the backward pass reruns
    no forward kernel (2 forward launches with the output fused into the state pass, 3 without, and
    the second intra-chunk pass of exact gates, ``anchored_fwd="fixup"``; 3 backward; a split sequence adds a first state pass to each direction, and its segments' maps are
    a named residual); saving nothing reruns the forward ones (JAX keeps a bare ``pallas_call`` even
    when its outputs are unused: the launches are wrapped so that an unused recomputation is dropped)."""
    x = make_inputs(0)
    q, k, v, g, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta"))
    pol = {"names": jax.checkpoint_policies.save_only_these_names(kd.RESIDUALS),
           "nothing": jax.checkpoint_policies.nothing_saveable}[policy]

    def f(q):
        o, _ = kd.chunk_kda(q, k, v, g, beta, target="gpu", interpret=True, fuse_output=fuse, state_split=split)
        return jnp.sum(jnp.sin(o))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(jax.checkpoint(f, policy=pol)))(q).jaxpr
    fwd, bwd = (2 if fuse else 3) + (split > 1) + 1, 3 + (split > 1)  # + 1: the exact gates' fixup pass
    assert live_pallas_calls(jaxpr) == {"names": fwd + bwd, "nothing": 2 * fwd + bwd}[policy]


def test_anchored_bwd_rejects_unknown_value():
    x = make_inputs(1, gates="bound")
    with pytest.raises(ValueError, match="anchored_bwd"):
        kd.chunk_kda(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")), gate_lower_bound=BOUND,
                     anchored_bwd="all")
    with pytest.raises(ValueError, match="anchored_fwd"):
        kd.chunk_kda(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")), anchored_fwd="anchored")
    with pytest.raises(ValueError, match="qk_arrays"):
        kd.chunk_kda(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")), qk_arrays="yes")


@pytest.mark.parametrize("rule", ["gdn", "kda_bounded"])
def test_tpu_flavour_new_gate_paths(rule):
    check(rule, make_inputs(3, gates="bound"), True, 1e-4, target="tpu")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("rule", ["kda", "delta", "gdn", "kda_bounded"])
def test_kernels_lower(platform, rule):
    """The forward and backward kernels lower to Triton / Mosaic (what the CPU can check)."""
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    shapes = [sd((1, 200, 2, 128), bf), sd((1, 200, 2, 128), bf), sd((1, 200, 2, 128), bf),
              sd((1, 200, 2, 128), jnp.float32), sd((1, 200, 2), bf), sd((1, 2, 128, 128), jnp.float32),
              sd((1, 200), jnp.int32)]
    target = "gpu" if platform == "cuda" else "tpu"

    def f(q, k, v, g, beta, S0, seg):
        def loss(q, k, v, g, beta, S0):
            kw = dict(initial_state=S0, segment_ids=seg, target=target, interpret=False)
            if rule == "kda":
                o, S = kd.chunk_kda(q, k, v, g, beta, **kw)
            elif rule == "kda_bounded":
                o, S = kd.chunk_kda(q, k, v, g, beta, gate_lower_bound=BOUND, **kw)
            elif rule == "gdn":
                o, S = kd.chunk_gated_delta_rule(q, k, v, g[..., 0], beta, **kw)
            else:
                o, S = kd.chunk_delta_rule(q, k, v, beta, **kw)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))(q, k, v, g, beta, S0)

    exp = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes)
    text = exp.mlir_module()
    assert ("triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)


# ----------------------------------------------------------------------------- argument checks
def test_chunk_size_errors():
    x = make_inputs(6)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match="chunk_size"):
        kd.chunk_delta_rule(q, k, v, beta, chunk_size=48)


def test_gate_lower_bound_errors():
    x = make_inputs(7, gates="unbounded")
    q, k, v, g, gs, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "gs", "beta"))
    with pytest.raises(ValueError, match="gates reach"):  # concrete gates below the bound
        kd.chunk_kda(q, k, v, g, beta, gate_lower_bound=BOUND)
    with pytest.raises(ValueError, match="gate_lower_bound"):  # outside [-10, 0)
        kd.chunk_kda(q, k, v, jnp.maximum(g, -5.0), beta, gate_lower_bound=-20.0)
    with pytest.raises(ValueError, match="per-channel"):  # scalar gates need no bound
        kd.chunk_gated_delta_rule(q, k, v, gs, beta, gate_lower_bound=BOUND)


@pytest.mark.parametrize("rule", RULES)
def test_tpu_interpret_mode(rule, monkeypatch):
    """The kernels as a TPU compiles them — not interpreted by Pallas (``interpret=False``: the 16-step tile
    loops unrolled in Python, ``Cfg.unroll``) — run by JAX's TPU interpret mode, which emulates Mosaic's
    grid, memory spaces and pipelining on the CPU. Forward and every gradient against the reference."""
    from jax.experimental.pallas import tpu as pltpu

    here = sys.modules[__name__]
    monkeypatch.setattr(here, "_interpret", lambda target: False)
    monkeypatch.setattr(here, "value_and_grads", value_and_grads.__wrapped__)  # not the cached interpreted ones
    made, real = [], kd.Cfg
    monkeypatch.setattr(kd, "Cfg", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    with pltpu.force_tpu_interpret_mode():
        check(rule, make_inputs(12, gates="bound" if rule == "kda_bounded" else "uniform"), True, 1e-4, target="tpu")
    assert made and all(c.unroll for c in made)


def test_tpu_value_blocks_take_whole_lanes():
    """Mosaic's blocks are whole 128-lane rows: a narrower ``bv`` is refused by name on a TPU (interpret mode
    would run it and a TPU would not lower it)."""
    x = make_inputs(13)
    q, k, v, beta = (jnp.asarray(x[n]) for n in ("q", "k", "v", "beta"))
    for bv in (16, 64):
        with pytest.raises(ValueError, match=r"`bv`.*>= 128 on TPUs"):
            kd.chunk_delta_rule(q, k, v, beta, target="tpu", interpret=True, bv=bv)
    o, _ = kd.chunk_delta_rule(q, k, v, beta, target="tpu", interpret=True, bv=128)
    assert o.shape == v.shape
