"""State store: protocol, etcd implementation, in-memory implementation."""

from controlplane.store.base import (
    Conflict,
    Fence,
    KeyValue,
    LeaseExpired,
    Listing,
    StateStore,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "Conflict",
    "Fence",
    "KeyValue",
    "LeaseExpired",
    "Listing",
    "StateStore",
    "StoreError",
    "StoreUnavailable",
]
