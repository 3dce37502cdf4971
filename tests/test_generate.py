"""lineage_jax.generate: sampling reuses the jitted steps across calls and models of one structure, and its
statistics keep the decode step's compilation out of the decode rate."""

import jax.numpy as jnp
from flax import nnx

from lineage_jax.generate import generate
from lineage_jax.models import Decoder, get_config
from lineage_jax.models.decoder import _jitted_steps


def _greedy(model, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(jnp.argmax(model.forward(jnp.asarray([toks], jnp.int32))[0][0, -1])))
    return toks[len(prompt):]


def test_a_second_model_of_the_same_config_reuses_the_compiled_steps():
    a = Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(0))
    b = Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(1))  # other weights, same structure
    out_a, stats = generate(a, [1, 2, 3], max_new_tokens=6, temperature=0.0)
    hits = _jitted_steps.cache_info().hits
    prefill, decode = _jitted_steps(nnx.split(b)[0])
    compiled = (prefill._cache_size(), decode._cache_size())
    out_b, _ = generate(b, [1, 2, 3], max_new_tokens=6, temperature=0.0)
    assert _jitted_steps.cache_info().hits == hits + 2  # the lookup above and generate's own
    assert (prefill._cache_size(), decode._cache_size()) == compiled  # nothing compiled again
    assert out_a == _greedy(a, [1, 2, 3], 6) and out_b == _greedy(b, [1, 2, 3], 6)  # each with its own weights
    assert set(stats) >= {"first_decode_s", "decode_tokens_per_s", "prefill_tokens_per_s"}
    assert stats["new_tokens"] == 6 and stats["decode_tokens_per_s"] > 0
