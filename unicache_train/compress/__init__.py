"""KV-cache compression: one method per file, combined by a composer.

UniCache (docs/architecture.md#unicache-pipeline): :class:`UniCacheCompressor` built from a
:class:`UniCacheConfig` (presets in :mod:`unicache_train.compress.presets`). The steps
(:class:`HeadMerge`, :class:`Importance`, :class:`LayerSchedule`, :class:`ModalityBudget`,
:class:`AlignmentProtect`, :class:`MergeEvict`, :class:`Quantize`, :class:`DynamicFallback`)
compose through :class:`ComposedCompressor`.

Selections (docs/compression_methods.md): the importance step can be swapped
(``UniCacheConfig.selection``) for :class:`SinksRecent` (StreamingLLM, arXiv 2309.17453),
:class:`SnapKV` (arXiv 2404.14469) or a learned :class:`RetentionPolicy` (DMS-like, arXiv
2506.05345), whose parameters live on the model (``model.kv_retention``).

xKV (arXiv 2503.18893; docs/architecture.md#xkv): :class:`XKVCompressor` built from an
:class:`XKVConfig`, cross-layer SVD of contiguous layer groups (optionally after UniCache token
compression).
"""

from unicache_train.compress.budget import ModalityBudget
from unicache_train.compress.composer import (
    ComposedCompressor,
    PerLayerCompressor,
    UniCacheCompressor,
)
from unicache_train.compress.config import UniCacheConfig, XKVConfig
from unicache_train.compress.fallback import DynamicFallback
from unicache_train.compress.head_merge import HeadMerge
from unicache_train.compress.importance import Importance
from unicache_train.compress.merge_evict import MergeEvict
from unicache_train.compress.protect import AlignmentProtect
from unicache_train.compress.quantize import Quantize
from unicache_train.compress.retention import RetentionPolicy
from unicache_train.compress.schedule import LayerSchedule
from unicache_train.compress.sinks_recent import SinksRecent
from unicache_train.compress.snapkv import SnapKV
from unicache_train.compress.state import CompressionState
from unicache_train.compress.xkv import XKVCompressor
from unicache_train.seam import (
    MODALITY_NAMES,
    NUM_MODALITIES,
    CompressionInput,
    IdentityCompressor,
    KVCompressor,
    KVSegment,
    QuantizedKV,
)

__all__ = [
    "MODALITY_NAMES",
    "NUM_MODALITIES",
    "AlignmentProtect",
    "ComposedCompressor",
    "CompressionInput",
    "CompressionState",
    "DynamicFallback",
    "HeadMerge",
    "IdentityCompressor",
    "Importance",
    "KVCompressor",
    "KVSegment",
    "LayerSchedule",
    "MergeEvict",
    "ModalityBudget",
    "PerLayerCompressor",
    "Quantize",
    "QuantizedKV",
    "RetentionPolicy",
    "SinksRecent",
    "SnapKV",
    "UniCacheCompressor",
    "UniCacheConfig",
    "XKVCompressor",
    "XKVConfig",
]
