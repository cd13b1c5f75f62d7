"""Fixtures of the integration tests."""

from __future__ import annotations

import pytest

from tests.conftest import EtcdEndpoint


@pytest.fixture
def etcd_endpoint(request: pytest.FixtureRequest) -> EtcdEndpoint:
    """The session etcd, wiped (clean_etcd).

    Resolved lazily so that a test that does not need etcd (the store
    contract's memory variant) never starts it. Sync on purpose: an async
    fixture cannot resolve another async fixture from inside the running loop.
    """
    endpoint: EtcdEndpoint = request.getfixturevalue("clean_etcd")
    return endpoint
