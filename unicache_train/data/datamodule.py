"""``LMDataModule``: documents -> tokens -> batches for causal-LM training.

Shape legend: B, T = batch size, ``DataConfig.seq_len``.

::

    source ("synthetic" | .txt/.jsonl/.json/.parquet paths, globs, dirs)
      └─► HF datasets (load_dataset / synthetic_corpus): columns text [, split_char, question_char]
            └─► seeded document-level train/val split (val_fraction, seed)
                  └─► datasets.map(batched) tokenize: [bos] + ids + [eos] per document; a text
                      with a split is tokenized piecewise so the split lands on a token boundary
                        ├─ pack=True:  concatenate, cut blocks of T + 1 tokens (stride T)
                        └─ pack=False: one record per row, truncated / padded to T

Every batch is a dict of ``torch.long`` tensors:

* ``input_ids``: [B, T] token ids (``pad_token_id`` on padding);
* ``labels``: [B, T] next-token targets, already shifted (``labels[:, t]`` is the token after
  ``input_ids[:, t]``); -100 = ignore (padding, the last token of a record, and the prompt when
  ``prompt_loss=False``);
* ``modality_ids``: [B, T] zeros (text);
* ``split``: [B] index of the first continuation token (the model's ``split``), -1 = none (packed
  blocks, stories, local records without a ``split_char`` column, and records whose split fell
  past ``seq_len``).

Notes for the trainer:

* ``split == -1`` means the data gives no split: sample one
  (docs/architecture.md#in-loop-semantics) or run uncompressed.
* The first continuation token is predicted at position ``split - 1`` (a context query, which
  attends to the full context): ``labels[b, split - 1]`` is the first answer token. A loss "on
  the continuation" should therefore start at ``split - 1``. To make even that prediction go
  through the compressed cache, use ``split_at="question"`` (the question then belongs to the
  continuation, as in question-agnostic compression).
* Data order is a pure function of ``DataConfig.seed`` and the epoch (:class:`SeededSampler`,
  a ``DistributedSampler``, so Lightning leaves it alone under DDP and every rank reads its own
  shard). Mid-epoch resumption is exact: the train loader (:class:`ResumableDataLoader`) follows
  Lightning's dataloader ``state_dict`` protocol, so every checkpoint records the epoch and the
  batches trained in it, and the restored loader starts at the next batch. Lightning loads that
  state into the loader it creates after the restore; if ``configure_optimizers`` reads
  ``trainer.estimated_stepping_batches`` the loader is created earlier and the state is dropped
  (Lightning issue #20550): derive schedules from ``max_steps``. Resuming with another world
  size or other data settings continues approximately (a warning says so).
* Every document is framed ``[bos] ids [eos]`` (bos only when the tokenizer has one distinct
  from eos): encode inference prompts with ``tokenizer.encode(prompt, add_bos=True)``.
* Tokens are held in memory as int32 (4 bytes per token), so a local corpus must fit in RAM.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from unicache_train.data.config import DataConfig
from unicache_train.data.synthetic import synthetic_corpus
from unicache_train.data.tokenizer import Tokenizer, load_tokenizer
from unicache_train.validation import ConfigError

__all__ = [
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

IGNORE_INDEX = -100
_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SPLIT_COLUMNS = ("split_char", "question_char")


# --------------------------------------------------------------------------------- documents
def resolve_data_files(source: str | Sequence[str]) -> tuple[str, list[str]]:
    """Expand paths, globs and directories into a sorted file list and its ``datasets`` loader.

    Returns:
        ``(loader, files)`` with loader ``"text"``, ``"json"`` or ``"parquet"``.

    Raises:
        FileNotFoundError: a path does not exist, a glob or a directory matches no data file.
        ValueError: unsupported extension, or files that need different loaders.
    """
    items = [source] if isinstance(source, str) else list(source)
    files: list[str] = []
    for item in items:
        path = os.path.expanduser(item)
        if glob.has_magic(path):
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"DataConfig.source: the glob {item!r} matches no file")
            files.extend(matches)
        elif os.path.isdir(path):
            matches = sorted(
                str(p) for p in Path(path).rglob("*") if p.is_file() and p.suffix in _LOADERS
            )
            if not matches:
                raise FileNotFoundError(
                    f"DataConfig.source: the directory {item!r} holds no {'/'.join(_LOADERS)} file"
                )
            files.extend(matches)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"DataConfig.source: no such file or directory: {item!r}")
    loaders = {}
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in _LOADERS:
            raise ValueError(
                f"DataConfig.source: unsupported file type {f!r}; supported: {sorted(_LOADERS)}"
            )
        loaders.setdefault(_LOADERS[suffix], f)
    if len(loaders) > 1:
        raise ValueError(
            f"DataConfig.source mixes file types that need different loaders: {loaders}"
        )
    return next(iter(loaders)), files


def _is_blank(path: str, max_read: int = 1 << 20) -> bool:
    """True when the file is empty or holds only whitespace (files over ``max_read`` bytes are
    taken as non-blank without reading them)."""
    size = os.path.getsize(path)
    if size == 0:
        return True
    if size > max_read:
        return False
    with open(path, "rb") as fh:
        return not fh.read().strip()


def first_bad_line(files: Sequence[str], loader: str) -> str | None:
    """``"FILE line N: problem"`` for the first line of ``files`` that is not UTF-8 or (loader
    ``json`` on ``.jsonl``) not one JSON object; a ``.json`` file is parsed whole. None when
    every line reads (parquet files are not scanned)."""
    for f in files:
        if loader == "parquet":
            continue
        whole_json = loader == "json" and not f.endswith(".jsonl")
        with open(f, "rb") as fh:
            raw = fh.read() if whole_json else None
            lines = [raw] if whole_json else fh
            for n, line in enumerate(lines, 1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    at = n if not whole_json else line[: err.start].count(b"\n") + 1
                    return f"{f} line {at}: not UTF-8 text (byte {err.start} of the line)"
                if loader != "json" or not text.strip():
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as err:
                    at = n if not whole_json else err.lineno
                    return f"{f} line {at}: invalid JSON ({err.msg})"
                except RecursionError:
                    return f"{f} line {n}: JSON nested too deeply to read"
                if not whole_json and not isinstance(value, dict):
                    return (
                        f"{f} line {n}: expected a JSON object per line, got {type(value).__name__}"
                    )
    return None


def load_documents(cfg: DataConfig, cache_dir: str | None = None) -> datasets.Dataset:
    """The documents of ``cfg.source`` as a dataset with a ``text`` column.

    ``split_char`` / ``question_char`` columns (character offsets, -1 = none) are kept when the
    source has them (the synthetic corpus does); ``None`` and empty texts are dropped.

    Args:
        cfg: the data config.
        cache_dir: where ``datasets`` caches the parsed files (default: its own cache).

    Raises:
        FileNotFoundError: see :func:`resolve_data_files`.
        ConfigError: ``cfg.text_field`` is not a column; the message lists the columns found.
    """
    if cfg.source == "synthetic":
        ds = synthetic_corpus(cfg.synthetic)
    else:
        loader, files = resolve_data_files(cfg.source)
        for f in files:
            if _is_blank(f):
                # NOTE: checked here: `datasets` fails on an empty JSON file with a bare
                # StopIteration deep inside its builder.
                raise ConfigError(f"DataConfig.source: {f!r} has no records (the file is empty)")
        kwargs: dict[str, Any] = {}
        if loader == "text":
            kwargs["sample_by"] = cfg.text_sample_by
        try:
            ds = datasets.load_dataset(
                loader, data_files=files, split="train", cache_dir=cache_dir, **kwargs
            )
            ds = _text_documents(ds, cfg, files)
        except ConfigError:
            raise
        except Exception as err:
            # `datasets` names neither the file nor the line (DatasetGenerationError, ArrowInvalid,
            # a UnicodeDecodeError when the column is read); find them. A failure with no bad
            # line behind it propagates.
            bad = first_bad_line(files, loader)
            if bad is None:
                raise
            raise ConfigError(f"DataConfig.source: {bad}") from err
        return ds
    return _text_documents(ds, cfg, [])


def _text_documents(ds: datasets.Dataset, cfg: DataConfig, files: list[str]) -> datasets.Dataset:
    """The ``text`` column (+ split columns) of ``ds``, empty and None texts dropped."""
    if cfg.source != "synthetic":
        if cfg.text_field not in ds.column_names:
            where = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
            raise ConfigError(
                f"DataConfig.text_field={cfg.text_field!r} is not a column of {where}; "
                f"columns found: {ds.column_names}"
            )
    keep = [cfg.text_field] + [c for c in _SPLIT_COLUMNS if c in ds.column_names]
    ds = ds.select_columns(keep)
    if cfg.text_field != "text":
        ds = ds.rename_column(cfg.text_field, "text")
    return ds.filter(
        lambda batch: [isinstance(t, str) and len(t) > 0 for t in batch["text"]],
        batched=True,
        keep_in_memory=True,
    )


# --------------------------------------------------------------------------------- tokenizing
def _encode_batch(batch: dict[str, list], tokenizer: Tokenizer) -> dict[str, list]:
    """Tokenize documents; those with split offsets are tokenized piece by piece."""
    texts: list[str] = batch["text"]
    n = len(texts)
    split_chars = batch.get("split_char") or [-1] * n
    question_chars = batch.get("question_char") or [-1] * n
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    # A bos equal to eos (GPT-2 style) would double the separator between packed documents.
    prefix = [bos] if bos is not None and bos != eos else []
    suffix = [eos] if eos is not None else []

    pieces: list[str] = []
    layouts: list[list[int]] = []  # per document: the character cuts, in order
    for text, s, q in zip(texts, split_chars, question_chars):
        cuts = sorted({c for c in (s, q) if c is not None and c >= 0})
        if cuts and cuts[-1] > len(text):
            raise ValueError(f"split offset {cuts[-1]} is past the end of a {len(text)}-char text")
        bounds = [0, *cuts, len(text)]
        pieces.extend(text[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
        layouts.append(cuts)
    encoded = tokenizer.encode_batch(pieces)

    input_ids, split_tok, question_tok = [], [], []
    i = 0
    for cuts, s, q in zip(layouts, split_chars, question_chars):
        ids = list(prefix)
        token_at: dict[int, int] = {}
        for c in cuts:
            ids.extend(encoded[i])
            i += 1
            token_at[c] = len(ids)  # the first token of the piece starting at char c
        ids.extend(encoded[i])
        i += 1
        ids.extend(suffix)
        input_ids.append(ids)
        split_tok.append(token_at.get(s, -1) if s is not None and s >= 0 else -1)
        question_tok.append(token_at.get(q, -1) if q is not None and q >= 0 else -1)
    return {"input_ids": input_ids, "split_tok": split_tok, "question_tok": question_tok}


def tokenize_documents(ds: datasets.Dataset, tokenizer: Tokenizer) -> datasets.Dataset:
    """Add ``input_ids`` (``[bos] + ids + [eos]``), ``split_tok`` and ``question_tok``.

    ``split_tok`` / ``question_tok`` are the token indices of ``split_char`` / ``question_char``
    (-1 when absent): the prompt and the answer are tokenized separately, so the index is exactly
    the tokenized prompt length and never falls inside a token.
    """
    return ds.map(
        _encode_batch,
        batched=True,
        batch_size=1000,
        fn_kwargs={"tokenizer": tokenizer},
        remove_columns=ds.column_names,
        keep_in_memory=True,  # tokens end up in RAM anyway; no stale cache files on disk
        desc="tokenize",
    )


def _ragged(ds: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """The ``input_ids`` column as (flat int32 values, int64 offsets [N + 1])."""
    if len(ds) == 0:
        return np.zeros(0, np.int32), np.zeros(1, np.int64)
    column = ds.with_format("arrow")[:]["input_ids"]  # respects any indices mapping
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    lengths = arr.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets


# --------------------------------------------------------------------------------- datasets
class PackedDataset(Dataset):
    """Fixed blocks of ``seq_len + 1`` tokens cut from one token stream with stride ``seq_len``.

    Consecutive blocks overlap by one token, so every token except the first is a target exactly
    once. The tail that does not fill a block is dropped.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_blocks = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_blocks:
            raise IndexError(i)
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]  # [T + 1]


class RecordDataset(Dataset):
    """One tokenized record per item with its split token index (-1 = none)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, splits: np.ndarray) -> None:
        self.tokens = tokens
        self.offsets = offsets
        self.splits = splits

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]], int(self.splits[i])


@dataclass
class PackedCollator:
    """Stack blocks [T + 1] into ``input_ids`` / ``labels`` [B, T] (labels already shifted)."""

    def __call__(self, items: list[np.ndarray]) -> dict[str, torch.Tensor]:
        blocks = torch.from_numpy(np.stack(items)).long()  # [B, T + 1]
        input_ids = blocks[:, :-1].contiguous()  # [B, T]
        return {
            "input_ids": input_ids,
            "labels": blocks[:, 1:].contiguous(),  # [B, T]
            "modality_ids": torch.zeros_like(input_ids),
            "split": torch.full((len(items),), -1, dtype=torch.long),  # [B]
        }


@dataclass
class PaddedCollator:
    """Truncate / pad records to ``seq_len``; labels -100 on padding (and on the prompt).

    Args:
        seq_len: T.
        pad_token_id: input id on padded positions (their labels are -100).
        prompt_loss: False puts -100 on labels before ``split - 1`` for records with a split.
    """

    seq_len: int
    pad_token_id: int
    prompt_loss: bool = True

    def __call__(self, items: list[tuple[np.ndarray, int]]) -> dict[str, torch.Tensor]:
        T = self.seq_len
        input_ids = np.full((len(items), T), self.pad_token_id, dtype=np.int64)  # [B, T]
        labels = np.full((len(items), T), IGNORE_INDEX, dtype=np.int64)  # [B, T]
        split = np.full(len(items), -1, dtype=np.int64)  # [B]
        for b, (ids, s) in enumerate(items):
            inp, lab = ids[:T], ids[1 : T + 1]
            input_ids[b, : len(inp)] = inp
            labels[b, : len(lab)] = lab
            if 0 < s < T:  # a split at or past T leaves no continuation inside the window
                split[b] = s
                if not self.prompt_loss:
                    labels[b, : s - 1] = IGNORE_INDEX
        input_ids_t = torch.from_numpy(input_ids)
        return {
            "input_ids": input_ids_t,
            "labels": torch.from_numpy(labels),
            "modality_ids": torch.zeros_like(input_ids_t),
            "split": torch.from_numpy(split),
        }


# --------------------------------------------------------------------------------- sampling
class SeededSampler(DistributedSampler):
    """The train order: a permutation drawn from ``seed + epoch``, sharded over ranks.

    A :class:`~torch.utils.data.DistributedSampler` (same permutation, padding and sharding), so
    Lightning keeps it under DDP instead of wrapping it, and calls :meth:`set_epoch` each epoch.
    :meth:`resume_at` makes the next iteration of one epoch start after the samples this rank
    already consumed; ``len()`` stays the full epoch so Lightning's batch counters line up.
    """

    def __init__(
        self,
        dataset: Dataset,
        seed: int,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._resume_epoch = -1
        self._resume_offset = 0

    def resume_at(self, epoch: int, offset: int) -> None:
        """Start epoch ``epoch`` at this rank's ``offset``-th sample (applies to one iteration)."""
        self.set_epoch(epoch)
        self._resume_epoch, self._resume_offset = epoch, offset

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start = self._resume_offset if self._resume_epoch == self.epoch else 0
        self._resume_epoch, self._resume_offset = -1, 0  # one-shot: later epochs start at 0
        return iter(indices[start:])


# --------------------------------------------------------------------------------- datamodule
class LMDataModule(L.LightningDataModule):
    """Causal-LM batches from :class:`~unicache_train.data.config.DataConfig` (see the module doc).

    Args:
        config: the data config.
        tokenizer: a tokenizer; default ``load_tokenizer(config.tokenizer)``.
        cache_dir: cache directory for ``datasets.load_dataset`` on local files.

    Attributes (after :meth:`setup`):
        train_dataset, val_dataset: :class:`PackedDataset` or :class:`RecordDataset`.
        stats: document / token / block counts and truncated splits, for logging.
    """

    def __init__(
        self,
        config: DataConfig | None = None,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.config = config or DataConfig()
        self.tokenizer = (
            tokenizer if tokenizer is not None else load_tokenizer(self.config.tokenizer)
        )
        self.cache_dir = cache_dir
        self.train_dataset: PackedDataset | RecordDataset | None = None
        self.val_dataset: PackedDataset | RecordDataset | None = None
        self.stats: dict[str, int] = {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    # ----------------------------------------------------------------------------- setup
    def setup(self, stage: str | None = None) -> None:
        """Load, split and tokenize once (idempotent; every rank builds the same datasets)."""
        if self.train_dataset is not None:
            return
        cfg = self.config
        docs = load_documents(cfg, self.cache_dir)
        if cfg.split_at == "question" and "split_char" in docs.column_names:
            if "question_char" not in docs.column_names:
                raise ConfigError(
                    "DataConfig.split_at='question' needs a 'question_char' column next to "
                    f"'split_char'; columns found: {docs.column_names}"
                )
        n = len(docs)
        if n == 0:
            raise ConfigError(
                f"DataConfig.source={cfg.source!r} has no records: no non-empty text in its "
                f"{cfg.text_field!r} field"
            )
        # Document-level split: no document is shared by train and val, even when packed.
        n_val = round(n * cfg.val_fraction)
        if cfg.val_fraction > 0:
            n_val = min(max(n_val, 1), n - 1)
        perm = np.random.default_rng(cfg.seed).permutation(n)
        train_docs = tokenize_documents(docs.select(perm[n_val:]), self.tokenizer)
        val_docs = tokenize_documents(docs.select(perm[:n_val]), self.tokenizer)
        self.train_dataset = self._build(train_docs, "train")
        self.val_dataset = self._build(val_docs, "val")
        if len(self.train_dataset) == 0:
            raise ConfigError(
                f"DataConfig.source={cfg.source!r} gives no training example: "
                f"{self.stats['train_tokens']} train tokens cannot fill one block of "
                f"DataConfig.seq_len + 1 = {cfg.seq_len + 1}; lower seq_len or add data"
            )
        if cfg.val_fraction > 0 and len(self.val_dataset) == 0:
            warnings.warn(
                f"DataConfig.val_fraction={cfg.val_fraction} gave no validation example "
                f"({n} documents, {self.stats['val_tokens']} val tokens); validation is skipped",
                stacklevel=2,
            )

    def _build(self, ds: datasets.Dataset, name: str) -> PackedDataset | RecordDataset:
        cfg = self.config
        tokens, offsets = _ragged(ds)
        self.stats[f"{name}_documents"] = len(offsets) - 1
        self.stats[f"{name}_tokens"] = int(len(tokens))
        if cfg.pack:
            out: PackedDataset | RecordDataset = PackedDataset(tokens, cfg.seq_len)
            self.stats[f"{name}_blocks"] = len(out)
            return out
        column = "question_tok" if cfg.split_at == "question" else "split_tok"
        splits = np.asarray(ds[column], dtype=np.int64) if len(ds) else np.zeros(0, np.int64)
        truncated = int((splits >= cfg.seq_len).sum())
        self.stats[f"{name}_truncated_splits"] = truncated
        if truncated:
            warnings.warn(
                f"{truncated} of {int((splits >= 0).sum())} {name} records split past "
                f"seq_len={cfg.seq_len}; they train without a split (raise seq_len or shorten "
                "the records)",
                stacklevel=3,
            )
        splits = np.where(splits < cfg.seq_len, splits, -1)
        self.stats[f"{name}_records"] = len(splits)
        return RecordDataset(tokens, offsets, splits)

    # ----------------------------------------------------------------------------- loaders
    def _collate(self) -> PackedCollator | PaddedCollator:
        if self.config.pack:
            return PackedCollator()
        return PaddedCollator(
            self.config.seq_len, self.tokenizer.pad_token_id, self.config.prompt_loss
        )

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def _loader(self, dataset: Dataset, sampler: SeededSampler | None) -> DataLoader:
        workers = self.config.num_workers
        cls = ResumableDataLoader if sampler is not None else DataLoader
        loader = cls(
            dataset,
            batch_size=self.config.batch_size,
            sampler=sampler,
            shuffle=False,
            collate_fn=self._collate(),
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
            drop_last=False,
        )
        if isinstance(loader, ResumableDataLoader):
            loader.datamodule = self
        return loader

    def train_dataloader(self) -> DataLoader:
        """Shuffled by :class:`SeededSampler` (seed ``DataConfig.seed``), resumable mid-epoch."""
        self.setup()
        assert self.train_dataset is not None
        num_replicas, rank = self._world()
        sampler = SeededSampler(
            self.train_dataset, self.config.seed, num_replicas=num_replicas, rank=rank
        )
        return self._loader(self.train_dataset, sampler)

    def val_dataloader(self) -> DataLoader | list:
        """In order, not shuffled; ``[]`` (no validation) when the validation split is empty."""
        self.setup()
        assert self.val_dataset is not None
        if len(self.val_dataset) == 0:
            return []
        return self._loader(self.val_dataset, None)

    # ----------------------------------------------------------------------------- resume
    def train_position(self) -> dict[str, Any]:
        """Where the train order stands: data settings, epoch and batches trained this epoch."""
        state: dict[str, Any] = {
            "seed": self.config.seed,
            "batch_size": self.config.batch_size,
            "num_train": len(self.train_dataset) if self.train_dataset is not None else -1,
        }
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            state["world_size"] = trainer.world_size
            state["epoch"] = trainer.current_epoch
            # Batches whose training step finished in this epoch. Lightning has already
            # prefetched the next one; counting it would skip it on resume.
            state["batches"] = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return state

    def resume_sampler(self, sampler: SeededSampler, state: dict[str, Any]) -> None:
        """Make ``sampler``'s next iteration continue from the saved :meth:`train_position`."""
        if "epoch" not in state:
            return
        current = {"seed": self.config.seed, "num_train": len(sampler.dataset)}
        changed = {k: (state.get(k), v) for k, v in current.items() if state.get(k) != v}
        if changed:
            warnings.warn(
                f"resuming with different data settings {changed} (saved, now): the train order "
                "restarts from the saved epoch's beginning",
                stacklevel=2,
            )
            sampler.resume_at(state["epoch"], 0)
            return
        # Samples of the epoch's permutation trained on, over all ranks. Every world size shards
        # the permutation the same way (rank r takes samples r, r + W, r + 2W, ...), so the next
        # sample is the same whatever the number of ranks and the per-rank batch are now.
        done = state["batches"] * state["batch_size"] * state.get("world_size", 1)
        consumed, skew = divmod(done, sampler.num_replicas)  # consumed: per rank
        if skew:
            warnings.warn(
                f"resuming on {sampler.num_replicas} ranks after {done} samples of the epoch, "
                f"not a multiple of {sampler.num_replicas}: {skew} samples are trained again",
                stacklevel=2,
            )
        if consumed >= sampler.num_samples:  # saved after the last batch of the epoch
            sampler.resume_at(state["epoch"] + 1, 0)
        else:
            sampler.resume_at(state["epoch"], consumed)


class ResumableDataLoader(DataLoader):
    """The train loader; Lightning saves its position in checkpoints (``state_dict`` protocol).

    Lightning calls :meth:`state_dict` when it writes a checkpoint and :meth:`load_state_dict`
    on the fresh loader before its first iteration after a restore, which is when the sampler
    can still be moved.
    """

    datamodule: LMDataModule | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.train_position() if self.datamodule is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.datamodule is not None and isinstance(self.sampler, SeededSampler):
            self.datamodule.resume_sampler(self.sampler, state_dict)
