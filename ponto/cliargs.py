"""Argument types shared by the command lines (ponto-proxy, ponto-control-plane,
pontoctl, the origin simulator)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import NoReturn

__all__ = [
    "OneLineParser",
    "cannot_listen",
    "finite_float",
    "hostport",
    "listen_address",
    "path",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse with its refusals in the one line a server's start says them
    in: `PROG: error: MESSAGE`, without the usage block argparse prints first
    (ponto-proxy's is 34 lines, which a container's log shows above the reason
    and a log search splits from it). --help still prints the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def finite_float(text: str) -> float:
    """A number, as argparse's `type=float` reads it, but never NaN or an
    infinity: a NaN passes every `value <= 0` check made of it (every
    comparison with it is false) and turns up later as a deadline that fails
    every request; an infinite timeout or size is a mistake to say at start.
    Each flag's own range is still checked by its parser."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def path(text: str) -> Path:
    """A path, as argparse's `type=Path` reads it, but never empty: Path("")
    is the current directory, where an unset variable in a script
    (`--state-dir "$STATE_DIR"`) would have files written unasked."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text)


def listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT to listen on, read alike by every command line (the proxy's
    --listen and --metrics-listen, the control plane's three, the origin
    simulator's, the benchmarks'). PORT is 0 to 65535, 0 for any free one, in
    ASCII digits (int() takes "٨٠" and "+80", which no other tool would); an
    IPv6 HOST goes in brackets, since "::1:80" could be either; an empty HOST is
    every IPv4 interface, 0.0.0.0.

    The control plane had parsed its own: a port past 65535 reached gRPC,
    which bound 70000 as 4464 (review 38), and aiohttp, which did the same for
    --http-listen; ":7070" was refused by gRPC as "in use or not this host's"."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if (bracketed and not host) or "[" in host or "]" in host or (":" in host and not bracketed):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with an IPv6 HOST in brackets, [ADDR]:PORT, got {text!r}"
        )
    if not sep or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 0-65535, got {text!r}")
    return host or "0.0.0.0", int(port)


def hostport(host: str, port: int) -> str:
    """`host` and `port` as HOST:PORT, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cannot_listen(address: str, exc: OSError) -> str:
    """Why `address` cannot be listened on, in one line: the errno's text
    alone (the event loop's own message repeats the address). A name that
    does not resolve (socket.gaierror) has a negative errno of getaddrinfo's,
    which os.strerror does not know."""
    why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
    return f"cannot listen on {address}: {why}"
