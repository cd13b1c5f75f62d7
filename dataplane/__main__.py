"""`ponto-proxy` and `python -m dataplane`: run one edge proxy (dataplane.run).

This module imports only what holding the signals needs (`signal`), and holds
them before the proxy's own imports (aiohttp, gRPC, uvloop: about half a
second): a SIGTERM or a Ctrl-C that comes meanwhile waits for the proxy's
handlers, which stop it cleanly, instead of killing it mid-import with a
traceback (dataplane.stopsignals).
"""

from __future__ import annotations

from dataplane.stopsignals import signals_held


def main(argv: list[str] | None = None) -> int:
    with signals_held():
        from dataplane.run import main as run  # noqa: PLC0415 - after the hold, see above

        return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
