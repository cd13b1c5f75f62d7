"""State store: protocol, etcd implementation, in-memory implementation."""

from controlplane.store.base import (
    MAX_REQUEST_BYTES,
    MAX_TXN_OPS,
    Conflict,
    Fence,
    KeyValue,
    LeaseExpired,
    Listing,
    OutcomeUnknown,
    StateStore,
    StoreError,
    StoreUnavailable,
    Write,
    request_bytes,
    txn_size,
)

__all__ = [
    "MAX_REQUEST_BYTES",
    "MAX_TXN_OPS",
    "Conflict",
    "Fence",
    "KeyValue",
    "LeaseExpired",
    "Listing",
    "OutcomeUnknown",
    "StateStore",
    "StoreError",
    "StoreUnavailable",
    "Write",
    "request_bytes",
    "txn_size",
]
