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


def test_probes_need_two_value_tokens():
    # vocab_size 4 leaves one key and one value: a re-bound key had no other value to take (an endless loop)
    from lineage_jax.data import get_task

    with pytest.raises(ValueError, match="vocab_size: 4 gives 1 value token"):
        get_task("overwrite", vocab_size=4, seq_len=12, num_facts=1)
    assert get_task("overwrite", vocab_size=5, seq_len=12, num_facts=1)[0]["tokens"].shape == (12,)


def test_an_eos_inside_a_document_is_dropped():
    # with the byte tokenizer EOS is NUL: inside a document it would read as a document end nowhere and be trained
    # on as text; the stream keeps EOS for document ends only
    from lineage_jax.data import PackedSource

    tc = tokenize_corpus(["ab\x00cd", "xy", "\x00"], "byte")
    assert tc.tokens.tolist() == [97, 98, 99, 100, 0, 120, 121, 0] and tc.doc_ends.tolist() == [5, 8]
    row = PackedSource(tc, 7)[0]
    assert row["segment_ids"].tolist() == [1, 1, 1, 1, 1, 2, 2] and row["mask"].tolist()[4] == 0


@pytest.mark.parametrize("tokens,ends,vocab,match", [
    ([5, 6, 0, 7, 8, 0], [3, 3, 6], 16, "strictly increasing"),
    ([5, 6, 0, 9, 0], [3, 5], 8, r"ids must be in \[0, vocab_size=8\)"),
    ([5, 6, 1, 7, 0], [3, 5], 16, "document ends without EOS"),
    ([5, 0, 6, 0, 7, 0], [4, 6], 16, "an EOS inside a document"),
    ([5, 6, 0], [3], 16, None),
])
def test_a_tokenized_corpus_is_checked_when_made(tokens, ends, vocab, match):
    import numpy as np

    from lineage_jax.data import TokenizedCorpus

    make = lambda: TokenizedCorpus(np.array(tokens, np.uint8), np.array(ends, np.int64), eos_id=0, vocab_size=vocab)
    if match is None:
        assert make().num_documents == len(ends)
    else:
        with pytest.raises(ValueError, match=match):
            make()


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_decode_refuses_ids_that_are_not_integers(name):
    import jax.numpy as jnp
    import numpy as np

    tok = get_tokenizer(name)
    ids = tok.encode("hi there")
    assert tok.decode(np.array(ids)) == tok.decode(jnp.array(ids)) == "hi there"
    for bad in ([float(i) + 0.5 for i in ids], [True], [jnp.float32(3.0)]):
        with pytest.raises(ValueError, match="ids: must be integer token ids"):
            tok.decode(bad)
