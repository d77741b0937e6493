"""Data: tokenizers, the bundled synthetic corpus and the Lightning data module.

Nothing heavy runs at import: the corpus is generated and tokenized in
:meth:`LMDataModule.setup`, and the names below are resolved on first use (PEP 562), so that
importing :mod:`unicache_train.data.tokenizer` (the serving side) does not import Lightning
through the data module.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    **dict.fromkeys(
        (
            "LMDataModule",
            "PackedCollator",
            "PackedDataset",
            "PaddedCollator",
            "RecordDataset",
            "ResumableDataLoader",
            "SeededSampler",
            "load_documents",
            "resolve_data_files",
            "tokenize_documents",
        ),
        "datamodule",
    ),
    **dict.fromkeys(
        ("normalize_answer", "recall_examples", "score_recall", "stories", "synthetic_corpus"),
        "synthetic",
    ),
    **dict.fromkeys(("ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"), "tokenizer"),
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
