"""Bad generation input: clear errors naming the argument, before any computation."""

import math

import pytest
from flax import nnx

from lineage_jax.generate import generate, load, main
from lineage_jax.models import Decoder, get_config


@pytest.fixture(scope="module")
def model():
    return Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kw,match", [
    (dict(prompt=[1, 256]), r"`prompt` holds 1 id\(s\) outside \[0, vocab_size=256\), e.g. \[256\]"),
    (dict(prompt=[-1]), r"`prompt` holds 1 id"),
    (dict(prompt=[1.5]), r"`prompt` must be a list of int token ids"),
    (dict(max_new_tokens=-1), r"`max_new_tokens` must be an int >= 0, got -1"),
    (dict(max_new_tokens=2.5), r"`max_new_tokens` must be an int"),
    (dict(temperature=math.nan), r"`temperature` must be finite and >= 0, got nan"),
    (dict(temperature=-0.5), r"`temperature` must be finite"),
    (dict(temperature=math.inf), r"`temperature` must be finite"),
    (dict(top_k=1000), r"`top_k` must be an int in \[0, vocab_size=256\], got 1000"),
    (dict(top_p=math.nan), r"`top_p` must be in \(0, 1\], got nan"),
    (dict(seed=1.5), r"`seed` must be an int in \[0, 2\*\*32\), got 1.5"),
    (dict(seed=None), r"`seed` must be an int"),
    (dict(seed=2 ** 40), r"`seed` must be an int"),   # jax.random.key keeps its low 32 bits: 2**40 is 0's key
    (dict(eos_id=256), r"`eos_id` must be an int token id in \[0, vocab_size=256\) or None, got 256"),
    (dict(eos_id=-3), r"`eos_id` must be an int token id"),
    (dict(prompt=[1] * 500, max_new_tokens=14), r"prompt \+ max_new_tokens - 1 = 513 positions exceed max_seq_len"),
])
def test_generate_names_the_bad_argument(model, kw, match):
    kw = {"prompt": [1, 2], **kw}
    with pytest.raises(ValueError, match=rf"generate: {match}"):
        generate(model, kw.pop("prompt"), **kw)


def test_unreadable_config_json_names_the_workdir(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is unreadable \(JSONDecodeError"):
        load(str(tmp_path))
    (tmp_path / "config.json").write_text('{"train": {"nope": 1}, "model": {}}')
    with pytest.raises(SystemExit) as e:
        main(["--workdir", str(tmp_path), "--prompt-ids", "1"])
    assert e.value.code == 2 and "config.json is unreadable (TypeError" in capsys.readouterr().err
