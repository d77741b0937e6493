"""Evaluation tasks for real checkpoints: key-value recall and held-out text perplexity.

Each task is a function of (model, tokenizer, compressor, seeds) that returns an accumulator
with the estimate and its standard error; nothing here trains or writes files.

- :mod:`~unicache_train.eval.recall`: key-value recall prompts at several difficulties, the
  question decoded **after** the compressed context (so only the context is compressed), greedy
  exact match.
- :mod:`~unicache_train.eval.text`: continuation perplexity on real English prose (the Python
  Language Reference shipped with CPython, ``pydoc_data.topics``), context compressed.
"""

from unicache_train.eval.recall import RecallResult, RecallTask, recall_records, run_recall
from unicache_train.eval.stats import binomial_stderr
from unicache_train.eval.text import TextResult, reference_documents, run_text_perplexity

__all__ = [
    "RecallResult",
    "RecallTask",
    "TextResult",
    "binomial_stderr",
    "recall_records",
    "reference_documents",
    "run_recall",
    "run_text_perplexity",
]
