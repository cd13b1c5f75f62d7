"""`ponto-control`: run one control plane replica."""

from __future__ import annotations

import logging
import sys

from ponto.grpclog import quiet_import

# gRPC core logs each failed TLS handshake at INFO, once per connection
# attempt; the Routing API logs refused callers itself.
quiet_import("ERROR")

import uvloop

from controlplane import audit
from controlplane.app import serve
from controlplane.settings import parse
from ponto.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    settings = parse(sys.argv[1:] if argv is None else argv)
    setup_logging(settings.log_level)
    # Admin actions are few, and their lines may be all that is left of them
    # after an etcd restore (controlplane.audit): kept at any --log-level.
    audit.LINES.setLevel(logging.INFO)
    return uvloop.run(serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
