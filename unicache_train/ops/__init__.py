"""Functional ops with their pure-PyTorch references (the spec, and the CPU path).

Note: ``unicache_train.ops.sinkhorn`` is the function; the module that defines it is
``sys.modules["unicache_train.ops.sinkhorn"]`` (``importlib.import_module`` returns it).
"""

from unicache_train.ops.sinkhorn import sinkhorn, sinkhorn_reference

__all__ = ["sinkhorn", "sinkhorn_reference"]
