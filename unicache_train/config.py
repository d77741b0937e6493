"""Transitional: the run configuration now lives with the packages it configures
(:mod:`unicache_train.model.config`, :mod:`unicache_train.data.config`,
:mod:`unicache_train.train.config`; errors and YAML loading in :mod:`unicache_train.validation`).
This module only re-exports them while the restructure lands, and is removed with it."""

from unicache_train.data.config import *  # noqa: F403
from unicache_train.model.config import *  # noqa: F403
from unicache_train.train.config import *  # noqa: F403
from unicache_train.validation import ConfigError, apply_overrides, load_yaml  # noqa: F401
