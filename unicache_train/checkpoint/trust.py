"""What may run when an export directory is opened: only our own code, or what the user trusts.

``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` imports and runs whatever
Python file the directory's ``config.json`` names in ``auto_map``. Our mHC exports need that for
their own two files (``configuration_unicache_mhc.py``, ``modeling_unicache_mhc.py``, copied from
:mod:`unicache_train.checkpoint.remote_code`). :func:`check_export_dir` therefore allows remote
code only when the ``auto_map`` is exactly ours *and* each file it names is byte-equal to the
package's copy; any other ``auto_map`` (in ``config.json`` or ``tokenizer_config.json``) is refused
naming the file and the entry, unless the user passed ``trust_remote_code`` explicitly.

It also checks, each in one line, what would otherwise fail deep inside transformers: the
checksum manifest (:mod:`unicache_train.checkpoint.integrity`), weights present as safetensors
(a pickled ``pytorch_model.bin`` is not read), a tokenizer present.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unicache_train.checkpoint.integrity import verify
from unicache_train.validation import ConfigError

__all__ = ["RemoteCodeError", "OUR_AUTO_MAP", "check_export_dir", "read_json"]

#: The ``auto_map`` of our mHC exports (``unicache_train.checkpoint.hf.to_hf_config``).
OUR_AUTO_MAP = {
    "AutoConfig": "configuration_unicache_mhc.UnicacheMhcConfig",
    "AutoModelForCausalLM": "modeling_unicache_mhc.UnicacheMhcForCausalLM",
}
_REMOTE_CODE = Path(__file__).parent / "remote_code"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class RemoteCodeError(ValueError):
    """An export asks to run Python code that is not ours and the user did not trust it."""


def read_json(file: Path) -> Any:
    """A JSON file, or :class:`ConfigError` naming it (invalid JSON or UTF-8, nesting too deep)."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{file}: invalid JSON at line {err.lineno} column {err.colno} ({err.msg})"
        ) from None
    except RecursionError:
        raise ConfigError(f"{file}: JSON nested too deeply to read") from None


def _is_ours(export: Path, auto_map: Any) -> bool:
    if auto_map != OUR_AUTO_MAP:
        return False
    for ref in OUR_AUTO_MAP.values():
        name = ref.split(".")[0] + ".py"
        mine, theirs = _REMOTE_CODE / name, export / name
        if not theirs.is_file() or theirs.read_bytes() != mine.read_bytes():
            return False
    return True


def check_export_dir(export: str | Path, *, trust_remote_code: bool = False) -> bool:
    """Check an export directory before transformers opens it.

    Args:
        export: the directory.
        trust_remote_code: the user's explicit permission to run the directory's own code.

    Returns:
        Whether the model needs ``trust_remote_code=True`` (ours, verified; or trusted).

    Raises:
        FileNotFoundError: no such directory, or no ``config.json``.
        ConfigError: ``config.json`` unreadable or not a mapping.
        IntegrityError: a file differs from the checksum manifest.
        RemoteCodeError: an ``auto_map`` names code that is not ours (without
            ``trust_remote_code``).
        HFCheckpointError: no safetensors weights, or no tokenizer.
    """
    from unicache_train.checkpoint.hf_config import HFCheckpointError

    export = Path(export)
    config_file = export / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--export {export}: no config.json there (not an export)")
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    verify(export)
    if not any((export / w).is_file() for w in _WEIGHTS):
        pickled = [p for p in _PICKLED if (export / p).is_file()]
        why = (
            f"only {pickled[0]} (pickled weights are not read: they can run code)"
            if pickled
            else "no weights"
        )
        raise HFCheckpointError(f"--export {export}: {why}; expected {' or '.join(_WEIGHTS)}")
    if not any((export / t).is_file() for t in _TOKENIZER_CORE):
        raise HFCheckpointError(
            f"--export {export}: no tokenizer ({' / '.join(_TOKENIZER_CORE)}); export again "
            "from a run whose data.tokenizer is a tokenizer directory or 'byte'"
        )
    remote = False
    auto_map = config.get("auto_map")
    if auto_map is not None:
        if _is_ours(export, auto_map):
            remote = True
        elif trust_remote_code:
            remote = True
        else:
            raise RemoteCodeError(
                f"{config_file}: auto_map={json.dumps(auto_map)[:120]} names code that is not "
                "unicache_train's own mHC files (byte for byte); refusing to run it. Pass "
                "--trust_remote_code true only if you trust this directory"
            )
    tok_config = export / "tokenizer_config.json"
    if tok_config.is_file() and not trust_remote_code:
        tok = read_json(tok_config)
        if isinstance(tok, dict) and tok.get("auto_map") is not None:
            raise RemoteCodeError(
                f"{tok_config}: auto_map names tokenizer code; refusing to run it. Pass "
                "--trust_remote_code true only if you trust this directory"
            )
    return remote
