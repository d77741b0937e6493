"""Tokenizers behind one small API: a file-free byte tokenizer and local HF tokenizers.

The byte tokenizer is the default (``DataConfig.tokenizer = "byte"``): ids ``0..255`` are the
UTF-8 bytes, then four special tokens::

    256 <pad>   257 <bos>   258 <eos>   259 <sep>   -> vocab_size 260

which is why :class:`~unicache_train.model.config.ModelConfig` defaults to ``vocab_size = 260``. A
model built for another tokenizer must take ``tokenizer.vocab_size`` (HF tokenizers: ``len(tok)``,
added tokens included).

Any other name is a LOCAL directory holding an HF tokenizer (``tokenizer.json`` and friends, as
written by ``save_pretrained``); it is opened with ``local_files_only=True``: there is no hub
access at run time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["Tokenizer", "ByteTokenizer", "WordTokenizer", "HFTokenizer", "load_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    vocab_size: int
    pad_token_id: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256..259 are pad/bos/eos/sep.

    Needs no files and never produces an unknown token, so any text round-trips exactly.
    """

    NUM_BYTES = 256
    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")

    def __init__(self) -> None:
        self.pad_token_id = 256
        self.bos_token_id = 257
        self.eos_token_id = 258
        self.sep_token_id = 259
        self.vocab_size = self.NUM_BYTES + len(self.SPECIAL_TOKENS)  # 260

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, optionally framed by ``<bos>`` / ``<eos>``."""
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts without special tokens."""
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Ids back to text; invalid UTF-8 becomes U+FFFD.

        With ``skip_special=False`` special tokens are rendered by name (``<eos>``), and a byte
        run is decoded on its own on each side of them.
        """
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.NUM_BYTES:
                run.append(i)
            elif self.NUM_BYTES <= i < self.vocab_size:
                if not skip_special:
                    out.append(run.decode("utf-8", errors="replace"))
                    run.clear()
                    out.append(self.SPECIAL_TOKENS[i - self.NUM_BYTES])
            else:
                raise ValueError(f"token id {i} is out of range for ByteTokenizer [0, 260)")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class WordTokenizer:
    """Closed-vocabulary word tokenizer: words (letters, digits, ``'``) and the punctuation marks
    ``. , ? : ; !`` are tokens; anything outside the vocabulary is ``<unk>``.

    For synthetic tasks with a small fixed language (e.g. the scene questions of
    :mod:`unicache_train.data.scenes`), where bytes would spend most of a sequence spelling
    words. Ids: ``0..3`` are ``<pad> <bos> <eos> <unk>``, then the sorted vocabulary. Decoding
    joins words with spaces and attaches punctuation to the previous word, so a text made of
    vocabulary words and single spaces round-trips exactly.
    """

    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
    _SPLIT = re.compile(r"[A-Za-z0-9']+|[.,?:;!]|\S")
    _PUNCT = frozenset(".,?:;!")

    def __init__(self, words: Sequence[str]) -> None:
        vocab = sorted(set(words) - set(self.SPECIAL_TOKENS))
        bad = [w for w in vocab if self._SPLIT.findall(w) != [w]]
        if bad:
            raise ValueError(f"WordTokenizer: {bad[:5]} are not single words or marks")
        self.itos = [*self.SPECIAL_TOKENS, *vocab]
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        self.vocab_size = len(self.itos)

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.stoi.get(w, self.unk_token_id) for w in self._SPLIT.findall(text)]
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        out: list[str] = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is out of range for WordTokenizer [0, {self.vocab_size})"
                )
            if skip_special and i < len(self.SPECIAL_TOKENS):
                continue
            w = self.itos[i]
            out.append(w if not out or w in self._PUNCT else " " + w)
        return "".join(out)


class HFTokenizer:
    """A local HF tokenizer behind the :class:`Tokenizer` API.

    ``pad_token_id`` falls back to the eos id, then to 0, when the tokenizer defines no pad token:
    padded positions carry label -100, so the id only has to be a valid embedding row.
    """

    def __init__(self, tokenizer: Any, name: str = "") -> None:
        self.tok = tokenizer
        self.name = name
        self.vocab_size = len(tokenizer)
        self.bos_token_id: int | None = tokenizer.bos_token_id
        self.eos_token_id: int | None = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = self.eos_token_id if self.eos_token_id is not None else 0
        self.pad_token_id: int = pad

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``; bos/eos are added only when asked and when the tokenizer has them.

        The tokenizer's own template (``add_special_tokens``) is not used, so the framing is the
        same for every tokenizer and decided here.
        """
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        if add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_eos and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts in one call (the Rust tokenizer batches them), no special tokens."""
        if not texts:
            return []
        return [list(x) for x in self.tok(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Ids back to text."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def load_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; otherwise a local HF tokenizer directory.

    Raises:
        FileNotFoundError: ``name`` is not ``"byte"`` and not an existing directory.
    """
    if name == "byte":
        return ByteTokenizer()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory not found: {str(path)!r} (DataConfig.tokenizer is 'byte' or a "
            "local directory written by save_pretrained; the hub is never contacted)"
        )
    from transformers import AutoTokenizer  # heavy import, only on this path

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return HFTokenizer(tok, name=str(path))
