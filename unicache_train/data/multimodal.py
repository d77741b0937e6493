"""Vision-language batches: the bundled scenes or local (image, text) files -> token rows with
vision positions, pixel tensors and the answer split.

Shape legend: B, T, N, P = batch, tokens (longest row of the batch), image slots, patches per
image.

::

    source "synthetic" ─► data/scenes.py samples (generated on the fly, deterministic by index)
    source DIR | *.parquet ─► HF datasets (imagefolder with metadata.jsonl/csv, or parquet with an
                              image column) ─► resized RGB [3, H, W] in [0, 1] + prompt / answer
          └─► encode: [bos] text ... [<pad> x P per image] ... question answer [eos]
                └─► MultimodalCollator: right-pad to the longest row of the batch

Every batch is a dict:

* ``input_ids`` [B, T] long (``pad_token_id`` at vision positions and padding);
* ``modality_ids`` [B, T] long: 1 at the ``P`` positions of each image, 0 elsewhere;
* ``labels`` [B, T] long, next-token targets, -100 on vision targets, on padding, and (with
  ``prompt_loss=False``, the default) on every target before the answer;
* ``split`` [B] long: first answer token (``split_at="answer"``, the image + question is the
  context) or first token after the last image (``split_at="question"``: the question joins the
  continuation and reads the compressed image cache);
* ``pixel_values`` [B, N, 3, H, W] float, ``image_mask`` [B, N] bool (real images among the
  slots);
* ``task_ids`` [B] long: index in :data:`~unicache_train.data.scenes.TASKS`, -1 for other tasks.

The module subclasses :class:`~unicache_train.data.datamodule.LMDataModule` for its seeded,
resumable train order (``SeededSampler`` + ``ResumableDataLoader``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from unicache_train.data.datamodule import LMDataModule
from unicache_train.data.scenes import IMAGE_MARK, TASKS, SceneConfig, make_sample, scene_words
from unicache_train.data.tokenizer import Tokenizer, WordTokenizer, load_tokenizer
from unicache_train.validation import ConfigError
from unicache_train.validation import check_choice as _choice
from unicache_train.validation import check_int as _int
from unicache_train.validation import check_range as _range

__all__ = [
    "MultimodalDataConfig",
    "MultimodalDataModule",
    "MultimodalCollator",
    "SceneDataset",
    "ImageTextDataset",
    "encode_sample",
    "load_image_text",
    "to_pixels",
    "load_multimodal_tokenizer",
]

IGNORE_INDEX = -100
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


@dataclass
class MultimodalDataConfig:
    """Where the (image, text) samples come from and how they are batched.

    Attributes:
        source: ``"synthetic"`` (the bundled scenes, :mod:`unicache_train.data.scenes`), an
            ``imagefolder`` directory (images plus ``metadata.jsonl``/``.csv`` with a
            ``file_name`` column) or ``.parquet`` file(s) / glob with an image column.
        image_column: column holding one image (or a list of images) per row.
        text_column: caption column, used when there is no question/answer pair: the prompt is
            the image plus ``caption_prompt``, the answer is the caption.
        question_column, answer_column: a question/answer pair per row (used when both exist).
            A question may place images with ``<image>``; without it the image comes first.
        task_column: optional task-type column (one of ``describe``/``count``/``refer`` counts
            in per-task evaluation; anything else is ``task_ids = -1``).
        caption_prompt: the question of caption rows.
        tokenizer: ``"words"`` (a word per token over the scene vocabulary,
            :func:`~unicache_train.data.scenes.scene_words`: the synthetic task's default, so
            the visual tokens dominate the context as in real VLMs), ``"byte"``, or a local HF
            tokenizer directory (local files with free text need one of the last two).
        batch_size: rows per batch.
        max_seq_len: longest row allowed (longer rows raise: truncating would cut the answer).
        val_fraction: held-out share of local files (the scenes draw their own validation set).
        split_at: ``"answer"`` or ``"question"`` (see the module docstring).
        prompt_loss: also train on the prompt's text tokens (off: loss on the answer only).
        num_workers: DataLoader workers.
        seed: seed of the train order (and of the local train/val split).
        scenes: the synthetic scene task.
    """

    source: str | list[str] = "synthetic"
    image_column: str = "image"
    text_column: str = "text"
    question_column: str = "question"
    answer_column: str = "answer"
    task_column: str = "task"
    caption_prompt: str = "describe the image."
    tokenizer: str = "words"
    batch_size: int = 32
    max_seq_len: int = 1024
    val_fraction: float = 0.05
    split_at: str = "answer"
    prompt_loss: bool = False
    num_workers: int = 0
    seed: int = 0
    scenes: SceneConfig = field(default_factory=SceneConfig)

    def __post_init__(self) -> None:
        if isinstance(self.scenes, dict):
            known = {f.name for f in dataclasses.fields(SceneConfig)}
            unknown = sorted(set(self.scenes) - known)
            if unknown:
                raise ConfigError(
                    f"unknown field(s) {unknown} in data.scenes; known: {sorted(known)}"
                )
            self.scenes = SceneConfig(**self.scenes)
        if not isinstance(self.scenes, SceneConfig):
            raise ConfigError(f"MultimodalDataConfig.scenes={self.scenes!r}: expected a mapping")
        src = self.source
        if isinstance(src, (list, tuple)):
            if not src or any(not isinstance(s, str) or not s for s in src):
                raise ConfigError(
                    f"MultimodalDataConfig.source={src!r}: expected 'synthetic', a directory, "
                    "or a non-empty list of parquet paths/globs"
                )
            self.source = list(src)
        elif not isinstance(src, str) or not src:
            raise ConfigError(
                f"MultimodalDataConfig.source={src!r}: expected 'synthetic', a directory or "
                "parquet path(s)"
            )
        for name in (
            "image_column",
            "text_column",
            "question_column",
            "answer_column",
            "task_column",
            "tokenizer",
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"MultimodalDataConfig.{name}={value!r}: expected a name")
        if not isinstance(self.caption_prompt, str):
            raise ConfigError(
                f"MultimodalDataConfig.caption_prompt={self.caption_prompt!r}: expected text"
            )
        _int(self, "batch_size", 1)
        _int(self, "max_seq_len", 8, 1 << 20)
        _range(self, "val_fraction", 0, 1, hi_open=True)
        _choice(self, "split_at", ("answer", "question"))
        if not isinstance(self.prompt_loss, bool):
            raise ConfigError(
                f"MultimodalDataConfig.prompt_loss={self.prompt_loss!r}: expected true or false"
            )
        _int(self, "num_workers", 0, 256)
        _int(self, "seed", 0)


def load_multimodal_tokenizer(name: str) -> Tokenizer:
    """``"words"`` -> a :class:`WordTokenizer` over the scene vocabulary; otherwise
    :func:`~unicache_train.data.tokenizer.load_tokenizer` (``"byte"`` or a local directory)."""
    if name == "words":
        return WordTokenizer(scene_words())
    return load_tokenizer(name)


# ----------------------------------------------------------------------------- encoding
def encode_sample(
    prompt: str,
    answer: str,
    num_images: int,
    tokenizer: Tokenizer,
    patches_per_image: int,
    split_at: str = "answer",
) -> dict[str, Any]:
    """Token ids, modality ids and split points of one (prompt, answer) pair.

    Args:
        prompt: text with one :data:`~unicache_train.data.scenes.IMAGE_MARK` per image.
        answer: the target text (``<eos>`` is appended).
        num_images: images of the sample (must equal the marks in ``prompt``).
        patches_per_image: P, vision positions per image.
        split_at: ``"answer"`` or ``"question"``.

    Returns:
        dict with ``ids`` and ``modality`` (int64 [L]), ``answer_start`` (first answer token)
        and ``split``.
    """
    pieces = prompt.split(IMAGE_MARK)
    if len(pieces) - 1 != num_images:
        raise ValueError(
            f"the prompt holds {len(pieces) - 1} {IMAGE_MARK} mark(s) for {num_images} image(s): "
            f"{prompt!r}"
        )
    pad = tokenizer.pad_token_id
    ids: list[int] = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    mod: list[int] = [0] * len(ids)
    last_text = 0
    for i, text in enumerate(pieces):
        if i > 0:
            ids += [pad] * patches_per_image
            mod += [1] * patches_per_image
        last_text = len(ids)
        t = tokenizer.encode(text)
        ids += t
        mod += [0] * len(t)
    answer_start = len(ids)
    a = tokenizer.encode(answer)
    if tokenizer.eos_token_id is not None:
        a = a + [tokenizer.eos_token_id]
    ids += a
    mod += [0] * len(a)
    split = answer_start if split_at == "answer" else last_text
    return {
        "ids": np.asarray(ids, dtype=np.int64),
        "modality": np.asarray(mod, dtype=np.int64),
        "answer_start": answer_start,
        "split": split,
    }


def to_pixels(image: Any, size: int) -> np.ndarray:
    """A PIL image (or an HWC uint8 / CHW float array) -> float32 [3, size, size] in [0, 1]."""
    if isinstance(image, np.ndarray):
        arr = image
        if arr.ndim == 3 and arr.shape[0] == 3 and arr.dtype != np.uint8:
            if arr.shape[1:] != (size, size):
                raise ValueError(f"image of shape {arr.shape}: expected [3, {size}, {size}]")
            return arr.astype(np.float32)
        from PIL import Image

        image = Image.fromarray(arr.astype(np.uint8))
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image or an array, got {type(image).__name__}")
    img = image.convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), Image.BILINEAR)
    return (np.asarray(img, dtype=np.float32) / 255.0).transpose(2, 0, 1).copy()


def _task_id(task: str | None) -> int:
    return TASKS.index(task) if task in TASKS else -1


class SceneDataset(Dataset):
    """The synthetic scenes, generated and encoded on the fly (sample ``i`` of ``seed``)."""

    def __init__(
        self,
        cfg: SceneConfig,
        seed: int,
        size: int,
        tokenizer: Tokenizer,
        patches_per_image: int,
        split_at: str = "answer",
    ) -> None:
        self.cfg, self.seed, self.size = cfg, seed, size
        self.tokenizer, self.P, self.split_at = tokenizer, patches_per_image, split_at

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = make_sample(self.cfg, self.seed, int(i))
        enc = encode_sample(
            s["prompt"], s["answer"], len(s["images"]), self.tokenizer, self.P, self.split_at
        )
        return {**enc, "images": s["images"], "task_id": _task_id(s["task"])}


class ImageTextDataset(Dataset):
    """Rows of an HF dataset with images and text (see :func:`load_image_text`)."""

    def __init__(
        self,
        ds: Any,
        cfg: MultimodalDataConfig,
        tokenizer: Tokenizer,
        image_size: int,
        patches_per_image: int,
    ) -> None:
        self.ds, self.cfg, self.tokenizer = ds, cfg, tokenizer
        self.image_size, self.P = image_size, patches_per_image
        cols = set(ds.column_names)
        self.qa = cfg.question_column in cols and cfg.answer_column in cols
        if cfg.image_column not in cols:
            raise ConfigError(
                f"MultimodalDataConfig.image_column={cfg.image_column!r} is not a column; "
                f"columns found: {sorted(cols)}"
            )
        if not self.qa and cfg.text_column not in cols:
            raise ConfigError(
                f"no text: neither question_column={cfg.question_column!r} + answer_column="
                f"{cfg.answer_column!r} nor text_column={cfg.text_column!r} are columns; "
                f"columns found: {sorted(cols)}"
            )
        self.has_task = cfg.task_column in cols

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.ds[int(i)]
        cfg = self.cfg
        imgs = row[cfg.image_column]
        imgs = list(imgs) if isinstance(imgs, (list, tuple)) else [imgs]
        images = [to_pixels(im, self.image_size) for im in imgs]
        if self.qa:
            question, answer = str(row[cfg.question_column]), str(row[cfg.answer_column])
        else:
            question, answer = cfg.caption_prompt, str(row[cfg.text_column])
        if IMAGE_MARK not in question:
            question = IMAGE_MARK * len(images) + question
        prompt = question if question.endswith(" ") else question + " "
        enc = encode_sample(prompt, answer, len(images), self.tokenizer, self.P, cfg.split_at)
        task = row.get(cfg.task_column) if self.has_task else None
        return {**enc, "images": images, "task_id": _task_id(task)}


def load_image_text(cfg: MultimodalDataConfig, cache_dir: str | None = None) -> Any:
    """Local (image, text) files as an HF dataset with decoded images.

    A directory is read with the ``imagefolder`` builder (its ``metadata.jsonl``/``metadata.csv``
    columns come along); ``.parquet`` paths or globs with the ``parquet`` builder, the image
    column cast to :class:`datasets.Image` when it holds raw bytes / paths.

    Raises:
        FileNotFoundError: nothing at ``source``.
        ConfigError: unsupported files.
    """
    import glob

    import datasets

    items = [cfg.source] if isinstance(cfg.source, str) else list(cfg.source)
    if len(items) == 1 and os.path.isdir(os.path.expanduser(items[0])):
        root = Path(os.path.expanduser(items[0]))
        if not any(p.suffix.lower() in _IMAGE_SUFFIXES for p in root.rglob("*")):
            parquet = sorted(str(p) for p in root.rglob("*.parquet"))
            if not parquet:
                raise FileNotFoundError(
                    f"MultimodalDataConfig.source={cfg.source!r}: the directory holds no image "
                    f"({'/'.join(_IMAGE_SUFFIXES)}) and no .parquet file"
                )
            items = parquet
        else:
            ds = datasets.load_dataset(
                "imagefolder", data_dir=str(root), split="train", cache_dir=cache_dir
            )
            return ds
    files: list[str] = []
    for item in items:
        path = os.path.expanduser(item)
        matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        if not matches or not all(os.path.isfile(m) for m in matches):
            raise FileNotFoundError(f"MultimodalDataConfig.source: no such file(s): {item!r}")
        files += matches
    bad = [f for f in files if not f.lower().endswith(".parquet")]
    if bad:
        raise ConfigError(
            f"MultimodalDataConfig.source: {bad} are not .parquet files; give an imagefolder "
            "directory or parquet files"
        )
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache_dir)
    col = cfg.image_column
    if col in ds.column_names and not isinstance(ds.features[col], datasets.Image):
        feat = ds.features[col]
        if isinstance(feat, (list, datasets.Sequence)) or getattr(feat, "feature", None):
            ds = ds.cast_column(col, datasets.Sequence(datasets.Image()))
        else:
            ds = ds.cast_column(col, datasets.Image())
    return ds


# ----------------------------------------------------------------------------- batching
@dataclass
class MultimodalCollator:
    """Right-pad a list of encoded samples into one batch (see the module docstring).

    Args:
        pad_token_id: input id of padding.
        max_seq_len: rows longer than this raise.
        prompt_loss: keep text targets before the answer.
        image_size: H = W of the pixel tensors.
    """

    pad_token_id: int
    max_seq_len: int
    prompt_loss: bool
    image_size: int

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        B = len(items)
        T = max(len(it["ids"]) for it in items)
        if T > self.max_seq_len:
            raise ValueError(
                f"a row of {T} tokens exceeds MultimodalDataConfig.max_seq_len={self.max_seq_len}"
            )
        N = max(1, max(len(it["images"]) for it in items))
        S = self.image_size
        input_ids = np.full((B, T), self.pad_token_id, dtype=np.int64)
        modality = np.zeros((B, T), dtype=np.int64)
        labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        split = np.zeros(B, dtype=np.int64)
        pixels = np.zeros((B, N, 3, S, S), dtype=np.float32)
        image_mask = np.zeros((B, N), dtype=bool)
        task_ids = np.full(B, -1, dtype=np.int64)
        for b, it in enumerate(items):
            ids, mod = it["ids"], it["modality"]
            L = len(ids)
            input_ids[b, :L], modality[b, :L] = ids, mod
            lab = ids[1:].copy()
            lab[mod[1:] != 0] = IGNORE_INDEX  # never predict a vision position
            if not self.prompt_loss:
                lab[: it["answer_start"] - 1] = IGNORE_INDEX
            labels[b, : L - 1] = lab
            split[b] = it["split"]
            for n, img in enumerate(it["images"]):
                if img.shape != (3, S, S):
                    raise ValueError(f"image of shape {img.shape}: expected (3, {S}, {S})")
                pixels[b, n] = img
                image_mask[b, n] = True
            task_ids[b] = it["task_id"]
        return {
            "input_ids": torch.from_numpy(input_ids),
            "modality_ids": torch.from_numpy(modality),
            "labels": torch.from_numpy(labels),
            "split": torch.from_numpy(split),
            "pixel_values": torch.from_numpy(pixels),
            "image_mask": torch.from_numpy(image_mask),
            "task_ids": torch.from_numpy(task_ids),
        }


class MultimodalDataModule(LMDataModule):
    """Vision-language batches from a :class:`MultimodalDataConfig`.

    Args:
        config: the data config.
        image_size: pixels per side the vision tower expects (``VisionConfig.image_size``).
        patches_per_image: its visual tokens per image (``VisionConfig.num_patches``).
        tokenizer: default ``load_tokenizer(config.tokenizer)``.
        cache_dir: ``datasets`` cache for local files.
    """

    def __init__(
        self,
        config: MultimodalDataConfig,
        image_size: int,
        patches_per_image: int,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
    ) -> None:
        tok = tokenizer if tokenizer is not None else load_multimodal_tokenizer(config.tokenizer)
        super().__init__(None, tokenizer=tok, cache_dir=cache_dir)
        self.config = config  # type: ignore[assignment]  # duck-typed: batch_size, seed, ...
        self.image_size, self.patches_per_image = image_size, patches_per_image
        if config.source == "synthetic" and config.scenes.image_size != image_size:
            raise ConfigError(
                f"data.scenes.image_size={config.scenes.image_size} differs from the vision "
                f"tower's image_size={image_size}"
            )

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        cfg = self.config
        tok, P = self.tokenizer, self.patches_per_image
        if cfg.source == "synthetic":
            sc = cfg.scenes
            self.train_dataset = SceneDataset(sc, sc.seed, sc.num_train, tok, P, cfg.split_at)
            self.val_dataset = SceneDataset(sc, sc.seed + 1, sc.num_val, tok, P, cfg.split_at)
        else:
            ds = load_image_text(cfg, self.cache_dir)
            n = len(ds)
            if n == 0:
                raise ValueError(f"MultimodalDataConfig.source={cfg.source!r} holds no row")
            n_val = min(max(round(n * cfg.val_fraction), 1), n - 1) if cfg.val_fraction > 0 else 0
            perm = np.random.default_rng(cfg.seed).permutation(n)
            S = self.image_size
            self.train_dataset = ImageTextDataset(ds.select(perm[n_val:]), cfg, tok, S, P)
            self.val_dataset = ImageTextDataset(ds.select(perm[:n_val]), cfg, tok, S, P)
        self.stats = {
            "train_records": len(self.train_dataset),
            "val_records": len(self.val_dataset),
        }

    def _collate(self) -> MultimodalCollator:  # type: ignore[override]
        cfg = self.config
        return MultimodalCollator(
            self.tokenizer.pad_token_id, cfg.max_seq_len, cfg.prompt_loss, self.image_size
        )
