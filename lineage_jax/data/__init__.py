"""Data: tokenizers, text corpora, packing, the grain pipeline, synthetic recall tasks.

    tok = get_tokenizer("byte")                         # or "gpt2"
    corpus = tokenize_corpus(load_corpus(None, "train"), tok)   # stdlib sources
    it = make_batches(corpus, seq_len=256, batch_size=8, seed=0)
    batch = next(it)   # tokens/targets/segment_ids int32 [B, T], mask float32 [B, T]
    state = it.get_state(); ...; it.set_state(state)    # exact resume

    task = get_task("mqar", vocab_size=8192, seq_len=256, num_kv_pairs=16)
    it = make_batches(task, seq_len=256, batch_size=64, seed=0)

The grain pipeline (``make_batches``, ``make_dataset``, ``BatchIterator``) is imported on first
use: tokenizers, corpora, packing and the synthetic tasks work without grain installed.
"""

from lineage_jax.data.packing import FIELDS, PackedSource, pack_documents
from lineage_jax.data.synthetic import (
    MQAR,
    TASKS,
    FadeProbe,
    MixedHalfLivesProbe,
    OverwriteProbe,
    PasskeyNIAH,
    get_task,
)
from lineage_jax.data.text import (
    ArrayRecordCorpus,
    TextFiles,
    TokenizedCorpus,
    directory_corpus,
    load_corpus,
    split_files,
    stdlib_corpus,
    tokenize_corpus,
    write_array_record,
)
from lineage_jax.data.tokenizers import TOKENIZERS, ByteTokenizer, GPT2Tokenizer, get_tokenizer

__all__ = [
    "FIELDS",
    "PackedSource",
    "pack_documents",
    "BatchIterator",
    "make_batches",
    "make_dataset",
    "MQAR",
    "TASKS",
    "FadeProbe",
    "MixedHalfLivesProbe",
    "OverwriteProbe",
    "PasskeyNIAH",
    "get_task",
    "ArrayRecordCorpus",
    "TextFiles",
    "TokenizedCorpus",
    "directory_corpus",
    "load_corpus",
    "split_files",
    "stdlib_corpus",
    "tokenize_corpus",
    "write_array_record",
    "TOKENIZERS",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "get_tokenizer",
]

_PIPELINE = ("BatchIterator", "make_batches", "make_dataset")


def __getattr__(name: str):
    if name in _PIPELINE:  # imports grain
        from lineage_jax.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
