import os

import pytest
import torch

from unicache_train.model.config import ModelConfig

# Never touch the network or prompt for a login from tests.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: The tiny decoder most tests build (GQA 4 query / 2 KV heads, vocabulary 97): small enough for
#: CPU, large enough that every head, group and layer path runs.
TINY_MODEL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_model_config(**overrides) -> ModelConfig:
    """:data:`TINY_MODEL` with ``overrides`` (``num_hidden_layers=3``, ``residual_mode="mhc"``);
    import it (``from conftest import tiny_model_config``) where a module-level helper needs it,
    or take the :func:`tiny_config` fixture in a test."""
    return ModelConfig(**{**TINY_MODEL, **overrides})


@pytest.fixture
def tiny_config():
    """The :func:`tiny_model_config` factory."""
    return tiny_model_config
