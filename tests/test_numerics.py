"""The matmul-precision policy (lineage_jax.numerics): one setting per model reaches every product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax import memory
from lineage_jax.models import Decoder, get_config
from lineage_jax.numerics import MATMUL_PRECISIONS, matmul_precision
from tests._numerics import precision_in_force, rel_err, tolerance


def _dot_precisions(fn, *args) -> set[str]:
    """The ``precision`` of every dot_general in ``fn``'s jaxpr, sub-jaxprs (scan, jit, remat,
    custom VJP) included: "None" (the policy in force at lowering) or the enums' names."""
    return {"None" if p is None else str(p) for p in _dot_eqns(fn, *args)}


def _model_fn(name, **over):
    model = Decoder(get_config(name).replace(**over), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, model.cfg.vocab_size)
    return (lambda s, t: nnx.merge(graphdef, s)(t)), state, tokens


@pytest.mark.default_precision
@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_kimi_linear"])
def test_model_matmul_precision_reaches_every_product(name):
    fn, state, tokens = _model_fn(name, matmul_precision="highest", memory_backend="xla")
    assert precision_in_force() == "default"
    precs = _dot_precisions(fn, state, tokens)
    assert precs and all("HIGHEST" in p for p in precs), precs
    fn, state, tokens = _model_fn(name, memory_backend="xla")  # "default": the backend's own
    precs = _dot_precisions(fn, state, tokens)
    assert any(p == "None" for p in precs), precs  # projections and rule products follow the policy
    # ... but the gate prefix sums of the chunked forms stay float32 whatever the policy.
    if "K" in get_config(name).pattern:
        assert any("HIGHEST" in p for p in precs), precs


@pytest.mark.default_precision
@pytest.mark.parametrize("name,over", [("tiny_gdn", {}), ("tiny_llama", {}),
                                       ("tiny_kimi_linear", {"moe_matmul_impl": "tiled"})])
def test_gradients_run_at_the_model_precision(name, over):
    """Every product of the backward pass too, those of the custom backward rules included (blockwise
    attention, the tiled grouped matmul: traced when ``grad`` transposes, outside the model's own context)."""
    fn, state, tokens = _model_fn(name, matmul_precision="highest", memory_backend="xla", **over)
    assert precision_in_force() == "default"
    loss = lambda s, t: jnp.mean(fn(s, t) ** 2)
    precs = _dot_precisions(jax.grad(loss), state, tokens)
    assert precs and all("HIGHEST" in p for p in precs), precs


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="on a CPU the default and the highest precision "
                    "compile the same float32 products: the comparison cannot fail there")
@pytest.mark.default_precision
@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_kda", "tiny_mla"])
def test_default_precision_is_within_its_tolerance_of_float32(name):
    """On a GPU TF32 (on a TPU one bf16 pass) stays within the tolerance the suite gives that precision."""
    fn, state, tokens = _model_fn(name)
    ref_fn, _, _ = _model_fn(name, matmul_precision="highest")
    got, ref = jax.jit(fn)(state, tokens), jax.jit(ref_fn)(state, tokens)
    assert rel_err(got, ref) <= tolerance(1e-5), rel_err(got, ref)


def test_an_outer_highest_context_is_kept_by_a_default_model():
    """"default" leaves the caller's precision in force (the suite itself runs at "highest")."""
    assert precision_in_force() == "highest"
    fn, state, tokens = _model_fn("tiny_gpt2")
    precs = _dot_precisions(fn, state, tokens)
    assert precs and all("HIGHEST" in p for p in precs), precs


def test_memory_functions_follow_the_context():
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(1, 20, 2, 8)), jnp.float32) for _ in range(3))
    g = -jnp.asarray(r.uniform(0, 1, (1, 20, 2, 8)), jnp.float32)
    beta = jnp.asarray(r.uniform(0, 1, (1, 20, 2)), jnp.float32)
    f = lambda *a: memory.kda(*a, backend="xla", chunk_size=16)[0]
    with matmul_precision("highest"):
        precs = _dot_precisions(f, q, k, v, g, beta)
        assert precs and all("HIGHEST" in p for p in precs), precs  # (an empty set would pass `all`)
    with jax.default_matmul_precision("default"):
        assert "None" in _dot_precisions(f, q, k, v, g, beta) or any(
            "DEFAULT" in p for p in _dot_precisions(f, q, k, v, g, beta))


def test_unknown_precision_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="matmul_precision"):
        get_config("tiny_gpt2").replace(matmul_precision="tf32")
    with pytest.raises(ValueError, match="matmul_precision"):
        matmul_precision("fast")
    assert MATMUL_PRECISIONS == ("default", "high", "highest")


@pytest.mark.default_precision
def test_delta_corrections_follow_the_policy():
    """``memory.delta_corrections``: its products at the precision in force, its decay from the float32
    prefix sum (the one exception), no ``cumsum``."""
    r = np.random.default_rng(1)
    k, v = (jnp.asarray(r.normal(size=(1, 12, 2, 8)), jnp.float32) for _ in range(2))
    g = -jnp.asarray(r.uniform(0, 1, (1, 12, 2, 8)), jnp.float32)
    beta = jnp.asarray(r.uniform(0, 1, (1, 12, 2)), jnp.float32)
    S0 = jnp.asarray(r.normal(size=(1, 2, 8, 8)), jnp.float32)
    f = lambda *a: memory.delta_corrections(*a[:3], g=a[3], initial_state=a[4])  # noqa: E731
    assert precision_in_force() == "default"
    precs = _dot_precisions(f, k, v, beta, g, S0)
    assert "None" in precs and any("HIGHEST" in p for p in precs), precs
    assert "cumsum" not in str(jax.make_jaxpr(f)(k, v, beta, g, S0))
    with matmul_precision("highest"):
        precs = _dot_precisions(f, k, v, beta, g, S0)
        assert precs and all("HIGHEST" in p for p in precs), precs


@pytest.mark.default_precision
@pytest.mark.parametrize("rule", ["linear", "deltanet", "gdn"])
def test_a_mixer_runs_its_rule_at_the_options_precision(rule):
    """A standalone mixer's ``MemoryOptions.precision`` reaches its rule's products, the normalized linear
    rule's (which takes no options) too; the projections follow the caller's context."""
    from lineage_jax.layers.memory_mixer import MemoryMixer

    m = MemoryMixer(32, rule=rule, num_heads=2, head_dim=16, conv_size=0, rngs=nnx.Rngs(0),
                    options=memory.MemoryOptions(backend="xla", chunk_size=16, precision="highest"))
    x = jnp.ones((1, 24, 32))
    with matmul_precision("highest"):
        assert all("HIGHEST" in p for p in _dot_precisions(lambda x: m(x), x))
    n_highest = lambda: sum(1 for e in _dot_eqns(lambda x: m(x), x) if "HIGHEST" in str(e))  # noqa: E731
    assert precision_in_force() == "default" and n_highest() >= 4  # the rule's products, not only projections


def _dot_eqns(fn, *args):
    """The ``precision`` parameter of every dot_general in ``fn``'s jaxpr, one entry per product."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                out.append(eqn.params.get("precision"))
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out
