"""The data section of a run: the bundled synthetic corpus or local files, the tokenizer,
sequence length, batching and splits (see :mod:`unicache_train.data.datamodule`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from unicache_train.validation import (
    ConfigBase,
    ConfigError,
    check_choice,
    check_int,
    check_range,
)


@dataclass
class SyntheticDataConfig(ConfigBase):
    """The bundled synthetic corpus: grammar stories and key-value recall prompts.

    See :mod:`unicache_train.data.synthetic`. Stories have ``story_min_sentences`` to
    ``story_max_sentences`` sentences (~50 bytes each; defaults give 330-770 bytes). A recall
    record has about ``11.7 * recall_num_facts + 40 * recall_num_filler + 24.6 *
    recall_num_questions`` bytes (defaults: 200-255, within ``seq_len = 256`` byte tokens).
    """

    seed: int = 1234
    num_stories: int = 2000
    num_recall: int = 2000
    recall_num_facts: int = 12
    recall_num_questions: int = 2
    recall_num_filler: int = 1
    story_min_sentences: int = 8
    story_max_sentences: int = 14

    def __post_init__(self) -> None:
        check_int(self, "seed", 0)
        check_int(self, "num_stories", 0)
        check_int(self, "num_recall", 0)
        if self.num_stories + self.num_recall == 0:
            raise ConfigError("SyntheticDataConfig: num_stories + num_recall must be >= 1")
        check_int(self, "recall_num_facts", 1, 10_000)
        check_int(self, "recall_num_questions", 1, self.recall_num_facts)
        check_int(self, "recall_num_filler", 0, 10_000)
        check_int(self, "story_min_sentences", 4, 1000)
        check_int(self, "story_max_sentences", self.story_min_sentences, 1000)


@dataclass
class DataConfig(ConfigBase):
    """Where the tokens come from and how they are batched.

    ``source`` is ``"synthetic"`` (the bundled corpus, no download) or a path / glob / list of
    local ``.txt``, ``.jsonl``/``.json`` or ``.parquet`` files read with HF ``datasets``.
    ``tokenizer`` is ``"byte"`` (byte-level, needs no files) or a local HF tokenizer directory.
    ``.txt`` files give one document per file (``text_sample_by="document"``), per line or per
    blank-line separated paragraph.

    ``pack=False`` keeps one record per row; records with a ``split_char`` column (the synthetic
    recall prompts, or a local file that has one) get the token index of their split: the first
    answer token (``split_at="answer"``) or the first question token (``split_at="question"``,
    so the question too attends to the compressed context). ``prompt_loss=False`` puts labels
    only on the continuation (``-100`` before position ``split - 1``, whose label is the first
    continuation token).
    """

    source: str | list[str] = "synthetic"
    text_field: str = "text"
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 8
    val_fraction: float = 0.05
    pack: bool = True
    num_workers: int = 0
    seed: int = 0
    text_sample_by: str = "document"
    split_at: str = "answer"
    prompt_loss: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("DataConfig.source is empty; use 'synthetic' or a path/glob")
        if isinstance(self.source, (list, tuple)):
            bad = [s for s in self.source if not isinstance(s, str) or not s]
            if bad:
                raise ConfigError(
                    f"DataConfig.source={self.source!r}: every entry must be a non-empty path "
                    f"or glob string; bad entries: {bad!r}"
                )
            self.source = list(self.source)
        elif not isinstance(self.source, str):
            raise ConfigError(
                f"DataConfig.source={self.source!r}: expected 'synthetic', a path/glob or a list"
            )
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"DataConfig.text_field={self.text_field!r}: expected a column name")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(
                f"DataConfig.tokenizer={self.tokenizer!r}: expected 'byte' or a local directory"
            )
        check_int(self, "seq_len", 2, 1 << 20)
        check_int(self, "batch_size", 1)
        check_range(self, "val_fraction", 0, 1, hi_open=True)
        check_int(self, "num_workers", 0, 256)
        check_int(self, "seed", 0)
        check_choice(self, "text_sample_by", ("document", "line", "paragraph"))
        check_choice(self, "split_at", ("answer", "question"))
        if not isinstance(self.prompt_loss, bool):
            raise ConfigError(f"DataConfig.prompt_loss={self.prompt_loss!r}: expected a bool")
