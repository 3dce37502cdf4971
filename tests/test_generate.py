"""lineage_jax.generate: sampling reuses the jitted steps across calls and models of one structure, its
statistics keep the decode step's compilation out of the decode rate, and prompts of different lengths
sample as one batch."""

import jax.numpy as jnp
import pytest
from flax import nnx

from lineage_jax.generate import generate, generate_batch
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


def _until_eos(tokens, eos_id):
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_kimi_linear"])
def test_generate_batch_rows_are_their_prompts_alone(name):
    """Prompts of three lengths in one batch: each row's greedy tokens are its prompt's own greedy
    continuation, through KV caches and learned positions (tiny_gpt2: against the full forward pass, no
    cache) and KDA states, conv histories, MLA latent caches, MoE and AttnRes (tiny_kimi_linear: against
    `generate` on the prompt alone; tests/layers/test_models.py checks its decode against the forward)."""
    model = Decoder(get_config(name), rngs=nnx.Rngs(0))
    prompts = [[5, 9], [1, 2, 3, 4, 200, 6, 7], [11, 12, 13, 14]]
    alone = (lambda p: _greedy(model, p, 5)) if name == "tiny_gpt2" else (
        lambda p: generate(model, p, max_new_tokens=5, temperature=0.0)[0])
    want = [alone(p) for p in prompts]
    out, stats = generate_batch(model, prompts, max_new_tokens=5, temperature=0.0)
    assert out == want
    assert stats["prompt_tokens"] == 13 and stats["new_tokens"] == 15 and stats["decode_tokens_per_s"] > 0
    # a row stops at its eos (kept); the others go on
    eos = want[1][1]
    out, stats = generate_batch(model, prompts, max_new_tokens=5, temperature=0.0, eos_id=eos)
    assert out == [_until_eos(w, eos) for w in want] and out[1][-1] == eos and len(out[1]) <= 2
    assert stats["new_tokens"] == sum(map(len, out))


def test_generate_batch_refuses_bad_prompts():
    model = Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(0))
    for prompts, match in (([], "`prompts` must be a non-empty list"), ([[1], []], r"`prompts\[1\]` must contain"),
                           ([[1], [2, 256]], r"`prompts\[1\]` holds 1 id"), ("abc", "`prompts` must be"),
                           ([[1.5]], r"`prompts\[0\]` must be a list of int")):
        with pytest.raises(ValueError, match=match):
            generate_batch(model, prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match="the longest prompt"):
        generate_batch(model, [[1], [2] * 500], max_new_tokens=20)
    with pytest.raises(ValueError, match="`eos_id`"):
        generate_batch(model, [[1]], max_new_tokens=2, eos_id="2")


def test_learned_positions_fill_the_table_and_a_tiny_temperature_is_greedy():
    """The last sampled token is not fed back: a prompt of 500 and 13 new tokens need 512 of tiny_gpt2's 512
    positions (refused one short before). A temperature of 1e-39 (subnormal in float32) samples the greedy
    tokens (it took token 0: every logit overflowed)."""
    model = Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(0))
    assert len(generate(model, [1] * 500, max_new_tokens=13, temperature=0)[0]) == 13
    greedy = generate(model, [1, 2, 3], max_new_tokens=4, temperature=0)[0]
    assert generate(model, [1, 2, 3], max_new_tokens=4, temperature=1e-39)[0] == greedy


def test_the_cli_prints_a_character_whose_bytes_arrive_one_token_at_a_time(monkeypatch, capsys):
    """The byte tokenizer's tokens are bytes: a multi-byte character is printed once whole (its partial
    decodes, U+FFFD, were printed and the character never)."""
    import types

    import lineage_jax.generate as G
    model = Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(0))
    target = list(" café €".encode())

    def fake_generate(model, prompt, *, on_token, **kw):
        out = []
        for t in target:
            out.append(t)
            on_token(list(out))
        return out, {"prompt_tokens": len(prompt), "prefill_tokens_per_s": 0.0, "new_tokens": len(out),
                     "first_decode_s": 0.0, "decode_tokens_per_s": 0.0}

    monkeypatch.setattr(G, "load", lambda workdir: (model, types.SimpleNamespace(tokenizer="byte")))
    monkeypatch.setattr(G, "generate", fake_generate)
    assert G.main(["--workdir", "unused", "--prompt", "hi"]) == 0
    assert capsys.readouterr().out == "hi café €\n"

