"""Trial 48: /metrics on the public port lets any caller read every tenant's
name and usage; a proxy that serves it so on an address other hosts reach says
so as it starts (docs/security.md, "Who can read /metrics")."""

from __future__ import annotations

import pytest

from dataplane.run import public_metrics
from dataplane.settings import parse


@pytest.mark.parametrize(
    ("flags", "public"),
    [
        (["--listen", "0.0.0.0:8080"], True),
        (["--listen", "10.1.2.3:8080"], True),
        (["--listen", "[::]:8080"], True),
        (["--listen", "proxy.internal:8080"], True),
        (["--listen", "127.0.0.1:8080"], False),
        (["--listen", "[::1]:8080"], False),
        (["--listen", "localhost:8080"], False),
        (["--listen", "0.0.0.0:8080", "--metrics-listen", "127.0.0.1:9090"], False),
    ],
)
def test_metrics_on_a_reachable_public_port_are_told(flags: list[str], public: bool) -> None:
    settings = parse(["--region", "r", "--control-plane", "127.0.0.1:9", *flags])
    assert public_metrics(settings) is public
