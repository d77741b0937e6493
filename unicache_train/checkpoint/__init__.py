"""Checkpoint loading, HF import and export."""

from unicache_train.checkpoint.lightning_ckpt import load_checkpoint

__all__ = ["load_checkpoint"]
