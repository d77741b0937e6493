"""Reading a checkpoint directory's files: ``config.json`` and safetensors (one file or shards
listed in ``model.safetensors.index.json``), each read whole and refused in one line when it is
truncated or corrupt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from unicache_train.checkpoint.hf_config import HFCheckpointError


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise HFCheckpointError(f"safetensors file not found: {file}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise HFCheckpointError(
            f"{file}: cannot read the safetensors file ({err}); it is corrupted or truncated"
        ) from err


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded with an index).

    With an index, each shard is read completely and every tensor the index lists must be in
    the shard it names (a truncated download is caught here, not as a missing weight later).
    Pickle files (``*.bin``) are never read.
    """
    path = Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return _read_safetensors(single)
    if not index.is_file():
        hint = " (pickle .bin checkpoints are not read)" if any(path.glob("*.bin")) else ""
        raise FileNotFoundError(
            f"{path}: no model.safetensors or model.safetensors.index.json{hint}"
        )
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise HFCheckpointError(f"{index}: not a valid safetensors index ({err})") from err
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        part = _read_safetensors(path / shard)
        listed = {k for k, v in weight_map.items() if v == shard}
        absent = sorted(listed - set(part))
        if absent:
            raise HFCheckpointError(
                f"{path / shard}: tensors listed in the index are absent from the shard: "
                f"{absent[:8]}{' ...' if len(absent) > 8 else ''}"
            )
        tensors.update(part)
    return tensors


def read_config_json(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise HFCheckpointError(f"{config_file}: invalid JSON ({err})") from err
