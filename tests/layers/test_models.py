"""The Decoder: every tiny config trains, prefills and decodes consistently; scan == unrolled."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers import attnres as AR
from lineage_jax.models import Decoder, config_names, get_config, inference_steps, layer_groups
from tests._jaxpr import pallas_launches
from tests._numerics import tolerance

TINY = [n for n in config_names() if n.startswith("tiny_")]

# One token shape, prefill split and cache length for every test that runs a whole tiny model
# through forward / prefill / decode: the jitted calls below then compile once per model per
# worker, and the tiny_k3 tests (the slowest to compile) share one xdist worker.
BATCH, LENGTH, SPLIT, MAX_LEN = 2, 10, 6, 12
K3_GROUP = pytest.mark.xdist_group("tiny_k3")


def _named(names):
    """Parametrize values for config names; tiny_k3 joins the shared-compilation group."""
    return [pytest.param(n, marks=K3_GROUP) if n == "tiny_k3" else n for n in names]


def _tokens(cfg, seed):
    return jax.random.randint(jax.random.key(seed), (BATCH, LENGTH), 0, cfg.vocab_size)

call = nnx.jit(lambda m, t: m(t))
prefill = nnx.jit(lambda m, t, c: m.prefill(t, c))
decode = nnx.jit(lambda m, t, c: m.decode(t, c))
forward = nnx.jit(lambda m, t: m.forward(t))  # logits and the auxiliary outputs (MoE statistics)


def _runs_kernels(cfg) -> bool:
    """Prefill / forward run the compiled delta-rule kernels here (decode runs the XLA step)."""
    return jax.default_backend() != "cpu" and cfg.memory_backend != "xla" and any(c in cfg.pattern for c in "DGK")


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def check_decode_after_prefill(model, tokens, split: int, max_len: int, tol: float, logits=None):
    """Prefill ``tokens[:, :split]`` into a fresh cache, decode the rest one token at a time: every
    step's logits equal the full forward's (relative error <= ``tol``)."""
    logits = call(model, tokens) if logits is None else logits
    cache = model.init_cache(tokens.shape[0], max_len)
    lp, cache = prefill(model, tokens[:, :split], cache)
    assert rel(lp, logits[:, :split]) <= tol
    for t in range(split, tokens.shape[1]):
        lt, cache = decode(model, tokens[:, t], cache)
        assert rel(lt, logits[:, t]) <= tol, t
    return cache


# tiny_kimi_linear (-m slow): its parts decode here in tiny_k3 (KDA + MLA hybrid, a dense first layer,
# MoE with shared experts, AttnRes) and tiny_kda (the softplus gate and low-rank output gate), and the
# Kimi Linear architecture decodes through its caches in tests/test_hf.py (against transformers).
DECODE_DEFAULT = [n for n in TINY if n != "tiny_kimi_linear"]
# float32 prefill/decode vs full-forward tolerance. tiny_k3 (MLA + bounded KDA + latent MoE + AttnRes)
# sits higher: over model seeds 0-2 x token seeds 1-2 its errors reach 1.6e-5 at XLA:CPU's default
# optimisation and 3.1e-5 at the suite's level 0 — rounding, orders of magnitude below a cache bug.
DECODE_TOL = {"tiny_k3": 1e-4}


@pytest.mark.parametrize("name", _named(DECODE_DEFAULT) + [pytest.param("tiny_kimi_linear", marks=pytest.mark.slow)])
def test_decode_after_prefill_equals_full_forward(name):
    cfg = get_config(name)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(cfg, 1)
    logits = call(model, tokens)
    assert logits.shape == (BATCH, LENGTH, cfg.vocab_size) and np.all(np.isfinite(logits))
    tol = tolerance(DECODE_TOL.get(name, 1e-5), kernels=_runs_kernels(cfg))
    cache = check_decode_after_prefill(model, tokens, SPLIT, MAX_LEN, tol, logits)
    assert np.all(np.asarray(cache.length) == LENGTH)


# tiny_k3 (-m slow): inference_steps is model-agnostic (split once, jit prefill and decode); tiny_k3's
# prefill + decode == forward is test_decode_after_prefill_equals_full_forward[tiny_k3]
@pytest.mark.parametrize("name", ["tiny_gpt2", pytest.param("tiny_k3", marks=[K3_GROUP, pytest.mark.slow])])
def test_inference_steps_equal_the_module_and_donate_the_cache(name):
    """The split-once jitted steps (generate, the decode timers) compute what the module does,
    and donate the cache (its buffers are aliased to the returned cache)."""
    cfg = get_config(name)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(cfg, 2)
    logits = call(model, tokens)
    state, pre, dec = inference_steps(model)
    cache = model.init_cache(BATCH, MAX_LEN)
    assert "tf.aliasing_output" in dec.lower(state, tokens[:, 0], cache).as_text()
    lp, cache = pre(state, tokens[:, :SPLIT], cache)
    tol = tolerance(1e-5, kernels=_runs_kernels(cfg))
    assert rel(lp, logits[:, :SPLIT]) <= tol
    for t in range(SPLIT, LENGTH):
        lt, cache = dec(state, tokens[:, t], cache)
        assert rel(lt, logits[:, t]) <= tol, (name, t)


@K3_GROUP
def test_tiny_k3_scans_macrocycles_and_matches_unrolled():
    cfg = get_config("tiny_k3")
    groups = layer_groups(cfg)
    assert any(n >= 2 for _, _, n in groups), groups  # a real lax.scan group
    assert sum(p * n for _, p, n in groups) == cfg.num_layers
    scanned = Decoder(cfg, rngs=nnx.Rngs(0))
    unrolled = Decoder(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))
    assert all(n == 1 for _, _, n in layer_groups(unrolled.cfg))
    # Copy the scanned model's weights into the unrolled one, layer by layer.
    for (first, p, n), group in zip(scanned.groups_spec, scanned.groups):
        state = nnx.state(group)
        for r in range(n):
            for j in range(p):
                layer = first + r * p + j
                target = unrolled.groups[layer].blocks[0]
                src = jax.tree.map(lambda a: a[r] if n > 1 else a, state)
                nnx.update(target, src["blocks"][j])
    for name in ("embed", "head"):
        getattr(unrolled, name)[...] = getattr(scanned, name)[...]
    tokens = _tokens(cfg, 2)
    assert rel(call(unrolled, tokens), call(scanned, tokens)) <= 1e-5


# K3 (-m slow): unstacked groups, a 4-layer period, MoE, AttnRes; its scanned == unrolled forward is
# test_tiny_k3_scans_macrocycles_and_matches_unrolled
@pytest.mark.parametrize("name", ["tiny_gpt2", pytest.param("tiny_k3", marks=[K3_GROUP, pytest.mark.slow])])
def test_unscanned_is_the_same_model_layer_by_layer(name):
    """``Decoder.unscanned()``: every layer its own group, its parameters the scanned group's
    slices (checked against a layer-by-layer copy), the same logits in forward, prefill and
    decode, per-layer caches holding what the stacked caches hold; copies, not views."""
    cfg = get_config(name)
    scanned = Decoder(cfg, rngs=nnx.Rngs(0))
    assert any(n >= 2 for _, _, n in scanned.groups_spec)
    flat = scanned.unscanned()
    # Copies, not views: no buffer of one model is a buffer of the other (a donated state of one
    # must leave the other intact). Checked first: an nnx.jit call writes fresh buffers back.
    def pointers(m):
        return {a.unsafe_buffer_pointer() for a in jax.tree.leaves(nnx.to_pure_dict(nnx.state(m)))}
    assert not pointers(flat) & pointers(scanned)
    assert flat.cfg == cfg.replace(scan_layers=False)
    assert [g for g in flat.groups_spec] == [(i, 1, 1) for i in range(cfg.num_layers)]
    for (first, p, n), group in zip(scanned.groups_spec, scanned.groups):
        for r in range(n):
            for j in range(p):
                want = jax.tree.map(lambda a: a[r] if n > 1 else a, nnx.to_pure_dict(nnx.state(group))["blocks"][j])
                got = nnx.to_pure_dict(nnx.state(flat.groups[first + r * p + j]))["blocks"][0]
                jax.tree.map(np.testing.assert_array_equal, got, want)
                axes = [v.get_metadata().get("logical_axes") for _, v in nnx.iter_graph(flat.groups[first + r * p + j])
                        if isinstance(v, nnx.Variable)]
                assert all(a is None or "layers" not in a for a in axes)  # no stacked axis left
    tokens = _tokens(cfg, 3)
    tol = tolerance(1e-5, kernels=_runs_kernels(cfg))  # two compilations of the same math
    assert rel(call(flat, tokens), call(scanned, tokens)) <= tol
    caches = [m.init_cache(BATCH, MAX_LEN) for m in (scanned, flat)]
    for m_i, m in enumerate((scanned, flat)):
        _, caches[m_i] = prefill(m, tokens[:, :SPLIT], caches[m_i])
    for t in range(SPLIT, LENGTH):
        ls, caches[0] = decode(scanned, tokens[:, t], caches[0])
        lf, caches[1] = decode(flat, tokens[:, t], caches[1])
        assert rel(lf, ls) <= tol, (name, t)
    # The stacked caches, sliced per layer, are the per-layer caches.
    stacked, per_layer = caches[0].layers, caches[1].layers
    for g, (first, p, n) in enumerate(scanned.groups_spec):
        for r in range(n):
            for j in range(p):
                want = jax.tree.map(lambda a: a[r] if n > 1 else a, stacked[g][j])
                jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol, atol=tol / 10),
                             per_layer[first + r * p + j][0], want)


@K3_GROUP
def test_stacked_layers_are_independently_initialised():
    model = Decoder(get_config("tiny_k3"), rngs=nnx.Rngs(0))
    group = next(g for (_, _, n), g in zip(model.groups_spec, model.groups) if n > 1)
    w = group.blocks[0].mixer.q.kernel[...]
    assert w.shape[0] >= 2 and not np.allclose(w[0], w[1])


# (True is the legacy spelling of "full": test_remat_policy_names checks the mapping; -m slow runs it here too)
REMAT_CFG = dict(pattern="KM", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@functools.lru_cache(maxsize=None)
def _remat_grads(policy):
    """The remat test's loss and gradients under ``policy`` (cached: every policy is compared with
    the same no-remat values, computed once per worker)."""
    cfg = get_config("tiny_kda").replace(remat=policy, **REMAT_CFG)
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, cfg.vocab_size)
    return nnx.jit(nnx.value_and_grad(lambda m: jnp.mean(m(tokens) ** 2)))(Decoder(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.xdist_group("remat")  # one worker: the no-remat gradients are computed once
@pytest.mark.parametrize("policy", ["dots", "full", pytest.param(True, marks=pytest.mark.slow)])
def test_remat_gives_same_loss_and_grads(policy):
    """Every remat policy (and the legacy ``remat=True``) computes the same gradients as none."""
    (l1, g1), (l2, g2) = _remat_grads("none"), _remat_grads(policy)
    assert rel(l2, l1) <= 1e-6
    assert jax.tree.structure(g1) == jax.tree.structure(g2)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2)):
        assert rel(b, a) <= 1e-5, jax.tree_util.keystr(path)


def test_scan_unroll_is_the_same_model_without_the_layer_loop():
    """``scan_unroll=True``: the scanned group's parameters stay stacked (the same state), the
    layers run without a loop, and the loss and every gradient equal the looped scan's."""
    cfg = get_config("tiny_gpt2").replace(remat="dots")
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, cfg.vocab_size)
    loss = lambda m: jnp.mean(m(tokens) ** 2)  # noqa: E731
    looped, unrolled = (Decoder(cfg.replace(scan_unroll=u), rngs=nnx.Rngs(0)) for u in (False, True))
    assert jax.tree.structure(nnx.state(looped)) == jax.tree.structure(nnx.state(unrolled))

    def layer_loop(m):  # the step's outermost scans, (length, unroll): the layer loop (a layer's own loops, an
        graphdef, state = nnx.split(m)  # attention impl's on some backends, sit inside it)
        jaxpr = jax.make_jaxpr(lambda st: loss(nnx.merge(graphdef, st)))(state).jaxpr
        return [(e.params["length"], e.params["unroll"]) for e in jaxpr.eqns if e.primitive.name == "scan"]

    n = len(cfg.pattern)
    assert layer_loop(looped) == [(n, 1)]
    assert layer_loop(unrolled) == [(n, n)]                      # every step of the layer loop unrolled
    (l1, g1), (l2, g2) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (looped, unrolled))
    assert rel(l1, l2) <= 1e-6
    # each gradient to 1e-5 of its own size, or of 1e-3 of the largest one: the key projection's bias has a
    # gradient of exactly 0 (softmax is invariant to it), rounding noise of ~1e-13 that differs by backend
    top = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(g2))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2)):
        err = float(jnp.max(jnp.abs(a - b)))
        assert err <= 1e-5 * max(float(jnp.max(jnp.abs(b))), 1e-3 * top), (jax.tree_util.keystr(path), err)


def test_remat_policy_names():
    assert get_config("tiny_kda", remat=True).remat == "full"
    assert get_config("tiny_kda", remat=False).remat == "none"
    with pytest.raises(ValueError, match="ModelConfig.remat"):
        get_config("tiny_kda", remat="sometimes")


def test_attention_impl_reaches_every_softmax_and_mla_layer():
    cfg = get_config("tiny_kda").replace(pattern="SMSM", attention_impl="xla", kv_lora_rank=32,
                                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    impls = [b.mixer.attention_impl for g in model.groups for b in g.blocks]
    assert impls and set(impls) == {"xla"}
    with pytest.raises(ValueError, match="ModelConfig.attention_impl"):
        cfg.replace(attention_impl="flash")


def test_fused_attention_impls_give_the_same_model():
    """A softmax + MLA model: impl 'xla' (blockwise) and 'pallas' (interpret mode here) give the
    same loss (the mean square of the logits) and gradients."""
    cfg = get_config("tiny_kda").replace(pattern="SM", positions="rope", kv_lora_rank=32,
                                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    tokens = jax.random.randint(jax.random.key(5), (2, 21), 0, cfg.vocab_size)
    seg = jnp.asarray(np.repeat([[1] * 8 + [2] * 13], 2, axis=0))

    def loss(m):
        return jnp.mean(m(tokens, segment_ids=seg) ** 2)

    (l_x, g_x), (l_p, g_p) = [nnx.jit(nnx.value_and_grad(loss))(Decoder(cfg.replace(attention_impl=impl),
                                                                           rngs=nnx.Rngs(0)))
                              for impl in ("xla", "pallas")]
    # Measured equal on the CPU (interpret mode: the same float32 products); on a GPU JAX's Triton kernel
    # takes its own (TF32) precision, bound as the gradients.
    assert abs(float(l_x) - float(l_p)) <= (1e-6 if jax.default_backend() == "cpu" else 1e-4) * abs(float(l_x))
    for a, b in zip(jax.tree.leaves(g_x), jax.tree.leaves(g_p)):
        assert rel(a, b) <= 1e-4


def test_pallas_memory_backend_gives_same_loss_and_grads():
    """``memory_backend="pallas"``: the delta rules run through the kernels.delta kernels and the
    short convolutions through layers.conv_pallas (interpret mode on the CPU) — the same loss and
    gradients as the XLA forms."""
    cfg = get_config("tiny_kda").replace(pattern="DGK", chunk_size=16, memory_backend="xla")
    tokens = jax.random.randint(jax.random.key(4), (2, 40), 0, cfg.vocab_size)

    def loss(m):
        return jnp.mean(m(tokens) ** 2)

    with jax.default_matmul_precision("highest"):
        l1, g1 = nnx.jit(nnx.value_and_grad(loss))(Decoder(cfg, rngs=nnx.Rngs(0)))
        l2, g2 = nnx.jit(nnx.value_and_grad(loss))(Decoder(cfg.replace(memory_backend="pallas"), rngs=nnx.Rngs(0)))
    assert rel(l1, l2) <= 1e-5
    def launches(c):  # the kernels in the traced loss of a fresh model of config c
        graphdef, state = nnx.split(Decoder(c, rngs=nnx.Rngs(0)))
        return [n for n, _ in pallas_launches(jax.make_jaxpr(lambda st: loss(nnx.merge(graphdef, st)))(state).jaxpr)]

    kernels = launches(cfg.replace(memory_backend="pallas"))
    assert kernels.count("intra_fwd") == 3  # D, G and K layers
    assert kernels.count("causal_conv_fwd") == 3  # their short convolutions (layers/conv_pallas.py)
    assert launches(cfg) == []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2)):
        assert rel(a, b) <= 1e-4, jax.tree_util.keystr(path)


def test_moe_stats_are_returned_per_moe_layer():
    cfg = get_config("tiny_kimi_linear")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, cfg.vocab_size)
    _, aux = nnx.jit(lambda m, t: m.forward(t))(model, tokens)
    stats = [s for group in aux["moe"] for s in group if s is not None]
    assert len(stats) == sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    for s in stats:
        np.testing.assert_allclose(jnp.sum(s.load), 1.0, rtol=1e-6)
        assert int(jnp.sum(s.expert_counts)) == 2 * 8 * cfg.top_k


def test_attnres_zero_queries_read_the_mean_of_sources():
    r = np.random.default_rng(0)
    emb = jnp.asarray(r.normal(size=(2, 3, 8)), jnp.float32)
    st = AR.init(emb, 4)
    outs = [jnp.asarray(r.normal(size=(2, 3, 8)), jnp.float32) for _ in range(3)]
    st = AR.write(st, outs[0])
    st = AR.seal(st)  # block 1 = outs[0]
    st = AR.write(st, outs[1])
    st = AR.write(st, outs[2])  # partial = outs[1] + outs[2]
    got = AR.read(st, jnp.zeros(8))
    want = (emb + outs[0] + outs[1] + outs[2]) / 3.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # A query aligned with one source pulls the read towards it.
    q = 50.0 * outs[0].mean(axis=(0, 1)) / jnp.linalg.norm(outs[0].mean(axis=(0, 1)))
    assert float(jnp.sum(AR.read(st, q) * outs[0])) > float(jnp.sum(got * outs[0]))


def _attnres_naive(sources, query):
    """softmax_s(query · RMSNorm(src_s)) · src_s over an explicit list of sources (the definition)."""
    srcs = jnp.stack(sources)
    normed = srcs * jax.lax.rsqrt(jnp.mean(srcs * srcs, axis=-1, keepdims=True) + 1e-6)
    w = jax.nn.softmax(jnp.einsum("d,nbtd->nbt", query, normed), axis=0)
    return jnp.einsum("nbt,nbtd->btd", w, srcs)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_attnres_stream_matches_the_definition_forward_and_gradients(seed):
    """init / write / seal / read (cached 1/RMS, one-slot seal) against the naive softmax over an
    explicit source list, on fresh random inputs — reads after every write, with empty slots left
    over and seals that must not fire (``when`` false, nothing written yet)."""
    r = np.random.default_rng(seed)
    B, T, D, n_out, block = 2, 5, 16, 7, 3
    emb = jnp.asarray(r.normal(size=(B, T, D)), jnp.float32)
    outs = jnp.asarray(r.normal(size=(n_out, B, T, D)) * r.uniform(0.2, 3.0, size=(n_out, 1, 1, 1)), jnp.float32)
    queries = jnp.asarray(r.normal(size=(n_out + 1, D)), jnp.float32)

    def fast(emb, outs, queries):
        st = AR.seal(AR.init(emb, 1 + -(-n_out // block) + 1), True)  # nothing written: no-op
        reads = [AR.read(st, queries[0])]
        for i in range(n_out):
            st = AR.seal(AR.write(st, outs[i]), (i + 1) % block == 0)
            reads.append(AR.read(st, queries[i + 1]))
        return jnp.stack(reads)

    def naive(emb, outs, queries):
        sealed, partial, reads = [emb], [], [_attnres_naive([emb], queries[0])]
        for i in range(n_out):
            partial.append(outs[i])
            if (i + 1) % block == 0:
                sealed, partial = sealed + [sum(partial)], []
            reads.append(_attnres_naive(sealed + ([sum(partial)] if partial else []), queries[i + 1]))
        return jnp.stack(reads)

    np.testing.assert_allclose(jax.jit(fast)(emb, outs, queries), jax.jit(naive)(emb, outs, queries),
                               rtol=2e-5, atol=2e-5)
    cot = jnp.asarray(r.normal(size=(n_out + 1, B, T, D)), jnp.float32)
    g_fast = jax.jit(jax.grad(lambda *a: jnp.sum(fast(*a) * cot), argnums=(0, 1, 2)))(emb, outs, queries)
    g_naive = jax.jit(jax.grad(lambda *a: jnp.sum(naive(*a) * cot), argnums=(0, 1, 2)))(emb, outs, queries)
    for name, a, b in zip(("embedding", "outputs", "queries"), g_fast, g_naive):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4, err_msg=name)


def test_attnres_seal_when_false_changes_nothing():
    r = np.random.default_rng(3)
    st = AR.write(AR.init(jnp.asarray(r.normal(size=(1, 2, 4)), jnp.float32), 3),
                  jnp.asarray(r.normal(size=(1, 2, 4)), jnp.float32))
    same = AR.seal(st, False)
    for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(same)):
        np.testing.assert_array_equal(a, b)
    sealed = AR.seal(st, True)
    assert int(sealed.count) == 2 and not bool(sealed.has_partial)
    np.testing.assert_array_equal(sealed.sources[1], st.partial)
    np.testing.assert_allclose(sealed.inv_rms[1], 1 / jnp.sqrt(jnp.mean(st.partial ** 2, -1) + 1e-6), rtol=1e-6)


def test_attnres_first_read_is_the_embedding():
    r = np.random.default_rng(4)
    emb = jnp.asarray(r.normal(size=(2, 3, 8)) * 3.0, jnp.float32)  # distinct tokens, RMS far from 1
    np.testing.assert_allclose(AR.read(AR.init(emb, 3), jnp.asarray(r.normal(size=8), jnp.float32)), emb,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("field,value", [
    ("pattern", "KKX"), ("pattern", ""), ("top_k", 9), ("num_heads", 5), ("attnres_block", 99),
    ("first_dense_layers", 50), ("num_kv_heads", 3), ("kda_gate", "tanh"), ("gdn_output_gate", "relu"),
    ("moe_dispatch", "dense"), ("moe_matmul_impl", "cublas"),
    ("chunk_size", 0), ("scan_period", 0), ("kv_lora_rank", 0), ("memory_backend", "triton"),
    ("positions", "alibi"), ("rope_theta", 0.0), ("rope_theta", "1e4"), ("rope_theta", float("inf")),
    ("decay_a_init", "slow"), ("decode_read", "einsum"),
    # checked by the layers' own `check` on the config's parts, named as the config's fields
    ("moe_hidden", 0), ("moe_activation", "gelu"), ("moe_latent_dim", 0), ("capacity_factor", 0.0),
    ("kda_output_gate", "tanh"), ("num_v_heads", 3), ("conv_size", 1), ("kda_gate_rank", -2),
    ("qk_nope_head_dim", 0), ("q_lora_rank", 0),
])
def test_inconsistent_configs_name_the_field(field, value):
    base = get_config("tiny_kimi_linear") if field != "num_kv_heads" else get_config("tiny_gpt2")
    changes = {field: value}
    if field == "num_heads":
        changes["head_dim"] = None  # head_dim defaults to d_model // num_heads: 64 % 5 != 0
    with pytest.raises(ValueError, match=f"^ModelConfig.{field}: "):
        base.replace(**changes)


@pytest.mark.parametrize("name", config_names())
def test_every_layer_is_built_from_its_part_of_the_config(name):
    """The Decoder's layers take exactly their part's arguments (``ModelConfig.*_part``); every part
    passes its layer's ``check``, and every argument names a real config field."""
    from lineage_jax.layers.attention import Attention
    from lineage_jax.layers.memory_mixer import MemoryMixer
    from lineage_jax.layers.mla import MLA
    from lineage_jax.layers.moe import MoE
    import dataclasses

    cfg = get_config(name)
    fields = {f.name for f in dataclasses.fields(cfg)}
    parts = [(cfg.mixer_part(r), MemoryMixer) for r in ("linear", "deltanet", "gdn", "kda")]
    parts += [(cfg.attention_part(), Attention)] if "S" in cfg.pattern else []
    parts += [(cfg.mla_part(), MLA)] if "M" in cfg.pattern else []
    parts += [(cfg.moe_part(), MoE)] if cfg.num_experts else []
    for part, layer in parts:
        assert set(part.fields.values()) <= fields, part.layer
        part.check(layer.check)
    if name.startswith("tiny_"):
        model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
        mixers = [b.mixer for g in model.groups for b in g.blocks]
        for m in mixers:
            if type(m).__name__ == "MemoryMixer":
                assert m.options == cfg.mixer_part(m.rule).check(MemoryMixer.check)
            else:
                assert m.attention_impl == cfg.attention_impl and m.decode_read == cfg.decode_read
        for _, _, moe in model.moe_layers():
            assert (moe.num_experts, moe.top_k, moe.matmul_impl) == (cfg.num_experts, cfg.top_k, cfg.moe_matmul_impl)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mla"])
def test_decode_read_reaches_every_attention_layer(name):
    """``ModelConfig.decode_read``: the Decoder's softmax / MLA layers read their caches that way;
    both reads decode the logits of the full forward (GQA softmax with RoPE; MLA)."""
    tokens = jax.random.randint(jax.random.key(3), (2, 7), 0, 256)
    logits = {}
    for read in ("dot", "reduce"):
        model = Decoder(get_config(name).replace(decode_read=read), rngs=nnx.Rngs(0))
        assert {b.mixer.decode_read for g in model.groups for b in g.blocks} == {read}
        full = call(model, tokens)
        _, cache = prefill(model, tokens[:, :5], model.init_cache(2, 8))
        out = []
        for t in (5, 6):
            y, cache = decode(model, tokens[:, t], cache)
            assert rel(y, full[:, t]) <= tolerance(1e-5), (read, t)
            out.append(y)
        logits[read] = np.stack(out)
    np.testing.assert_allclose(logits["reduce"], logits["dot"], rtol=1e-4, atol=1e-5)


def test_rope_softmax_decoder():
    """positions="rope": no position table, the softmax layers rotate q and k (tiny_llama); an odd
    head width is refused, naming head_dim; the rotation makes the model order-aware (a position-free
    one-layer softmax model's last-token logits do not change when earlier tokens are permuted)."""
    cfg = get_config("tiny_llama")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert model.pos is None and all(b.mixer.rope_theta == cfg.rope_theta for b in model.groups[0].blocks)
    with pytest.raises(ValueError, match="head_dim"):
        cfg.replace(head_dim=15)
    # Options that would do nothing are refused, naming the field: RoPE without a softmax layer
    # (MLA has mla_rope), A = 1 at init without a GDN / KDA layer.
    with pytest.raises(ValueError, match="positions"):
        get_config("tiny_kimi_linear").replace(positions="rope")
    with pytest.raises(ValueError, match="decay_a_init"):
        get_config("tiny_gpt2").replace(decay_a_init="unit")
    assert cfg.replace(rope_theta=np.float32(5e5)).rope_theta == np.float32(5e5)
    # Explicit positions index a learned table only; a rotary model refuses them.
    tokens8 = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="positions"):
        model.forward(tokens8, positions=jnp.arange(8)[None] + 3)
    tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, cfg.vocab_size)
    swapped = tokens.at[:, [2, 5]].set(tokens[:, [5, 2]])
    one = cfg.replace(pattern="S")
    nope, rope = (Decoder(one.replace(positions=p), rngs=nnx.Rngs(0)) for p in ("none", "rope"))
    assert rel(call(nope, swapped)[:, -1], call(nope, tokens)[:, -1]) <= 1e-5
    assert rel(call(rope, swapped)[:, -1], call(rope, tokens)[:, -1]) > 1e-3


def test_unknown_config_name_and_field():
    with pytest.raises(ValueError, match="valid names"):
        get_config("gpt5")
    with pytest.raises(ValueError, match="unknown config field"):
        get_config("tiny_gpt2", n_layers=3)


def test_bad_tokens():
    model = Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`tokens`"):
        model(jnp.zeros((2, 3, 4), jnp.int32))
    with pytest.raises(ValueError, match="`tokens`"):
        model(jnp.zeros((2, 3), jnp.float32))


@K3_GROUP
@pytest.mark.parametrize("rule", ["sign", "quantile"])
def test_router_bias_updates_reach_every_moe_layer(rule):
    cfg = get_config("tiny_k3")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    _, aux = forward(model, _tokens(cfg, 5))
    before = [np.asarray(moe.router_bias[...]).copy() for _, _, moe in model.moe_layers()]
    model.update_router_biases(aux, rule=rule, rate=0.1)
    after = [np.asarray(moe.router_bias[...]) for _, _, moe in model.moe_layers()]
    assert len(before) >= 3 and any(b.ndim == 2 for b in before)  # a scanned (stacked) group is included
    for b, a in zip(before, after):
        assert a.shape == b.shape and not np.allclose(a, b)
    if rule == "sign":  # the most-loaded expert of the first MoE layer went down
        g, j, _ = model.moe_layers()[0]
        counts = np.asarray(aux["moe"][g][j].expert_counts).reshape(-1, cfg.num_experts)[0]
        e = int(np.argmax(counts))  # (the first row if the layer sits in a scanned group)
        assert after[0].reshape(-1, cfg.num_experts)[0, e] < before[0].reshape(-1, cfg.num_experts)[0, e]


@pytest.mark.slow  # the default suite keeps the tiny_k3 macrocycle scan test
def test_93_layer_config_traces_one_macrocycle():
    """K3's layout (23 × KKKM + M) at toy width: the scan keeps compile time near a 9-layer model's."""
    import time

    cfg = get_config("tiny_k3").replace(pattern="KKKM" * 23 + "M", attnres_block=12, d_model=32, head_dim=8,
                                        moe_hidden=16, moe_latent_dim=16, shared_hidden=16, ffn_hidden=32)
    groups = layer_groups(cfg)
    assert max(n for _, _, n in groups) == 22 and len(groups) <= 6
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 8), jnp.int32)
    t0 = time.perf_counter()
    logits = call(model, tokens)
    assert np.all(np.isfinite(logits)) and logits.shape == (1, 8, cfg.vocab_size)
    assert time.perf_counter() - t0 < 120


def test_scanned_decode_updates_the_cache_in_place():
    """A scanned group's caches ride in the scan carry: the decode step's temporaries stay below
    one cache (as scan xs -> ys they were rebuilt every step: 1.75x the cache here)."""
    cfg = get_config("tiny_gpt2").replace(max_seq_len=1 << 14)
    assert any(n > 1 for _, _, n in layer_groups(cfg))  # the layers really are scanned
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda st, t, c: nnx.merge(graphdef, st).decode(t, c), donate_argnums=2)
    cache = jax.eval_shape(lambda: model.init_cache(2, 1 << 14, jnp.float32))
    mem = step.lower(state, jax.ShapeDtypeStruct((2,), jnp.int32), cache).compile().memory_analysis()
    if mem is None:
        pytest.skip("this backend reports no memory analysis")
    cache_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
    assert mem.temp_size_in_bytes < cache_bytes, (mem.temp_size_in_bytes, cache_bytes)


def test_grouped_value_heads_model_decodes_like_its_forward_and_counts_its_state():
    base = get_config("tiny_gdn").replace(memory_backend="xla")
    cfg = base.replace(num_v_heads=2 * base.num_heads)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, cfg.vocab_size)
    check_decode_after_prefill(model, tokens, 5, 12, 1e-5)
    from lineage_jax import accounting
    assert accounting.state_bytes(cfg) == 2 * accounting.state_bytes(base)
    assert accounting.flops_per_token(cfg, 64) > accounting.flops_per_token(base, 64)
    with pytest.raises(ValueError, match="num_v_heads"):
        base.replace(num_v_heads=base.num_heads + 1)


def test_get_config_takes_a_name_override():
    cfg = get_config("tiny_kda", name="kda_variant", d_model=32)
    assert cfg.name == "kda_variant" and cfg.d_model == 32 and cfg.pattern == get_config("tiny_kda").pattern
