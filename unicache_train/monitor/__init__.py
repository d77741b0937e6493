"""Monitoring: per-layer signal gain, composite mHC gain, compression quality; W&B helpers."""

from unicache_train.monitor.callbacks import (
    CompressionQualityMonitor,
    SignalGainMonitor,
    find_callback,
)
from unicache_train.monitor.gain import (
    GainAlarm,
    MixStats,
    amax_gain,
    composite_mix,
    mix_stats,
)
from unicache_train.monitor.metrics import compression_metrics

__all__ = [
    "CompressionQualityMonitor",
    "GainAlarm",
    "MixStats",
    "SignalGainMonitor",
    "amax_gain",
    "composite_mix",
    "compression_metrics",
    "find_callback",
    "mix_stats",
]
