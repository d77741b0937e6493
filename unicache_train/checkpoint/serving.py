"""What a serving stack needs next to exported weights: tokenizer, generation config, chat template.

Every export (:func:`~unicache_train.checkpoint.hf.export_hf`,
:func:`~unicache_train.checkpoint.deepseek_v3.export_deepseek_v3`, ``unicache-train export``)
ends with :func:`write_serving_files`, so that the directory loads and generates as it is::

    AutoTokenizer.from_pretrained(out)  +  AutoModelForCausalLM.from_pretrained(out)  ->  generate

The files come from a *tokenizer source* (the ``tokenizer_from`` argument of the exporters):

=====================================  ========================================================
``tokenizer_from``                     what is written
=====================================  ========================================================
a directory (the imported checkpoint)  its tokenizer files, ``generation_config.json`` and chat
                                       template, copied verbatim (byte-identical tokenization
                                       in every stack)
``"byte"`` / a :class:`ByteTokenizer`  our byte tokenizer in HF form (:func:`byte_tokenizer_files`)
an :class:`HFTokenizer` or a           ``save_pretrained`` of it (chat template included)
transformers tokenizer
``None``                               the directory the model was imported from
                                       (:func:`~unicache_train.checkpoint.hf.import_hf` records it
                                       as ``model.hf_source_dir``); if there is none, no tokenizer
                                       (a warning says how to add one)
=====================================  ========================================================

``generation_config.json`` is the source's when it has one (explicit bos/eos ids override its
ids), else one built from the exported config's ``bos_token_id`` / ``eos_token_id`` /
``pad_token_id``. The special ids written to ``config.json`` follow the same order: explicit
arguments, then the source's ``config.json``, then its ``generation_config.json``, then the
tokenizer's own ids; ids outside the model's vocabulary are dropped (transformers warns on them
and ``generate`` would index out of range).
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unicache_train.data.tokenizer import ByteTokenizer, HFTokenizer

__all__ = [
    "SOURCE_ATTR",
    "TOKENIZER_FILES",
    "CHAT_TEMPLATE_FILES",
    "GENERATION_CONFIG",
    "tokenizer_source",
    "special_token_ids",
    "write_serving_files",
    "write_export_dir",
    "byte_tokenizer_files",
]

# The attribute import_hf / import_deepseek_v3 set on the model: the directory it came from.
SOURCE_ATTR = "hf_source_dir"
# Files of a tokenizer as transformers (4.x and 5.x) and sentencepiece-based stacks write them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
# A directory holds a tokenizer when it has one of these (the others only configure one).
_TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_CHAT_TEMPLATE_DIR = "additional_chat_templates"  # named templates (transformers >= 4.53)
GENERATION_CONFIG = "generation_config.json"
_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_source(model: Any, tokenizer_from: Any = None) -> Any:
    """The tokenizer source an export uses: ``tokenizer_from``, else the model's recorded
    source directory (``model.hf_source_dir``), else None.

    Raises:
        FileNotFoundError: ``tokenizer_from`` is a path that is not a directory.
        TypeError: ``tokenizer_from`` is none of the accepted kinds (see the module doc).
    """
    if tokenizer_from is None:
        return getattr(model, SOURCE_ATTR, None)
    if isinstance(tokenizer_from, (ByteTokenizer, HFTokenizer)) or hasattr(
        tokenizer_from, "save_pretrained"
    ):
        return tokenizer_from
    if isinstance(tokenizer_from, str) and tokenizer_from == "byte":
        return ByteTokenizer()
    if isinstance(tokenizer_from, (str, Path)):
        path = Path(tokenizer_from).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer_from={str(tokenizer_from)!r} is not a directory; pass the checkpoint "
                "(or tokenizer) directory the model came from, 'byte', or a tokenizer object"
            )
        return path
    raise TypeError(
        f"tokenizer_from has type {type(tokenizer_from).__name__}; allowed: a directory path, "
        "'byte', a ByteTokenizer, an HFTokenizer or a transformers tokenizer"
    )


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: invalid JSON ({err})") from err
    return data if isinstance(data, dict) else {}


def _in_vocab(value: Any, vocab_size: int) -> Any:
    """``value`` (an id or a list of ids) with ids outside ``[0, vocab_size)`` removed."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < vocab_size else None
    if isinstance(value, list):
        kept = [i for i in value if isinstance(i, int) and 0 <= i < vocab_size]
        return kept or None
    return None


def special_token_ids(
    source: Any,
    vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` for the exported ``config.json``.

    Args:
        source: a :func:`tokenizer_source` result (directory, tokenizer object or None).
        vocab_size: the model's vocabulary; ids outside ``[0, vocab_size)`` become None.
        bos_token_id, eos_token_id: explicit ids; they win over the source's.

    Returns:
        The three fields, each an id, a list of ids (eos may be several) or None.
    """
    found: dict[str, Any] = dict.fromkeys(_ID_FIELDS)
    if isinstance(source, Path):
        for file in (source / "config.json", source / GENERATION_CONFIG):
            data = _read_json(file)
            for k in _ID_FIELDS:
                if found[k] is None:
                    found[k] = data.get(k)
        if found["bos_token_id"] is None and found["eos_token_id"] is None:
            source = _load_tokenizer(source)  # a tokenizer-only directory: ask the tokenizer
    if source is not None and not isinstance(source, Path):
        tok = getattr(source, "tok", source)  # HFTokenizer wraps a transformers tokenizer
        for k in _ID_FIELDS:
            if found[k] is None:
                found[k] = getattr(tok, k, None)
    for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if v is not None:
            found[k] = v
    return {k: _in_vocab(v, vocab_size) for k, v in found.items()}


def _load_tokenizer(path: Path) -> Any:
    """The transformers tokenizer of ``path``, or None when it has none that loads here."""
    if not _present(path, _TOKENIZER_CORE):
        return None
    from transformers import AutoTokenizer  # heavy import, only on this path

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, ImportError):  # e.g. sentencepiece missing: ids stay unknown
        return None


def write_serving_files(
    out_dir: str | Path,
    source: Any,
    hf_config: dict[str, Any],
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> list[str]:
    """Write the tokenizer, ``generation_config.json`` and chat template next to the weights.

    Args:
        out_dir: the export directory (``config.json`` already written there).
        source: a :func:`tokenizer_source` result.
        hf_config: the exported ``config.json`` dict (its special ids build the generation
            config when the source has none; ``vocab_size`` bounds the tokenizer;
            ``max_position_embeddings`` becomes the byte tokenizer's ``model_max_length``).
        bos_token_id, eos_token_id: explicit ids, written over the source's generation config.

    Returns:
        The names of the files written (sorted).
    """
    out = Path(out_dir)
    vocab_size = int(hf_config["vocab_size"])
    written: set[str] = set()
    generation: dict[str, Any] | None = None
    if isinstance(source, Path):
        written |= _copy_tokenizer_dir(source, out)
        if (source / GENERATION_CONFIG).is_file():
            generation = _read_json(source / GENERATION_CONFIG)
            for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
                if v is not None:
                    generation[k] = v
    elif isinstance(source, ByteTokenizer):
        if source.vocab_size > vocab_size:
            _warn_missing(
                out,
                f"the byte tokenizer has {source.vocab_size} tokens but the model's "
                f"vocab_size is {vocab_size}",
            )
        else:
            written |= byte_tokenizer_files(out, int(hf_config.get("max_position_embeddings", 0)))
    elif source is not None:
        tok = getattr(source, "tok", source)
        if len(tok) > vocab_size:
            _warn_missing(
                out,
                f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {vocab_size}",
            )
        else:
            before = {p.name for p in out.iterdir()}
            tok.save_pretrained(str(out))
            written |= ({p.name for p in out.iterdir()} - before) | _present(out, TOKENIZER_FILES)
    else:
        _warn_missing(out, "no tokenizer source is known for this model")
    if generation is None:
        generation = {k: hf_config[k] for k in _ID_FIELDS if hf_config.get(k) is not None}
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    written.add(GENERATION_CONFIG)
    return sorted(written)


def _present(directory: Path, names: tuple[str, ...]) -> set[str]:
    return {n for n in names if (directory / n).is_file()}


def _copy_tokenizer_dir(source: Path, out: Path) -> set[str]:
    """Copy the tokenizer files, chat templates and custom tokenizer code of ``source``."""
    names = _present(source, TOKENIZER_FILES + CHAT_TEMPLATE_FILES)
    names |= {p.name for p in source.glob("tokenization_*.py")}  # auto_map'd tokenizer code
    if not _present(source, _TOKENIZER_CORE):
        _warn_missing(out, f"{source} holds no tokenizer ({' / '.join(_TOKENIZER_CORE)})", 1)
    same = source.resolve() == out.resolve()
    if not same:  # NOTE: exporting into the source directory: its files are already there
        for name in names:
            shutil.copyfile(source / name, out / name)
        templates = source / _CHAT_TEMPLATE_DIR
        if templates.is_dir():
            shutil.copytree(templates, out / _CHAT_TEMPLATE_DIR, dirs_exist_ok=True)
    if (source / _CHAT_TEMPLATE_DIR).is_dir():
        names.add(_CHAT_TEMPLATE_DIR)
    return names


def _warn_missing(out: Path, why: str, depth: int = 0) -> None:
    """Warn at the export's caller (``depth``: frames between the export function and here,
    less two)."""
    warnings.warn(
        f"{out}: no tokenizer written ({why}); the export loads with AutoModelForCausalLM but "
        "not AutoTokenizer. Pass tokenizer_from=<the checkpoint or tokenizer directory> (or "
        "'byte' for our byte tokenizer) to the export function",
        stacklevel=4 + depth,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizes to)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokenizer_files(out_dir: str | Path, model_max_length: int = 0) -> set[str]:
    """Write :class:`~unicache_train.data.tokenizer.ByteTokenizer` as an HF fast tokenizer.

    Built with ``tokenizers``: a ByteLevel pre-tokenizer (no regex split, no prefix space) maps
    each UTF-8 byte to one character, a BPE model without merges maps that character to the
    byte's id ``0..255``, and ``<pad> <bos> <eos> <sep>`` are added special tokens ``256..259``.
    ``split_special_tokens`` makes the text ``"<eos>"`` encode as its five bytes, as ours does,
    so ``AutoTokenizer`` encodes every text to the ids :class:`ByteTokenizer` gives (no bos/eos
    added) and decodes them back (invalid UTF-8 becomes U+FFFD in both).

    Args:
        out_dir: where ``tokenizer.json`` and ``tokenizer_config.json`` go.
        model_max_length: recorded in the tokenizer config when positive.

    Returns:
        The names of the files written.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_tok = ByteTokenizer()
    to_char = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Added in this order they take ids 256, 257, 258, 259: ByteTokenizer's special ids.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in byte_tok.SPECIAL_TOKENS]
    )
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    pad, bos, eos, sep = byte_tok.SPECIAL_TOKENS
    config: dict[str, Any] = {
        # PreTrainedTokenizerFast: read by transformers 4.x and 5.x (and vLLM) alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": pad,
        "bos_token": bos,
        "eos_token": eos,
        "sep_token": sep,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length > 0:
        config["model_max_length"] = model_max_length
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"tokenizer.json", "tokenizer_config.json"}


def write_export_dir(
    out_dir: str | Path,
    hf_config: dict[str, Any],
    state_dict: dict[str, Any],
    source: Any,
    *,
    compression_policy: dict[str, Any] | None = None,
    retention: dict[str, Any] | None = None,
    attention_scorer: Any = None,
    remote_code: Sequence[Path] = (),
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> Path:
    """What every export writes, once for all formats (HF families, our mHC format, DeepseekV3):
    ``config.json``, ``model.safetensors``, the remote-code files (mHC), the compression policy
    (``compression_config.json``; absent: an earlier export's file is removed, so a stale policy
    is never served with these weights), the tokenizer / generation config / chat template
    (:func:`write_serving_files`) and the checksum manifest serving verifies.

    A policy whose selection is a learned retention policy (``unicache.selection.method ==
    "retention"``) needs its weights: ``retention`` (the model's
    :func:`~unicache_train.compress.retention.retention_state`) goes to
    ``kv_retention.safetensors`` and the policy names that file (``"retention": {"file": ...}``).
    A model's retention weights are not written when the policy does not use them. The same for
    the attention-regression scorer (``"attention"``): ``attention_scorer`` (an
    :class:`~unicache_train.compress.attention_scorer.AttentionScorer`) goes to
    ``kv_attention_scorer.safetensors``, named by ``"attention_scorer": {"file": ...}``.

    Returns:
        ``out_dir`` as a :class:`Path`.

    Raises:
        ValueError: the policy uses a learned retention policy and ``retention`` is None.
    """
    from safetensors.torch import save_file

    from unicache_train.checkpoint.integrity import write_manifest
    from unicache_train.checkpoint.policy import (
        COMPRESSION_CONFIG,
        uses_attention_scorer,
        uses_retention,
        write_compression_config,
    )
    from unicache_train.compress.attention_scorer import (
        ATTENTION_SCORER_FILE,
        save_attention_scorer,
    )
    from unicache_train.compress.retention import RETENTION_FILE

    out = Path(out_dir)
    if uses_retention(compression_policy) and retention is None:
        raise ValueError(
            "the compression policy selects with a learned retention policy "
            "(unicache.selection.method='retention') but the model has none (model."
            "kv_retention): export the model the run trained, or a policy without it"
        )
    if uses_attention_scorer(compression_policy) and attention_scorer is None:
        raise ValueError(
            "the compression policy selects with the attention scorer "
            "(unicache.selection.method='attention'): pass its fitted AttentionScorer "
            "(attention_scorer=...)"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in remote_code:
        shutil.copyfile(file, out / file.name)
    (out / RETENTION_FILE).unlink(missing_ok=True)  # never a stale policy's weights
    (out / ATTENTION_SCORER_FILE).unlink(missing_ok=True)
    if compression_policy is not None:
        if uses_attention_scorer(compression_policy):
            save_attention_scorer(attention_scorer, out / ATTENTION_SCORER_FILE)
            compression_policy = {
                **compression_policy,
                "attention_scorer": {"file": ATTENTION_SCORER_FILE},
            }
        if uses_retention(compression_policy):
            save_file(
                retention, str(out / RETENTION_FILE), metadata={"format": "unicache_retention"}
            )
            compression_policy = {**compression_policy, "retention": {"file": RETENTION_FILE}}
        write_compression_config(compression_policy, out)
    else:
        (out / COMPRESSION_CONFIG).unlink(missing_ok=True)
    write_serving_files(
        out, source, hf_config, bos_token_id=bos_token_id, eos_token_id=eos_token_id
    )
    write_manifest(out)  # unicache_manifest.json: what serving verifies
    return out
