"""Evaluation without a Trainer: one job per module; nothing here trains.

- :mod:`~unicache_train.eval.perplexity`: validation perplexity (``unicache-train evaluate``).
- :mod:`~unicache_train.eval.sweep`: quality under KV compression across rates and xKV reductions
  (``evaluate sweep.*``): perplexity on continuations, recall, attention and output KL,
  KV bytes, the quality checks.
- :mod:`~unicache_train.eval.attn_kl`: attention KL between the plain and compressed forwards.
- :mod:`~unicache_train.eval.synthetic_recall`: recall of the bundled synthetic task (tiny
  models), decoded on the real compressed cache.
- :mod:`~unicache_train.eval.recall`: key-value recall for real checkpoints at several
  difficulties, the question decoded **after** the compressed context, greedy exact match.
- :mod:`~unicache_train.eval.text`: continuation perplexity on real English prose held out by
  source (the King James Bible, :mod:`unicache_train.data.eval_text`), context compressed.
- :mod:`~unicache_train.eval.stats`: Wilson intervals, the exact McNemar test, the paired
  bootstrap of a perplexity change.
- :mod:`~unicache_train.eval.prompts`: any task's prompts as JSONL for another harness.
- :mod:`~unicache_train.eval.budget`: settings calibrated to a measured KV-bytes reduction.
- :mod:`~unicache_train.eval.report`: the shared text table and CSV writer, plots, logger
  metrics.
- :mod:`~unicache_train.eval.vlm`: a vision-language model's per-task accuracy under each
  compression variant, answers decoded on the real compressed cache.

The real-checkpoint tasks return an accumulator with the estimate, its interval and the per-prompt
(per-block) results that paired tests read.
"""

# The task definitions live in data/ (training builds from them too); re-exported here because
# callers pick a task and run it in one place.
from unicache_train.data.recall_task import RecallTask, recall_records
from unicache_train.data.reference_text import reference_documents
from unicache_train.eval.recall import RecallResult, run_recall
from unicache_train.eval.stats import binomial_stderr
from unicache_train.eval.text import TextResult, run_text_perplexity

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
