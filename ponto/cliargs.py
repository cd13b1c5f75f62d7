"""Argument types shared by the command lines (ponto-proxy, ponto-control-plane,
pontoctl, the origin simulator)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

__all__ = ["cannot_listen", "finite_float", "path"]


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


def cannot_listen(address: str, exc: OSError) -> str:
    """Why `address` cannot be listened on, in one line: the errno's text
    alone (the event loop's own message repeats the address). A name that
    does not resolve (socket.gaierror) has a negative errno of getaddrinfo's,
    which os.strerror does not know."""
    why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
    return f"cannot listen on {address}: {why}"
