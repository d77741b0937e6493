"""Model code: pure PyTorch (no Lightning, no distributed imports)."""

from unicache_train.model.decoder import Decoder, DecoderOutput
from unicache_train.model.kv_cache import KVCache

__all__ = ["Decoder", "DecoderOutput", "KVCache"]
