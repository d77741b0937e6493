"""Data: tokenizers, the bundled synthetic corpus and the Lightning data module.

Nothing heavy runs at import: the corpus is generated and tokenized in
:meth:`LMDataModule.setup`.
"""

from unicache_train.data.datamodule import (
    LMDataModule,
    PackedCollator,
    PackedDataset,
    PaddedCollator,
    RecordDataset,
    ResumableDataLoader,
    SeededSampler,
    load_documents,
    resolve_data_files,
    tokenize_documents,
)
from unicache_train.data.synthetic import (
    normalize_answer,
    recall_examples,
    score_recall,
    stories,
    synthetic_corpus,
)
from unicache_train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "stories",
    "recall_examples",
    "synthetic_corpus",
    "score_recall",
    "normalize_answer",
    "LMDataModule",
    "SeededSampler",
    "ResumableDataLoader",
    "PackedDataset",
    "RecordDataset",
    "PackedCollator",
    "PaddedCollator",
    "resolve_data_files",
    "load_documents",
    "tokenize_documents",
]
