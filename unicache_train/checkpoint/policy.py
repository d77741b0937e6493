"""The compression policy that travels with an export: ``compression_config.json``.

Written by every export of a run that trained with KV compression in the loop
(:func:`policy_of`), read back by the serving side (:func:`read_policy`,
:func:`compressor_from_policy`): the transformers cache of
:mod:`unicache_train.transformers_cache` and ``unicache-train generate --export``. The file::

    {"schema_version": 1, "format": "unicache_compression", "library": "unicache_train",
     "policy": {"method": "unicache" | "xkv" | "unicache+xkv" | "none",
                "preset": "<UniCache preset>",
                "unicache": {<the resolved UniCacheConfig>},
                "xkv": {<the resolved XKVConfig>},          (xKV methods only)
                "retention": {"file": "kv_retention.safetensors"}}}
                                                    (a learned retention policy only)
                "attention_scorer": {"file": "kv_attention_scorer.safetensors"}
                                                    (the attention-regression scorer only)

The policy holds resolved configurations (every field), so a reader rebuilds exactly the
compressor the run trained with, whatever the defaults of the reading version. A learned
retention policy (``unicache.selection.method == "retention"``) also has weights: a safetensors
file in the export directory, named by ``retention.file`` (a bare file name; never a path out
of the directory), read by :func:`compressor_from_policy`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from unicache_train.train.config import COMPRESS_METHODS, CompressionTrainConfig
from unicache_train.validation import ConfigError

__all__ = [
    "COMPRESSION_CONFIG",
    "write_compression_config",
    "COMPRESSION_SCHEMA_VERSION",
    "policy_of",
    "read_policy",
    "compressor_from_policy",
    "uses_retention",
    "uses_attention_scorer",
]

COMPRESSION_CONFIG = "compression_config.json"
COMPRESSION_SCHEMA_VERSION = 1
_DOC_KEYS = {"schema_version", "format", "library", "policy"}
_POLICY_KEYS = {"method", "preset", "unicache", "xkv", "retention", "attention_scorer"}
# The retention file's name: a bare name in the export directory (no separators, no "..").
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\.safetensors$")


def _selection_method(policy: dict[str, Any] | None) -> str | None:
    if not isinstance(policy, dict) or policy.get("method") in (None, "none"):
        return None
    unicache = policy.get("unicache")
    selection = unicache.get("selection") if isinstance(unicache, dict) else None
    return selection.get("method") if isinstance(selection, dict) else None


def uses_retention(policy: dict[str, Any] | None) -> bool:
    """Whether a policy selects tokens with a learned retention policy (which has weights)."""
    return _selection_method(policy) == "retention"


def uses_attention_scorer(policy: dict[str, Any] | None) -> bool:
    """Whether a policy selects tokens with the attention-regression scorer (which has
    weights, :mod:`unicache_train.compress.attention_scorer`)."""
    return _selection_method(policy) == "attention"


def policy_of(compress: CompressionTrainConfig) -> dict[str, Any] | None:
    """The in-loop compression policy of a run's ``compress`` section (None when it is off)."""
    if not compress.enabled:
        return None
    # unicache / xkv are resolved configurations after validation: every field is written.
    policy = {
        "method": compress.method,
        "preset": compress.preset,
        "unicache": compress.unicache.to_dict(),
    }
    if "xkv" in compress.method:  # the cross-layer SVD setting the model was tuned for
        policy["xkv"] = compress.xkv.to_dict()
    return policy


def write_compression_config(policy: dict[str, Any], out_dir: str | Path) -> Path:
    """Serialise a compression policy next to exported weights (``compression_config.json``).

    Raises:
        ConfigError: the policy is not a mapping (or dataclass) of JSON-serialisable values.
    """
    if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
        policy = dataclasses.asdict(policy)
    if not isinstance(policy, dict):
        raise ConfigError(f"compression policy must be a dict, got {type(policy).__name__}")
    doc = {
        "schema_version": COMPRESSION_SCHEMA_VERSION,
        "format": "unicache_compression",
        "library": "unicache_train",
        "policy": policy,
    }
    try:
        text = json.dumps(doc, indent=2, sort_keys=False)
    except TypeError as err:
        raise ConfigError(f"compression policy is not JSON-serialisable: {err}") from err
    file = Path(out_dir) / COMPRESSION_CONFIG
    file.write_text(text + "\n")
    return file


def read_policy(export_dir: str | Path) -> dict[str, Any] | None:
    """The policy in ``export_dir/compression_config.json``; None when the file is absent (the
    export was not trained with compression).

    Raises:
        ConfigError: the file is not a unicache compression config of a schema we read (bad
            JSON, unknown keys, an unknown method, a missing or empty section, an invalid
            setting): one line naming the file.
    """
    from unicache_train.checkpoint.trust import read_json

    file = Path(export_dir) / COMPRESSION_CONFIG
    if not file.is_file():
        return None
    doc = read_json(file)  # one line for bad JSON, bad UTF-8, nesting too deep
    if not isinstance(doc, dict) or doc.get("format") != "unicache_compression":
        raise ConfigError(
            f"{file}: format={doc.get('format') if isinstance(doc, dict) else None!r}; expected "
            "'unicache_compression'"
        )
    unknown = sorted(set(doc) - _DOC_KEYS)
    if unknown:  # e.g. an auto_map: nothing in this file may name code
        raise ConfigError(
            f"{file}: unknown key(s) {unknown} at the top level; allowed: {sorted(_DOC_KEYS)}"
        )
    version = doc.get("schema_version")
    if version != COMPRESSION_SCHEMA_VERSION:
        raise ConfigError(
            f"{file}: schema_version={version!r}; this version of unicache_train reads "
            f"{COMPRESSION_SCHEMA_VERSION}"
        )
    policy = doc.get("policy")
    if not isinstance(policy, dict):
        raise ConfigError(f"{file}: 'policy' must be a mapping, got {type(policy).__name__}")
    unknown = sorted(set(policy) - _POLICY_KEYS)
    if unknown:
        raise ConfigError(
            f"{file}: unknown key(s) {unknown} in policy; allowed: {sorted(_POLICY_KEYS)}"
        )
    method = policy.get("method")
    if method not in COMPRESS_METHODS:
        raise ConfigError(f"{file}: policy.method={method!r}; allowed: {list(COMPRESS_METHODS)}")
    if method != "none":
        # NOTE: the writer stores resolved configurations; a missing or empty section would be
        # filled with today's defaults, not the run's settings, so it is refused.
        needed = ["unicache"] + (["xkv"] if "xkv" in method else [])
        for name in needed:
            section = policy.get(name)
            if not isinstance(section, dict) or not section:
                raise ConfigError(
                    f"{file}: policy.{name}={section!r}; method {method!r} needs the resolved "
                    f"{name} configuration (a non-empty mapping, as the export wrote it)"
                )
        try:
            compression_config_of(policy)
        except ConfigError as err:
            raise ConfigError(f"{file}: {err}") from None
    _check_retention_entry(file, policy)
    return policy


def _check_retention_entry(file: Path, policy: dict[str, Any]) -> None:
    """``policy.retention`` (``policy.attention_scorer``) is present exactly when the selection
    is a learned retention policy (the attention-regression scorer), and names a bare
    ``*.safetensors`` file that exists beside ``file``."""
    for key, method, used, what in (
        ("retention", "retention", uses_retention(policy), "a learned retention policy"),
        ("attention_scorer", "attention", uses_attention_scorer(policy), "an attention scorer"),
    ):
        entry = policy.get(key)
        if not used:
            if entry is not None:
                raise ConfigError(
                    f"{file}: policy.{key}={entry!r} but unicache.selection.method is not "
                    f"{method!r} (the weights would be ignored)"
                )
            continue
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or set(entry) != {"file"} or not isinstance(name, str):
            raise ConfigError(
                f"{file}: policy.{key}={entry!r}; {what} needs "
                "{'file': '<name>.safetensors'} (its weights, beside this file)"
            )
        if not _FILE_NAME.match(name):
            raise ConfigError(
                f"{file}: policy.{key}.file={name!r} is not allowed; expected a bare file name "
                "ending in .safetensors (letters, digits, '_', '-', '.'; no path)"
            )
        if not (file.parent / name).is_file():
            raise ConfigError(f"{file}: policy.{key}.file={name!r} does not exist in {file.parent}")


def compression_config_of(policy: dict[str, Any] | None) -> CompressionTrainConfig:
    """The ``compress`` section a policy describes (``enabled=False`` for None)."""
    if policy is None or policy.get("method") == "none":
        return CompressionTrainConfig(enabled=False, method="none")
    preset = policy.get("preset", "default")
    section = {"enabled": True, "method": policy["method"], "preset": preset}
    section.update({k: policy[k] for k in ("unicache", "xkv") if policy.get(k) is not None})
    return CompressionTrainConfig.from_dict(section)


def compressor_from_policy(
    policy: dict[str, Any] | None,
    export_dir: str | Path | None = None,
    *,
    shape: tuple[int, int, int] | None = None,
):
    """The KV compressor a policy describes: exactly the one its run trained with
    (:func:`unicache_train.inloop.build_compressor`); the identity for None / ``"none"``.

    A learned retention policy's weights are read from ``export_dir`` (the file the policy
    names, :func:`~unicache_train.compress.retention.read_retention`; eval mode: the hard
    selection at the byte target), checked against ``shape`` = (layers, kv_heads, head_dim)
    when given.

    Raises:
        ConfigError: the policy needs its retention weights and ``export_dir`` is None, or the
            file is not a retention policy that fits (one line naming the file).
    """
    from unicache_train.inloop import build_compressor

    config = compression_config_of(policy)
    if uses_attention_scorer(policy):
        from unicache_train.compress.attention_scorer import read_attention_scorer

        scorer = _read_weights(
            policy,
            export_dir,
            "attention_scorer",
            "an attention-scorer policy",
            lambda path: read_attention_scorer(path, shape),
        )
        return build_compressor(config, attention_scorer=scorer)
    if not uses_retention(policy):
        return build_compressor(config)
    from unicache_train.compress.retention import read_retention

    retention = _read_weights(
        policy,
        export_dir,
        "retention",
        "a learned retention policy",
        lambda path: read_retention(path, shape),
    )
    return build_compressor(config, retention=retention)


def _read_weights(policy: dict[str, Any], export_dir, key: str, what: str, read) -> Any:
    """The weights file ``policy[key]["file"]`` names, read from ``export_dir`` by ``read``
    (a learned selection's: the retention policy or the attention scorer)."""
    entry = policy.get(key) if isinstance(policy, dict) else None
    name = entry.get("file") if isinstance(entry, dict) else None
    if export_dir is None or not isinstance(name, str) or not _FILE_NAME.match(name):
        raise ConfigError(
            f"{what} needs its weights: pass the export directory "
            "(compressor_from_policy(read_policy(DIR), DIR)) of a policy naming its file "
            f"(policy.{key}={entry!r})"
        )
    try:
        return read(Path(export_dir) / name)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
