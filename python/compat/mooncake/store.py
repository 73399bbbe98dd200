"""Mooncake's ``mooncake.store`` API on a mooncake-fs mount: the names of
mooncake_fs.mooncake_store (MooncakeDistributedStore, ReplicateConfig,
SoftPinAction, ...)."""

from mooncake_fs.mooncake_store import *  # noqa: F401,F403
from mooncake_fs.mooncake_store import __all__  # noqa: F401
