"""Remote-code templates copied next to mHC exports (loaded with ``trust_remote_code=True``).

The files are self-contained (torch + transformers only): they must never import unicache_train.
"""
