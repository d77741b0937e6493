"""Rebuild a model from one of our Lightning checkpoints (``.ckpt``)."""

from __future__ import annotations

from pathlib import Path

from unicache_train.checkpoint.safe_load import load_torch_file
from unicache_train.model import Decoder
from unicache_train.train.config import RunConfig


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> tuple[Decoder, RunConfig]:
    """Load a checkpoint written by our trainer into a plain :class:`Decoder`.

    ``path`` is a Lightning ``.ckpt`` file or a ZeRO checkpoint directory (DeepSpeed strategies;
    its shards are consolidated in memory, fp32). The run's resolved config travels in the
    checkpoint (``hyper_parameters["config"]``).

    Files are read as plain data only (``weights_only=True``; see
    :mod:`unicache_train.checkpoint.safe_load`): a file whose pickle would call code is refused
    with :class:`~unicache_train.checkpoint.safe_load.UnsafeCheckpointError`, nothing run.
    """
    path = Path(path)
    if path.is_dir():
        from unicache_train.checkpoint.zero import (
            consolidate_zero_checkpoint,
            is_zero_checkpoint,
            read_zero_client_state,
        )

        if not is_zero_checkpoint(path):
            raise ValueError(f"{path}: a directory but not a ZeRO checkpoint (no 'latest' file)")
        ckpt = read_zero_client_state(path)
        ckpt["state_dict"] = consolidate_zero_checkpoint(path)
    elif path.is_file():
        ckpt = load_torch_file(path, map_location=map_location)
    else:
        raise FileNotFoundError(f"checkpoint not found: {path}")
    hparams = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if "config" not in hparams:
        raise ValueError(f"{path}: not a unicache_train checkpoint (no hyper_parameters.config)")
    config = RunConfig.from_dict(hparams["config"])
    model = Decoder(config.model)
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()
             if k.startswith("model.")}
    model.load_state_dict(state)
    model.eval()
    return model, config
