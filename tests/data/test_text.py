import numpy as np
import pytest

from lineage_jax.data import text
from lineage_jax.data.tokenizers import get_tokenizer


def test_stdlib_corpus_nonempty_deterministic_and_disjoint():
    train = text.stdlib_corpus("train")
    val = text.stdlib_corpus("val")
    everything = text.stdlib_corpus("all")
    assert len(train) > 100 and len(val) >= 1
    assert train.names == text.stdlib_corpus("train").names  # deterministic
    assert list(train.names) == sorted(train.names)
    assert not set(train.names) & set(val.names)
    assert set(train.names) | set(val.names) == set(everything.names)
    assert "os.py" in everything.names
    for name in everything.names:
        parts = name.split("/")
        assert name.endswith(".py")
        assert not {"site-packages", "test", "tests", "__pycache__"} & set(parts), name
    assert 0 < len(val) / len(everything) < 0.06
    doc = train[train.names.index("os.py")] if "os.py" in train.names else val[val.names.index("os.py")]
    assert "def " in doc and isinstance(doc, str)


def test_split_files_properties():
    names = [f"dir{i % 7}/file_{i}.txt" for i in range(5000)]
    val = text.split_files(names, "val", 0.02)
    train = text.split_files(names, "train", 0.02)
    assert set(val).isdisjoint(train) and set(val) | set(train) == set(names)
    assert 50 < len(val) < 150  # ~100 expected (binomial sd ~10)
    # Stable when files are added: existing files keep their split.
    more = names + [f"new/file_{i}.txt" for i in range(500)]
    assert set(val) <= set(text.split_files(more, "val", 0.02))
    # Never empty, even when no hash falls below the fraction.
    two = ["a.txt", "b.txt"]
    assert len(text.split_files(two, "val", 1e-9)) == 1 and len(text.split_files(two, "train", 1e-9)) == 1


def test_split_files_bad_arguments():
    with pytest.raises(ValueError, match="rel_paths"):
        text.split_files(["only.txt"], "val")
    with pytest.raises(ValueError, match="split"):
        text.split_files(["a", "b"], "test")
    with pytest.raises(ValueError, match="val_fraction"):
        text.split_files(["a", "b"], "val", 1.5)


def test_directory_corpus(tmp_path):
    for i in range(30):
        (tmp_path / f"sub{i % 3}").mkdir(exist_ok=True)
        (tmp_path / f"sub{i % 3}" / f"doc{i}.txt").write_text(f"document {i} ✓\n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("markdown", encoding="utf-8")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config.txt").write_text("git", encoding="utf-8")

    everything = text.directory_corpus(tmp_path, "all")
    assert len(everything) == 31 and "notes.md" in everything.names
    assert "blob.bin" not in everything.names
    assert not any(n.startswith(".") or "/." in n for n in everything.names)
    txt = text.directory_corpus(tmp_path, "all", suffixes=(".txt",))
    assert len(txt) == 30
    train, val = text.directory_corpus(tmp_path, "train"), text.directory_corpus(tmp_path, "val")
    assert len(val) >= 1 and set(train.names) | set(val.names) == set(everything.names)
    i = everything.names.index("sub0/doc0.txt")
    assert everything[i] == "document 0 ✓\n"
    with pytest.raises(ValueError, match="path"):
        text.directory_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="suffixes"):
        text.directory_corpus(tmp_path, suffixes=".txt")


def test_array_record_roundtrip(tmp_path):
    docs = ["first document", "ünïcödé 🤖", "", "line\nbreaks\n"]
    path = tmp_path / "docs.array_record"
    assert text.write_array_record(path, docs) == 4
    corpus = text.ArrayRecordCorpus(path)
    assert len(corpus) == 4 and list(corpus) == docs and corpus[1] == docs[1]
    both = text.ArrayRecordCorpus([path, path])
    assert list(both) == docs + docs
    assert list(text.load_corpus(str(path), "all")) == docs
    with pytest.raises(ValueError, match="documents"):
        text.write_array_record(tmp_path / "bad.array_record", ["ok", b"bytes"])
    with pytest.raises(ValueError, match="paths"):
        text.ArrayRecordCorpus(tmp_path / "nope.array_record")


def test_array_record_train_and_val_are_disjoint_record_splits(tmp_path):
    """--data FILE.array_record validates on held-out records, not on the training stream: the two splits
    partition the records (in record order), val is about val_fraction of them, and records appended in a
    second file leave the first file's split as it was."""
    docs = [f"document {i}" for i in range(400)]
    a, b = tmp_path / "a.array_record", tmp_path / "b.array_record"
    text.write_array_record(a, docs)
    text.write_array_record(b, [f"more {i}" for i in range(100)])
    train, val = (list(text.load_corpus(str(a), split)) for split in ("train", "val"))
    assert sorted(train + val, key=docs.index) == docs and not set(train) & set(val)
    assert train == [d for d in docs if d in train] and 2 <= len(val) <= 20  # record order; ~2% of 400
    assert text.ArrayRecordCorpus(a, "val").names == tuple(f"record_{docs.index(d)}" for d in val)
    train2, val2 = (list(text.load_corpus(f"{a},{b}", split)) for split in ("train", "val"))
    assert [d for d in val2 if d in docs] == val and [d for d in train2 if d in docs] == train
    assert list(text.load_corpus(str(a), "val", val_fraction=0.5)) != val  # the fraction is applied
    text.write_array_record(tmp_path / "one.array_record", ["only"])
    with pytest.raises(ValueError, match="need at least 2 records"):
        text.ArrayRecordCorpus(tmp_path / "one.array_record", "val")
    with pytest.raises(ValueError, match="split"):
        text.ArrayRecordCorpus(a, "test")


def test_tokenize_corpus_byte_and_gpt2(tmp_path):
    docs = ["abc", "", "héllo wörld", "x"]
    tc = text.tokenize_corpus(docs, "byte")
    assert tc.eos_id == 0 and tc.vocab_size == 256 and tc.num_documents == 3  # the empty doc is skipped
    expected = list(b"abc") + [0] + list("héllo wörld".encode()) + [0] + list(b"x") + [0]
    assert tc.tokens.tolist() == expected
    assert tc.doc_ends.tolist() == [4, 4 + 14, 4 + 14 + 2]  # each document + its EOS
    assert bytes(tc.document(1).tolist()).decode() == "héllo wörld"

    g = text.tokenize_corpus(docs, "gpt2")
    tok = get_tokenizer("gpt2")
    assert g.eos_id == 50256 and g.tokens.dtype == np.uint16
    assert [tok.decode(g.document(i).tolist()) for i in range(3)] == ["abc", "héllo wörld", "x"]
    assert (g.tokens[g.doc_ends - 1] == 50256).all()

    g.save(tmp_path / "cache.npz")
    back = text.TokenizedCorpus.load(tmp_path / "cache.npz")
    assert np.array_equal(back.tokens, g.tokens) and np.array_equal(back.doc_ends, g.doc_ends)
    assert (back.eos_id, back.vocab_size) == (50256, 50257)

    with pytest.raises(ValueError, match="max_documents"):
        text.tokenize_corpus(docs, "byte", max_documents=0)
    with pytest.raises(ValueError, match="eos_id"):
        text.TokenizedCorpus.from_documents([[1, 2]], eos_id=300, vocab_size=256)
    with pytest.raises(ValueError, match="documents"):
        text.TokenizedCorpus.from_documents([[1, 256]], eos_id=0, vocab_size=256)


def test_stdlib_val_tokenizes():
    val = text.stdlib_corpus("val")
    tc = text.tokenize_corpus(val, "byte")
    assert tc.num_documents == sum(1 for doc in val if doc)  # empty files (some __init__.py) are skipped
    assert len(tc.tokens) > 1000 and tc.tokens.dtype == np.uint8


def test_load_corpus(tmp_path):
    assert text.load_corpus(None, "val").names == text.stdlib_corpus("val").names
    assert text.load_corpus("stdlib", "train").names == text.stdlib_corpus("train").names
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    assert len(text.load_corpus(tmp_path, "all")) == 2
    with pytest.raises(ValueError, match="data"):
        text.load_corpus(tmp_path / "nothing.json")
    with pytest.raises(ValueError, match="split"):
        text.load_corpus(None, "validation")
