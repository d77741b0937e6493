"""Rebuild a model from one of our Lightning checkpoints (``.ckpt``)."""

from __future__ import annotations

from pathlib import Path

import torch

from unicache_train.config import RunConfig
from unicache_train.model import Decoder


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> tuple[Decoder, RunConfig]:
    """Load a Lightning checkpoint written by our trainer into a plain :class:`Decoder`.

    The run's resolved config travels in the checkpoint (``hyper_parameters["config"]``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    # Lightning checkpoints hold loop state beside tensors; they are our own files.
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    hparams = ckpt.get("hyper_parameters", {})
    if "config" not in hparams:
        raise ValueError(f"{path}: not a unicache_train checkpoint (no hyper_parameters.config)")
    config = RunConfig.from_dict(hparams["config"])
    model = Decoder(config.model)
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()
             if k.startswith("model.")}
    model.load_state_dict(state)
    model.eval()
    return model, config
