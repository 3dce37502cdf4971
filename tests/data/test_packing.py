import numpy as np
import pytest

from lineage_jax.data.packing import FIELDS, PackedSource, pack_documents
from lineage_jax.data.text import TokenizedCorpus

EOS = 0


def random_docs(seed, n=40, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(1, 30))) for _ in range(n)]


def test_hand_example():
    rows = pack_documents([[5, 6, 7], [8, 9]], seq_len=3, eos_id=EOS, vocab_size=256)
    # stream: 5 6 7 EOS 8 9 EOS -> rows x = [5 6 7 0], [0 8 9 0]
    np.testing.assert_array_equal(rows["tokens"], [[5, 6, 7], [0, 8, 9]])
    np.testing.assert_array_equal(rows["targets"], [[6, 7, 0], [8, 9, 0]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1], [1, 2, 2]])
    np.testing.assert_array_equal(rows["mask"], [[1, 1, 1], [0, 1, 1]])


def test_shapes_dtypes_and_shift():
    docs = random_docs(0)
    T = 16
    corpus = TokenizedCorpus.from_documents(docs, eos_id=EOS, vocab_size=256)
    src = PackedSource(corpus, T)
    assert len(src) == (len(corpus.tokens) - 1) // T
    rows = [src[i] for i in range(len(src))]
    for r in rows:
        assert set(r) == set(FIELDS)
        for k in ("tokens", "targets", "segment_ids"):
            assert r[k].shape == (T,) and r[k].dtype == np.int32
        assert r["mask"].shape == (T,) and r["mask"].dtype == np.float32
        np.testing.assert_array_equal(r["targets"][:-1], r["tokens"][1:])
    for a, b in zip(rows, rows[1:]):
        assert a["targets"][-1] == b["tokens"][0]  # rows overlap by one token
    stream = np.concatenate([r["tokens"] for r in rows] + [rows[-1]["targets"][-1:]])
    np.testing.assert_array_equal(stream, corpus.tokens[: len(stream)])
    with pytest.raises(IndexError):
        src[len(src)]


def test_segments_and_mask_follow_eos():
    docs = random_docs(1)
    rows = pack_documents(docs, seq_len=24, eos_id=EOS, vocab_size=256)
    tokens, seg, mask = rows["tokens"], rows["segment_ids"], rows["mask"]
    is_eos = tokens == EOS
    assert is_eos.sum() > 10  # boundaries do occur
    # The id changes exactly after an EOS, by +1, and starts at 1 in every row.
    np.testing.assert_array_equal(np.diff(seg, axis=1) != 0, is_eos[:, :-1])
    assert (np.diff(seg, axis=1) >= 0).all() and (np.diff(seg, axis=1) <= 1).all()
    assert (seg[:, 0] == 1).all()
    # The target after an EOS is the next document's first token: masked.
    np.testing.assert_array_equal(mask == 0, is_eos)
    assert set(np.unique(mask)) == {0.0, 1.0}


@pytest.mark.parametrize("seed, T", [(2, 8), (3, 1), (4, 37)])
def test_rows_match_a_direct_reference(seed, T):
    """Every field of every row against the module doc's definition, computed here from the documents:
    the stream ``doc_0 EOS doc_1 EOS ...``, row ``i`` its window ``[i*T, i*T + T]``, a token's document
    the number of EOS before it; rows read in a random order equal ``pack_documents``'."""
    docs = random_docs(seed)
    stream = np.concatenate([np.append(np.asarray(d), EOS) for d in docs])
    doc_of = np.concatenate([[0], np.cumsum(stream == EOS)[:-1]])   # EOS strictly before each position
    n = (len(stream) - 1) // T
    rows = pack_documents(docs, seq_len=T, eos_id=EOS, vocab_size=256)
    assert all(rows[k].shape == (n, T) for k in FIELDS)
    src = PackedSource(TokenizedCorpus.from_documents(docs, eos_id=EOS, vocab_size=256), T)
    for i in np.random.default_rng(seed).permutation(n):
        x, d = stream[i * T: i * T + T + 1], doc_of[i * T: i * T + T + 1]
        want = {"tokens": x[:-1], "targets": x[1:], "segment_ids": d[:-1] - d[0] + 1,
                "mask": (d[1:] == d[:-1]).astype(np.float32)}
        got = src[i]
        for k in FIELDS:
            np.testing.assert_array_equal(rows[k][i], want[k], err_msg=f"row {i} {k}")
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"row {i} {k}")


def test_bad_arguments():
    corpus = TokenizedCorpus.from_documents([[1, 2, 3]], eos_id=EOS, vocab_size=256)
    with pytest.raises(ValueError, match="seq_len"):
        PackedSource(corpus, 0)
    with pytest.raises(ValueError, match="seq_len"):
        PackedSource(corpus, 4)  # 4 tokens in the stream: no row of 4 + 1
    with pytest.raises(ValueError, match="corpus"):
        PackedSource([[1, 2, 3]], 2)
    with pytest.raises(ValueError, match="documents"):
        pack_documents([[1, -2]], seq_len=2, eos_id=EOS, vocab_size=256)
