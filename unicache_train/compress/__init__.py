"""KV-cache compression: one method per file, combined by a composer."""

from unicache_train.compress.base import (
    CompressionInput,
    IdentityCompressor,
    KVCompressor,
    KVSegment,
)

__all__ = ["CompressionInput", "IdentityCompressor", "KVCompressor", "KVSegment"]
