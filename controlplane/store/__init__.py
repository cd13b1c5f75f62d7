"""State store: protocol, etcd implementation, in-memory implementation."""

from controlplane.store.base import (
    MAX_TXN_OPS,
    Conflict,
    Fence,
    KeyValue,
    LeaseExpired,
    Listing,
    StateStore,
    StoreError,
    StoreUnavailable,
    Write,
    txn_size,
)

__all__ = [
    "MAX_TXN_OPS",
    "Conflict",
    "Fence",
    "KeyValue",
    "LeaseExpired",
    "Listing",
    "StateStore",
    "StoreError",
    "StoreUnavailable",
    "Write",
    "txn_size",
]
