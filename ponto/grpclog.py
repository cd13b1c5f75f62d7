"""gRPC core's own log lines, kept off a process's stderr.

gRPC core writes lines of its own on stderr (`I1202 ... ssl_transport_security.cc
... Handshake failed`, once per connection attempt; a key that is not its
certificate's, at ERROR), outside the process's log format and beside the one
line Ponto says about the same failure. It reads GRPC_VERBOSITY once, when
grpc is first imported: `quiet_import` imports it under a level unless the
user chose one (to debug), then removes the variable again, so that the
processes the importer starts (the tests' control planes; a group's workers,
which import it the same way) keep theirs. The callers import it before
anything else that imports grpc (ruff's E402 is off in those modules).
"""

from __future__ import annotations

import os

__all__ = ["quiet_import"]


def quiet_import(level: str) -> None:
    """Import grpc with gRPC core's log at `level` ("ERROR", "NONE") unless
    GRPC_VERBOSITY is set; no effect once grpc is imported."""
    chosen = "GRPC_VERBOSITY" in os.environ
    if not chosen:
        os.environ["GRPC_VERBOSITY"] = level
    try:
        import grpc  # noqa: F401, PLC0415 - imported for its read of GRPC_VERBOSITY
    finally:
        if not chosen:
            del os.environ["GRPC_VERBOSITY"]
