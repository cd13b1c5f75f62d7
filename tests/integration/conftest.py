"""Fixtures of the integration tests."""

from __future__ import annotations

import gc
import warnings

import pytest

from tests.conftest import EtcdEndpoint


@pytest.fixture
def etcd_endpoint(request: pytest.FixtureRequest) -> EtcdEndpoint:
    """The session etcd, wiped (clean_etcd).

    Resolved lazily so that a test that does not need etcd (the store
    contract's memory variant) never starts it. Sync on purpose: an async
    fixture cannot resolve another async fixture from inside the running loop.

    Starting the session etcd probes for Docker first (tests/conftest.py), and
    docker-py leaks a unix socket when no engine answers; the socket sits in a
    reference cycle, and its ResourceWarning would fail (filterwarnings=error)
    whichever test the garbage collector happens to run in. It is collected
    here, with that one warning ignored.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        endpoint: EtcdEndpoint = request.getfixturevalue("clean_etcd")
        gc.collect()
    return endpoint
