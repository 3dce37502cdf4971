"""Multi-device checks, run in a fresh process with 8 fake CPU devices.

    python -m tests.parallel._multi_device_checks <case>

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX
creates its CPU backend, which a pytest worker may already have done; so
``test_multi_device.py`` runs this module in a subprocess. Each case prints one
line ``RESULT {json}`` that the test asserts on; a failed check raises (nonzero exit).
"""

from __future__ import annotations

import os

from tests._fake_devices import fake_device_xla_flags

os.environ["XLA_FLAGS"] = fake_device_xla_flags(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from lineage_jax.generate import ShardedDecoder  # noqa: E402
from lineage_jax.layers.moe import MoE  # noqa: E402
from lineage_jax.models import Decoder, get_config  # noqa: E402
from lineage_jax.parallel import expert as EP  # noqa: E402
from lineage_jax.parallel.mesh import make_mesh  # noqa: E402
from lineage_jax.parallel.rules import state_shardings  # noqa: E402
from lineage_jax.train.step import TrainStep, init_sharded, next_token_loss  # noqa: E402

MESHES = {
    "data=8": {"data": 8},
    "fsdp=8": {"fsdp": 8},
    "data=2,expert=4": {"data": 2, "expert": 4},
    "tensor=2,expert=4": {"tensor": 2, "expert": 4},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_rel(tree, ref) -> tuple[float, float]:
    """(max over leaves of the per-leaf relative error, relative error of the whole tree)."""
    la, lb = jax.tree.leaves(tree), jax.tree.leaves(ref)
    assert len(la) == len(lb) and la, "gradient trees differ in structure"
    per_leaf = max(rel(a, b) for a, b in zip(la, lb))
    num = math.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)) for a, b in zip(la, lb)))
    den = math.sqrt(sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in lb))
    return per_leaf, num / den


def max_abs_diff(tree, ref) -> float:
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)))


def expect_value_error(fn, *needles) -> str:
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        for needle in needles:
            assert needle in msg, f"ValueError message {msg!r} does not mention {needle!r}"
        return msg
    raise AssertionError(f"expected a ValueError mentioning {needles}")


# ----------------------------------------------------------------------------- MoE layer
def _np_expert(z, wg, wu, wd):
    g, u = z @ wg, z @ wu
    return (g / (1 + np.exp(-g)) * u) @ wd


def _np_capacity_reference(moe, z, idx, w, *, num_shards, ep, cap_factor):
    """Expected routed output and drop count of the EP capacity rule, in float64 NumPy."""
    z, idx, w = np.asarray(z, np.float64), np.asarray(idx), np.asarray(w, np.float64)
    wg, wu, wd = (np.asarray(p[...], np.float64) for p in (moe.w_gate, moe.w_up, moe.w_down))
    n_tok, k = idx.shape
    e_loc = moe.num_experts // ep
    n = n_tok // num_shards
    cap = max(1, min(n * min(k, e_loc), math.ceil(cap_factor * n * k / ep)))
    out = np.zeros_like(z)
    dropped = 0
    for s in range(num_shards):
        used = np.zeros(ep, int)
        for c in range(k):                      # choice-major
            for t in range(s * n, (s + 1) * n):
                e = idx[t, c]
                d = e // e_loc
                if used[d] < cap:
                    out[t] += w[t, c] * _np_expert(z[t], wg[e], wu[e], wd[e])
                else:
                    dropped += 1
                used[d] += 1
    return out, dropped


def case_moe() -> dict:
    res: dict = {}
    d, B, T = 16, 8, 6
    moe = MoE(d, num_experts=8, top_k=2, expert_hidden=12, num_shared_experts=1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, d))

    def loss(m, x):
        y, stats = m(x)
        return jnp.sum(jnp.sin(y)), (y, stats.tokens_dropped)

    ref_grad = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y0, _)), (gm0, gx0) = ref_grad(moe, x)

    # The same weights with the experts' tiled grouped matmul (layers/grouped.py) forced on.
    moe_tiled = MoE(d, num_experts=8, top_k=2, expert_hidden=12, num_shared_experts=1, matmul_impl="tiled",
                    rngs=nnx.Rngs(0))
    for name, impls in (("data=2,expert=4", ("dense", "ragged_reference", "dense+tiled")),
                        ("tensor=2,expert=4", ("dense",)), ("expert=8", ("ragged_reference", "ragged_reference+tiled"))):
        mesh = make_mesh(name)
        for impl in impls:
            model = moe_tiled if impl.endswith("+tiled") else moe
            ep = EP.ExpertParallel(mesh, impl=impl.split("+")[0])

            def ep_loss(m, x):
                y, stats = EP.moe_forward(m, x, ep)
                return jnp.sum(jnp.sin(y)), (y, stats.tokens_dropped)

            f = jax.jit(nnx.value_and_grad(ep_loss, argnums=(0, 1), has_aux=True))
            text = f.lower(model, x).as_text()
            (_, (y, dropped)), (gm, gx) = f(model, x)
            res[f"{name}/{impl}"] = dict(
                y_rel=rel(y, y0), gx_rel=rel(gx, gx0), gw_rel=tree_rel(gm, gm0)[0], dropped=int(dropped),
                all_to_all_ops=text.count("all_to_all"))

    # capacity: drops counted per (source, destination shard), kept rows exact
    mesh = make_mesh("data=2,expert=4")
    idx, w, _ = jax.jit(lambda x: moe.route(x))(x)
    z = x.reshape(-1, d)
    for impl in ("dense", "ragged_reference"):
        for cf in ((0.5, 1.0) if impl == "dense" else (0.5,)):
            ep = EP.ExpertParallel(mesh, impl=impl, capacity_factor=cf)
            routed, dropped = jax.jit(lambda z, i, w: EP.expert_parallel_experts(moe, z, i, w, ep, cf))(z, idx, w)
            ref, ref_dropped = _np_capacity_reference(moe, z, idx, w, num_shards=8, ep=4, cap_factor=cf)
            res[f"capacity/{impl}/{cf}"] = dict(dropped=int(dropped), expected_dropped=ref_dropped,
                                                 routed_rel=rel(routed, ref))

    # errors
    res["error_experts"] = expect_value_error(
        lambda: jax.jit(lambda x: EP.moe_forward(MoE(d, num_experts=6, top_k=2, expert_hidden=8, rngs=nnx.Rngs(0)),
                                                 x, EP.ExpertParallel(mesh)))(x),
        "num_experts", "6", "expert")
    res["error_tokens"] = expect_value_error(
        lambda: jax.jit(lambda x: EP.moe_forward(moe, x, EP.ExpertParallel(mesh)))(x[:3, :1]), "expert", "tokens")
    res["error_mesh"] = expect_value_error(lambda: make_mesh({"data": 4, "expert": 4}), "mesh", "16", "8")
    res["error_mesh_rest"] = expect_value_error(lambda: make_mesh({"data": -1, "expert": 3}), "mesh", "8")
    return res


# ----------------------------------------------------------------------------- whole model
def small_moe_config():
    """tiny_kimi_linear's MoE (8 experts, top-2, a shared expert) on a 'KMKM' stack: one
    scanned group of two KDA+MLA macrocycles (so parameters carry the 'layers' axis)."""
    return get_config("tiny_kimi_linear").replace(pattern="KMKM", first_dense_layers=0, attnres_block=0)


def _spec_str(arr) -> str:
    return str(arr.sharding.spec)


def _baseline(cfg, batch):
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef = nnx.graphdef(abstract)

    def lf(params, rest):
        return next_token_loss(nnx.merge(graphdef, params, rest), batch)[0]

    return graphdef, jax.jit(jax.value_and_grad(lf))


def check_model_meshes(cfg, meshes, *, born_sharded_mesh: str, step_mesh: str = None,
                       fp64_reference: bool = False) -> dict:
    """Loss and gradients of ``cfg`` on each mesh against one device (same parameters).

    With ``fp64_reference``, also the distance of every float32 gradient (one device and
    each mesh) from a float64 one-device gradient: for models whose float32 gradients are
    themselves ~1e-4 from the exact ones, that is the fair yardstick for sharding."""
    res: dict = {"meshes": {}}
    host_grads = {}
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, cfg.vocab_size)
    batch = {"tokens": tokens}
    t0 = time.time()

    # born sharded on one mesh; its values are the reference parameters
    mesh = make_mesh(MESHES[born_sharded_mesh])
    model = init_sharded(cfg, mesh)
    state = nnx.state(model)
    ref_state = jax.device_put(state, jax.devices()[0])
    graphdef, ref_fn = _baseline(cfg, batch)
    _, p0, r0 = nnx.split(nnx.merge(graphdef, ref_state), nnx.Param, ...)
    loss0, grads0 = ref_fn(p0, r0)
    res["born_sharded"] = born_sharded_mesh
    res["reference_seconds"] = round(time.time() - t0, 1)

    for name in meshes:
        t = time.time()
        mesh = make_mesh(MESHES[name])
        m = model if name == born_sharded_mesh else nnx.merge(graphdef, jax.device_put(ref_state, state_shardings(ref_state, mesh)))
        trainer = TrainStep(m, mesh, optax.adamw(1e-3))
        st = trainer.init(m)
        loss, metrics, grads = trainer.loss_and_grad(st, trainer.shard_batch(batch))
        log(f"{name}: loss and gradients dispatched")
        per_leaf, whole = tree_rel(grads, grads0)
        log(f"{name}: compared")
        if fp64_reference:
            host_grads[name] = jax.tree.map(np.asarray, grads)
        g_idx, j_idx, first_moe = m.moe_layers()[0]
        stacked = first_moe.w_gate[...]
        embed = m.embed[...]
        out = dict(loss=float(loss), loss_ref=float(loss0), loss_rel=abs(float(loss) - float(loss0)) / abs(float(loss0)),
                   grad_rel_max_leaf=per_leaf, grad_rel=whole, tokens_dropped=int(metrics["tokens_dropped"]),
                   expert_parallel=trainer.expert_parallel is not None,
                   w_gate_shape=list(stacked.shape), w_gate_spec=_spec_str(stacked),
                   w_gate_shards=sorted({tuple(s.data.shape) for s in stacked.addressable_shards}),
                   embed_shape=list(embed.shape), embed_spec=_spec_str(embed),
                   embed_shards=sorted({tuple(s.data.shape) for s in embed.addressable_shards}),
                   grad_w_gate_spec=_spec_str(grads["groups"][g_idx]["blocks"][j_idx]["ffn"]["w_gate"][...]))
        if name == step_mesh:
            # The optimizer update on the mesh == optax on one device, with the same gradients.
            tx = optax.adamw(1e-3)
            g_host = jax.device_put(grads, jax.devices()[0])
            upd, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(g_host, p0)
            expected = jax.jit(optax.apply_updates)(p0, upd)
            new = trainer.apply_gradients(trainer.init(m), grads)
            diff = max_abs_diff(new.params, expected)
            moved = max_abs_diff(new.params, p0)
            stepped, step_metrics = trainer(trainer.init(m), trainer.shard_batch(batch))   # the fused call
            out["step"] = dict(step=int(stepped.step), loss=float(step_metrics["loss"]), param_max_abs_diff=diff,
                               param_max_move=moved, call_vs_apply=max_abs_diff(stepped.params, new.params),
                               grad_norm=float(step_metrics["grad_norm"]),
                               opt_mu_spec=_spec_str(stepped.opt_state[0].mu["groups"][g_idx]["blocks"][j_idx]["ffn"]["w_gate"][...]))
        out["seconds"] = round(time.time() - t, 1)
        res["meshes"][name] = out
    if fp64_reference:
        jax.config.update("jax_enable_x64", True)
        try:
            to64 = lambda tree: jax.tree.map(
                lambda a: np.asarray(a, np.float64) if np.issubdtype(np.asarray(a).dtype, np.floating) else np.asarray(a), tree)
            loss64 = lambda p, r: next_token_loss(nnx.merge(graphdef, p, r), batch)[0]
            _, g64 = jax.jit(jax.value_and_grad(loss64))(to64(p0), to64(r0))
            res["fp64"] = {"one_device": tree_rel(grads0, g64)[1]}
            for name, g in host_grads.items():
                res["fp64"][name] = tree_rel(g, g64)[1]
        finally:
            jax.config.update("jax_enable_x64", False)
    return res


def case_model() -> dict:
    """Every mesh but pure data parallelism (``case_model_data``, a subset of data=2 x expert=4's
    data axis with the parameters replicated)."""
    meshes = [m for m in MESHES if m != "data=8"]
    return check_model_meshes(small_moe_config(), meshes, born_sharded_mesh="tensor=2,expert=4",
                              step_mesh="data=2,expert=4")


def case_model_data() -> dict:
    return check_model_meshes(small_moe_config(), ["data=8"], born_sharded_mesh="data=8")


def case_kimi_linear() -> dict:
    cfg = get_config("tiny_kimi_linear")
    res = check_model_meshes(cfg, ["data=2,expert=4", "fsdp=8"], born_sharded_mesh="data=2,expert=4",
                             fp64_reference=True)
    # The train step refuses experts that do not divide over the expert axis.
    mesh = make_mesh({"data": 2, "expert": 4})
    odd = init_sharded(cfg.replace(num_experts=6), mesh)
    res["error_experts"] = expect_value_error(lambda: TrainStep(odd, mesh), "num_experts", "6")
    return res


def case_decode() -> dict:
    cfg = small_moe_config()
    res: dict = {}
    B, T = 8, 6
    prompt = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    nxt = jax.random.randint(jax.random.key(3), (B,), 0, cfg.vocab_size)
    born = {}
    for name in ("data=2,expert=4", "tensor=2,expert=4"):
        mesh = make_mesh(MESHES[name])
        model = init_sharded(cfg, mesh)
        born[name] = jax.tree.map(np.asarray, nnx.state(model))
        dec = ShardedDecoder(model, mesh, batch_size=B, max_len=16)
        state = nnx.state(model)
        cache = dec.init_cache()
        logits_p, cache = dec.prefill(state, prompt, cache)
        logits_d, cache = dec.decode(state, nxt, cache)
        if not res:    # one-device reference (initialisation is mesh-independent: checked below)
            ref = nnx.merge(nnx.graphdef(model), jax.device_put(state, jax.devices()[0]))
            ref_p, ref_cache = jax.jit(lambda t: ref.prefill(t, ref.init_cache(B, 16)))(prompt)
            ref_d, _ = jax.jit(lambda t, c: ref.decode(t, c))(nxt, ref_cache)
        leaf = jax.tree.leaves(cache.layers)[0]
        res[name] = dict(prefill_rel=rel(logits_p, ref_p), decode_rel=rel(logits_d, ref_d),
                         expert_parallel=dec.expert_parallel is not None, cache_spec=_spec_str(leaf),
                         cache_shards=sorted({tuple(s.data.shape) for s in leaf.addressable_shards}),
                         cache_shape=list(leaf.shape), length=np.asarray(cache.length).tolist())
        if name == "data=2,expert=4":
            other_state = state
    # a state laid out on another mesh is refused by name (the cache survives), then taken after `place`
    cache = dec.init_cache()
    res["other_layout_error"] = expect_value_error(lambda: dec.prefill(other_state, prompt, cache), "`state`",
                                                   "decoder.place(state)")
    placed = dec.place(other_state)
    logits_p, cache = dec.prefill(placed, prompt, cache)
    logits_d, _ = dec.decode(placed, nxt, cache)
    res["placed_rel"] = max(rel(logits_p, ref_p), rel(logits_d, ref_d))
    # Born-sharded initialisation does not depend on the mesh (same seed, same values).
    res["init_max_abs_diff_between_meshes"] = max_abs_diff(born["data=2,expert=4"], born["tensor=2,expert=4"])
    # capacity dispatch: "auto" decodes without expert parallelism (per-device capacity would drop other tokens)
    cap = cfg.replace(moe_dispatch="capacity")
    mesh = make_mesh(MESHES["data=2,expert=4"])
    model = init_sharded(cap, mesh)
    dec = ShardedDecoder(model, mesh, batch_size=B, max_len=16)
    state = nnx.state(model)
    logits_p, cache = dec.prefill(state, prompt, dec.init_cache())
    logits_d, _ = dec.decode(state, nxt, cache)
    ref = nnx.merge(nnx.graphdef(model), jax.device_put(state, jax.devices()[0]))
    ref_p, ref_cache = jax.jit(lambda t: ref.prefill(t, ref.init_cache(B, 16)))(prompt)
    ref_d, _ = jax.jit(lambda t, c: ref.decode(t, c))(nxt, ref_cache)
    res["capacity"] = dict(prefill_rel=rel(logits_p, ref_p), decode_rel=rel(logits_d, ref_d),
                           expert_parallel=dec.expert_parallel is not None)
    return res


def case_train_loop() -> dict:
    """``lineage_jax.train.loop.train`` with ``TrainConfig.mesh``: the CLI's training, sharded.

    A 4-step single-device run is the reference; a data=2×expert=4 run is preempted after
    2 steps (the checkpoint is saved and restored in the sharded layout) and resumed; a
    tensor=2×fsdp=4 run goes straight through. Per-step losses must match.
    """
    import tempfile

    from lineage_jax.train.config import TrainConfig
    from lineage_jax.train.loop import train
    from lineage_jax.train.step import make_parallel
    from tests.train.fake_data import factory
    from tests.train.test_loop import _Wrap

    cfg = small_moe_config().replace(vocab_size=64, max_seq_len=64)
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(mesh: str, steps: int, workdir: str, kill_at=None) -> dict:
            tc = TrainConfig(config="tiny_kimi_linear", steps=steps, batch_size=8, seq_len=16, lr=1e-3,
                             warmup_steps=0, log_every=1, save_every=2, mesh=mesh, workdir=os.path.join(tmp, workdir),
                             progress=False, eval_batches=1)
            data = factory(tc, cfg)
            out = train(tc, cfg, lambda split: _Wrap(data(split), kill_at if split == "train" else None), log=log)
            lines = [json.loads(l) for l in open(os.path.join(tc.workdir, "metrics.jsonl"))]
            out["losses"] = [l["loss"] for l in lines if "loss" in l]
            return out

        t0 = time.time()
        ref = run("", 4, "ref")
        log(f"single device: {time.time() - t0:.1f}s")
        for mesh in ("data=2,expert=4", "tensor=2,fsdp=4"):
            t0 = time.time()
            workdir = mesh.replace(",", "_").replace("=", "")
            if mesh == "data=2,expert=4":
                first = run(mesh, 4, workdir, kill_at=2)  # SIGTERM while step 2 runs: saved, stopped ...
                assert first["preempted"] and first["step"] == 2, first
                res.setdefault(mesh, {})["preempted_at"] = first["step"]
            out = run(mesh, 4, workdir)  # ... the same command again resumes from the sharded checkpoint
            res[mesh] = dict(res.get(mesh, {}), losses=out["losses"], ref_losses=ref["losses"],
                             first_loss_rel=abs(out["losses"][0] - ref["losses"][0]) / ref["losses"][0],
                             loss_rel=max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref["losses"])),
                             val_loss_rel=abs(out["eval"]["val_loss"] - ref["eval"]["val_loss"]) / ref["eval"]["val_loss"],
                             step=out["step"], seconds=round(time.time() - t0, 1))
            log(f"{mesh}: {res[mesh]}")
    res["error_batch"] = expect_value_error(
        lambda: make_parallel(cfg, "data=8", batch_size=12), "batch_size=12", "8")
    res["error_experts"] = expect_value_error(
        lambda: make_parallel(cfg.replace(num_experts=6), "data=2,expert=4"), "num_experts", "6")
    res["error_devices"] = expect_value_error(lambda: make_parallel(cfg, "data=16"), "16 devices")
    res["dense_expert_axis_is_fsdp"] = make_parallel(get_config("tiny_kda"), "expert=8").expert_parallel is None
    return res


def case_optimizers() -> dict:
    """A TrainStep on tensor=2 x fsdp=4 with the library's Muon (per-head dimension numbers: the optimizer
    state is not laid out like the parameter tree) and optax's Adafactor (factored row / column statistics
    of other shapes): the mesh's update of its own gradients against optax's on one device."""
    from lineage_jax.train.config import TrainConfig
    from lineage_jax.train.optim import make_optimizer

    cfg = get_config("tiny_kda").replace(vocab_size=64)
    batch = {"tokens": jax.random.randint(jax.random.key(0), (8, 16), 0, cfg.vocab_size)}
    mesh = make_mesh({"tensor": 2, "fsdp": 4})
    model = init_sharded(cfg, mesh)
    norm = lambda tree: float(sum(np.sum(np.asarray(u, np.float64) ** 2) for u in jax.tree.leaves(tree)) ** 0.5)
    delta = lambda a, b: jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)
    res = {}
    for name, make in (("muon", lambda p: make_optimizer(TrainConfig(optimizer="muon", lr=1e-2, warmup_steps=0), p)),
                       ("adafactor", lambda p: optax.adafactor(1e-2))):
        trainer = TrainStep(model, mesh, make(nnx.state(model, nnx.Param)))
        st = trainer.init(model)
        _, _, grads = trainer.loss_and_grad(st, trainer.shard_batch(batch))
        p0, g0 = (jax.tree.map(np.asarray, t) for t in (st.params, grads))  # host copies: the step donates st
        new = trainer.apply_gradients(st, grads)
        tx = make(p0)
        upd, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(g0, p0)
        want = delta(jax.jit(optax.apply_updates)(p0, upd), p0)
        sharded = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(new.opt_state)[0]
                   if hasattr(x, "sharding") and any(a is not None for a in x.sharding.spec)]
        res[name] = dict(update_rel=norm(jax.tree.map(np.subtract, delta(new.params, p0), want)) / norm(want),
                         update_norm=norm(want), sharded_buffers=len(sharded))
        log(f"{name}: {res[name]}")
    # a batch that does not divide over the batch axes (fsdp=4 here) is refused, not copied to every device
    res["error_batch"] = expect_value_error(lambda: trainer.shard_batch({"tokens": batch["tokens"][:3]}),
                                            "does not split", "(3, 16)", "4 devices")
    # a mesh whose axes no rule names would replicate everything over them
    from jax.sharding import AxisType, Mesh
    foreign = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "ep"), axis_types=(AxisType.Auto,) * 2)
    res["error_mesh_axes"] = expect_value_error(lambda: TrainStep(model, foreign), "TrainStep", "'dp'",
                                                "named by no sharding rule")
    return res


def case_hf_load() -> dict:
    """A transformers checkpoint (the tiny Kimi Linear fixture: KDA, MLA, 4 experts) loaded straight
    onto a data=2 x expert=4 mesh: each parameter in its sharding, equal to a one-device load."""
    from lineage_jax import hf

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hf", "kimi_linear")
    ref = hf.load(path)
    mesh = make_mesh({"data": 2, "expert": 4})
    model = hf.load(path, mesh=mesh)
    ref_params = dict(nnx.state(ref).flat_state())
    max_diff, expert_split, placed = 0.0, 0, 0
    for p, v in nnx.state(model).flat_state():
        arr = v.get_value()
        placed += int(arr.sharding.mesh.shape == mesh.shape)
        max_diff = max(max_diff, float(np.max(np.abs(np.asarray(arr) - np.asarray(ref_params[p].get_value())))))
        spec = tuple(arr.sharding.spec)
        if spec and spec[0] == "expert" and arr.shape[0] == ref.cfg.num_experts:  # routed experts [E, ...]
            expert_split += 1
            assert arr.addressable_shards[0].data.shape[0] * 4 == arr.shape[0], (p, arr.sharding)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, ref.cfg.vocab_size, (2, 12)), jnp.int32)
    logits_rel = rel(np.asarray(model(tokens)), np.asarray(ref(tokens)))
    return {"max_param_diff": max_diff, "params": len(ref_params), "placed_on_mesh": placed,
            "expert_sharded": expert_split, "logits_rel": logits_rel}


def _exchanged_rows(cfg, mesh_spec: dict, batch: int, seq: int) -> list:
    """The ``[rows, width]`` operands (shape, dtype bytes) of the activation all-to-alls inside a traced
    expert-parallel forward of ``cfg`` (the exchange ``ExpertParallel`` runs here: dense on CPUs)."""
    mesh = make_mesh(mesh_spec)
    ep = EP.ExpertParallel(mesh)  # what TrainStep builds: each MoE's own dispatch and capacity
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))

    def forward(st, tokens):
        return EP.enable_expert_parallel(nnx.merge(graphdef, st), ep)(tokens)

    with mesh:
        jaxpr = jax.make_jaxpr(forward)(state, jnp.zeros((batch, seq), jnp.int32))
    found = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "all_to_all":
                aval = e.invars[0].aval
                if len(aval.shape) == 2 and aval.shape[1] == (cfg.moe_latent_dim or cfg.d_model):
                    found.append((tuple(aval.shape), aval.dtype.itemsize))
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return found


def case_plan_exchange() -> dict:
    """The planner's GPU rows and bytes against the exchange's own all-to-all operands: dropless, and the
    config's capacity dispatch (``plan(capacity_factor=None)`` follows it as ``ExpertParallel`` does)."""
    from lineage_jax.parallel import plan as PL

    out = {}
    for name, cfg in (("dropless", get_config("tiny_kimi_linear", memory_backend="xla")),
                      ("capacity", get_config("tiny_kimi_linear", memory_backend="xla", moe_dispatch="capacity",
                                              capacity_factor=1.0))):
        m = PL.plan(cfg, {"data": 2, "expert": 4}, batch=8, seq=64, hardware="h200")["moe"]
        out[name] = dict(traced=sorted(set(_exchanged_rows(cfg, {"data": 2, "expert": 4}, 8, 64))),
                         plan_rows=m["rows_per_device"], plan_act_bytes=m["act_bytes"], exchange=m["exchange"],
                         plan_bytes=m["bytes_one_way_per_layer"], width=m["routed_width"])
    return out


def case_pallas_mixers() -> dict:
    """The delta rules' kernels (``backend="pallas"``, interpreted) under a sharded layout: on each device's
    own sequences and heads (``parallel.rules.per_device``), equal to one device's call, forward and every
    gradient; and, the kernels built for a TPU, the sharded step lowers (Mosaic refuses a kernel XLA would
    have to partition)."""
    from lineage_jax import memory as MEM
    from lineage_jax.parallel.rules import logical_sharding
    from tests._jaxpr import calls
    import kernels.delta.api as KA

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    B, T, H, D = 4, 40, 4, 32
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    g_head = jnp.asarray(-rng.uniform(0.0, 0.3, (B, T, H)), jnp.float32)
    g_chan = jnp.asarray(-rng.uniform(0.0, 0.3, (B, T, H, D)), jnp.float32)
    S0 = jnp.asarray(0.1 * rng.standard_normal((B, H, D, D)), jnp.float32)
    seg = jnp.asarray([[0] * 25 + [1] * 15, [0] * 40, [0] * 7 + [1] * 33, [0] * 40], jnp.int32)
    rules = {"delta": (MEM.delta_rule, None), "gdn": (MEM.gated_delta_rule, g_head), "kda": (MEM.kda, g_chan)}

    def grads(name, ctx):
        fn, g = rules[name]

        def loss(q, k, v, g, beta, S0):
            args = (q, k, v, beta) if g is None else (q, k, v, g, beta)
            o, S = fn(*args, initial_state=S0, segment_ids=seg, backend="pallas")
            w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
            return jnp.sum(o * w) + jnp.sum(S * S), (o, S)

        def run(q, k, v, g, beta, S0):
            with (logical_sharding(mesh) if ctx else contextlib.nullcontext()):
                return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5) if g is not None else (0, 1, 2, 4, 5),
                                has_aux=True)(q, k, v, g, beta, S0)
        return run, (q, k, v, g, beta, S0)

    out = {}
    for name in rules:
        run, args = grads(name, False)
        ref = jax.jit(run)(*args)
        run_s, _ = grads(name, True)
        shard = lambda a, axes: None if a is None else jax.device_put(  # noqa: E731
            a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes)))
        b4, b3 = (("data", "fsdp"), None, "tensor", None), (("data", "fsdp"), None, "tensor")
        sargs = (shard(q, b4), shard(k, b4), shard(v, b4), shard(args[3], b4[:args[3].ndim] if args[3] is not None
                                                                  else ()), shard(beta, b3),
                 shard(S0, (("data", "fsdp"), "tensor", None, None)))
        got = jax.jit(run_s)(*sargs)
        out[name] = {"max_rel": float(max(rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))))}
        # every kernel launch sees one device's share: 1/4 of the batch, 1/2 of the heads
        for key, fn_ in (("ref", run), ("sharded", run_s)):
            jx = jax.make_jaxpr(fn_)(*(sargs if key == "sharded" else args)).jaxpr
            out[name][key + "_kernel_elems"] = max(int(np.prod(var.aval.shape)) for e in calls(jx, ("pallas_call",))
                                                  for var in e.invars)
        out[name]["shard_maps"] = sum(1 for _ in calls(jax.make_jaxpr(run_s)(*sargs).jaxpr, ("shard_map",)))
        out[name]["ref_shard_maps"] = sum(1 for _ in calls(jax.make_jaxpr(run)(*args).jaxpr, ("shard_map",)))

    # The short convolution's kernel and the routed experts' grouped-matmul kernels, the same way.
    from lineage_jax.layers.memory_mixer import causal_conv
    x = jnp.asarray(rng.standard_normal((B, T, 3 * H * D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3 * H * D)), jnp.float32)
    conv = lambda x, w: jnp.sum(jnp.sin(causal_conv(x, w, None, seg, kernel=True)[0]))  # noqa: E731

    def conv_run(ctx):
        def run(x, w):
            with (logical_sharding(mesh) if ctx else contextlib.nullcontext()):
                return jax.value_and_grad(conv, argnums=(0, 1))(x, w)
        return run
    sx = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None,
                                                                                       "tensor")))
    got, ref = jax.jit(conv_run(True))(sx, w), jax.jit(conv_run(False))(x, w)
    out["conv"] = {"max_rel": float(max(rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))))}
    for key, ctx, xx in (("ref", False, x), ("sharded", True, sx)):
        jx = jax.make_jaxpr(conv_run(ctx))(xx, w).jaxpr
        out["conv"][key + "_kernel_elems"] = max(int(np.prod(var.aval.shape)) for e in calls(jx, ("pallas_call",))
                                                 for var in e.invars)
    moe = MoE(16, num_experts=4, top_k=2, expert_hidden=8, matmul_impl="pallas", rngs=nnx.Rngs(0))
    xm = jnp.asarray(rng.standard_normal((B, 8, 16)), jnp.float32)

    def moe_run(ctx):
        def run(x):
            with (logical_sharding(mesh) if ctx else contextlib.nullcontext()):
                return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(moe(x)[0])))(x)
        return run
    sxm = jax.device_put(xm, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
    got, ref = jax.jit(moe_run(True))(sxm), jax.jit(moe_run(False))(xm)
    out["moe"] = {"max_rel": float(max(rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))),
                  "shard_maps": sum(1 for _ in calls(jax.make_jaxpr(moe_run(True))(sxm).jaxpr, ("shard_map",))),
                  "ref_shard_maps": sum(1 for _ in calls(jax.make_jaxpr(moe_run(False))(xm).jaxpr, ("shard_map",)))}

    # JAX's flash-attention kernels (impl="pallas"), grouped key heads and documents.
    Ta = 128
    qa = jnp.asarray(rng.standard_normal((B, Ta, H, D)), jnp.float32)
    ka, va = (jnp.asarray(rng.standard_normal((B, Ta, 2, D)), jnp.float32) for _ in range(2))
    sega = jnp.asarray([[0] * 50 + [1] * 78, [0] * Ta, [0] * 10 + [1] * 118, [0] * Ta], jnp.int32)

    def att_run(ctx):
        def run(q, k, v):
            def loss(q, k, v):
                o = MEM.softmax_attention(q, k, v, causal=True, segment_ids=sega, impl="pallas")
                return jnp.sum(jnp.sin(o))
            with (logical_sharding(mesh) if ctx else contextlib.nullcontext()):
                return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
        return run
    b4s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None))
    sqa, ska, sva = (jax.device_put(a, b4s) for a in (qa, ka, va))
    got, ref = jax.jit(att_run(True))(sqa, ska, sva), jax.jit(att_run(False))(qa, ka, va)
    out["attention"] = {"max_rel": float(max(rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))),
                        "shard_maps": sum(1 for _ in calls(jax.make_jaxpr(att_run(True))(sqa, ska, sva).jaxpr,
                                                           ("shard_map",)))}

    # The kernels built for a TPU (Mosaic, not interpreted), the sharded step exported for a TPU.
    target, backend = KA.default_target, jax.default_backend
    KA.default_target = lambda: "tpu"
    jax.default_backend = lambda: "tpu"
    try:
        run_s, args = grads("kda", True)
        spec = lambda a, axes: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(  # noqa
            mesh, jax.sharding.PartitionSpec(*axes)))
        b4, b3 = (("data", "fsdp"), None, "tensor", None), (("data", "fsdp"), None, "tensor")
        text = jax.export.export(jax.jit(run_s), platforms=["tpu"])(
            spec(q, b4), spec(k, b4), spec(v, b4), spec(g_chan, b4), spec(beta, b3),
            spec(S0, (("data", "fsdp"), "tensor", None, None))).mlir_module()
        spec_a = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=b4s)  # noqa: E731
        text_a = jax.export.export(jax.jit(att_run(True)), platforms=["tpu"])(spec_a(qa), spec_a(ka), spec_a(va)
                                                                               ).mlir_module()
    finally:
        KA.default_target, jax.default_backend = target, backend
    out["tpu_export_mosaic_calls"] = text.count("tpu_custom_call")
    out["tpu_export_attention_mosaic_calls"] = text_a.count("tpu_custom_call")
    return out


CASES = {"plan_exchange": case_plan_exchange, "moe": case_moe, "model": case_model, "model_data": case_model_data,
         "kimi_linear": case_kimi_linear, "decode": case_decode, "train_loop": case_train_loop, "hf_load": case_hf_load,
         "optimizers": case_optimizers, "pallas_mixers": case_pallas_mixers}


def main(argv) -> int:
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: python -m tests.parallel._multi_device_checks {{{'|'.join(CASES)}}}", file=sys.stderr)
        return 2
    assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.devices()}"
    t = time.time()
    log(f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
    with jax.default_matmul_precision("highest"):
        res = CASES[argv[0]]()
    res["seconds_total"] = round(time.time() - t, 1)
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
