"""State store: protocol, etcd implementation, in-memory implementation."""

from controlplane.store.base import (
    Conflict,
    KeyValue,
    LeaseExpired,
    Listing,
    StateStore,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "Conflict",
    "KeyValue",
    "LeaseExpired",
    "Listing",
    "StateStore",
    "StoreError",
    "StoreUnavailable",
]
