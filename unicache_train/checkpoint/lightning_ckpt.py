"""Rebuild a model from one of our Lightning checkpoints (``.ckpt``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unicache_train.checkpoint.integrity import CheckpointError, verify
from unicache_train.checkpoint.safe_load import load_torch_file
from unicache_train.model import Decoder
from unicache_train.train.config import RunConfig
from unicache_train.validation import ConfigError

__all__ = ["load_checkpoint", "read_checkpoint", "check_state_dict"]


def read_checkpoint(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """The dict of a ``.ckpt`` file, checked against its checksum manifest when it has one and
    read as plain data (see :mod:`unicache_train.checkpoint.safe_load`).

    Raises:
        IntegrityError: the file differs from its manifest, or is empty / truncated.
        CheckpointError: no ``state_dict`` mapping in it.
        UnsafeCheckpointError: its pickle would call code.
    """
    path = Path(path)
    if path.is_file():
        verify(path)
    ckpt = load_torch_file(path, map_location="cpu", mmap=mmap)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), Mapping):
        raise CheckpointError(
            f"{path}: not a unicache_train checkpoint (no state_dict mapping; a .ckpt written "
            "by `unicache-train fit` holds state_dict and hyper_parameters)"
        )
    return ckpt


def check_state_dict(
    state: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], path: str | Path, what: str
) -> None:
    """Raise :class:`CheckpointError` in one line unless ``state`` has exactly the tensors of
    ``expected`` (name -> shape): the counts of missing, unexpected and mis-shaped tensors with
    the first of each."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shaped = [
        k
        for k in expected
        if k in state and tuple(getattr(state[k], "shape", ())) != tuple(expected[k])
    ]
    if not (missing or unexpected or shaped):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (first {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (first {unexpected[0]})")
    if shaped:
        k = shaped[0]
        parts.append(
            f"{len(shaped)} of another shape (first {k}: {list(state[k].shape)} in the "
            f"file, {list(expected[k])} expected)"
        )
    raise CheckpointError(f"{path}: its weights do not fit {what}: {', '.join(parts)}")


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> tuple[Decoder, RunConfig]:
    """Load a checkpoint written by our trainer into a plain :class:`Decoder`.

    ``path`` is a Lightning ``.ckpt`` file or a ZeRO checkpoint directory (DeepSpeed strategies;
    its shards are consolidated in memory, fp32). The run's resolved config travels in the
    checkpoint (``hyper_parameters["config"]``).

    Files are read as plain data only (``weights_only=True``; see
    :mod:`unicache_train.checkpoint.safe_load`): a file whose pickle would call code is refused
    with :class:`~unicache_train.checkpoint.safe_load.UnsafeCheckpointError`, nothing run. A
    file or directory with a checksum manifest is verified first.

    Raises:
        IntegrityError: corrupt, truncated or empty (named).
        CheckpointError: no state dict or config, or weights of another model (named).
        ConfigError: the saved config is invalid, or its model would not fit in memory.
        FileNotFoundError: no such file or directory.
    """
    from unicache_train.preflight import check_model_fits

    path = Path(path)
    if path.is_dir():
        from unicache_train.checkpoint.zero import (
            consolidate_zero_checkpoint,
            is_zero_checkpoint,
            read_zero_client_state,
        )

        if not is_zero_checkpoint(path):
            raise CheckpointError(
                f"{path}: a directory but not a ZeRO checkpoint (no 'latest' file)"
            )
        ckpt = read_zero_client_state(path)
        ckpt["state_dict"] = consolidate_zero_checkpoint(path)
    elif path.is_file():
        ckpt = read_checkpoint(path, mmap=True)
    else:
        raise FileNotFoundError(f"checkpoint not found: {path}")
    hparams = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if not isinstance(hparams, Mapping) or not isinstance(hparams.get("config"), Mapping):
        raise CheckpointError(
            f"{path}: not a unicache_train checkpoint (no hyper_parameters.config)"
        )
    try:
        config = RunConfig.from_dict(dict(hparams["config"]))
    except ConfigError as err:
        raise ConfigError(f"{path}: hyper_parameters.config: {err}") from None
    check_model_fits(config.model, f"{path}: hyper_parameters.config.model")
    model = Decoder(config.model)
    state = {
        k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")
    }
    if any(k.startswith("kv_retention.") for k in state):
        # A learned retention policy trained in the loop: a model parameter of the run
        # (compress/retention.py), attached before the strict load.
        from unicache_train.compress.retention import attach_retention

        attach_retention(model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_state_dict(state, expected, path, "the model its config describes")
    model.load_state_dict(state)
    model.eval()
    return model, config
