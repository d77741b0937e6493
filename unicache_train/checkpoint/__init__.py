"""Checkpoint loading, HF import and export."""

from unicache_train.checkpoint.hf import export_hf, import_hf
from unicache_train.checkpoint.hf_config import HFCheckpointError
from unicache_train.checkpoint.lightning_ckpt import load_checkpoint

__all__ = ["HFCheckpointError", "export_hf", "import_hf", "load_checkpoint"]
