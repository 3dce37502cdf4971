"""Bad data input: clear errors naming the argument."""

import pytest

from lineage_jax.data import get_tokenizer, tokenize_corpus


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_text_without_a_utf8_encoding_names_the_character(name):
    tok = get_tokenizer(name)
    with pytest.raises(ValueError, match=r"text: character '\\udcff' at position 2 has no UTF-8 encoding"):
        tok.encode("ab\udcff")
    assert tok.decode(tok.encode("ab ü")) == "ab ü"


def test_corpus_text_without_a_utf8_encoding_names_the_character():
    with pytest.raises(ValueError, match=r"text: character '\\ud800' at position 0"):
        tokenize_corpus(["fine", "\ud800"], "byte")


def test_a_bare_string_is_not_a_corpus():
    with pytest.raises(ValueError, match=r"corpus: expected a sequence of documents"):
        tokenize_corpus("abc", "byte")
    assert tokenize_corpus(["abc"], "byte").num_documents == 1
