"""unicache_train: mHC hyper-connections and compression-aware KV-cache fine-tuning."""

__version__ = "0.1.0"
