"""`ponto-control`: run one control plane replica."""

from __future__ import annotations

import os
import sys

# gRPC core logs each failed TLS handshake on stderr at INFO (`I1202 ...
# ssl_transport_security.cc ... Handshake failed`), once per connection
# attempt, outside this process's log format; the Routing API logs refused
# callers itself. Read once, when grpc is first imported: set before. A user
# who sets GRPC_VERBOSITY (to debug) keeps it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import uvloop

from controlplane.app import serve
from controlplane.settings import parse
from ponto.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    settings = parse(sys.argv[1:] if argv is None else argv)
    setup_logging(settings.log_level)
    uvloop.run(serve(settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
