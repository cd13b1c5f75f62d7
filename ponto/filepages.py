"""Give back the pages of files a process mapped and only touched while it started.

Importing a proxy's libraries maps their code and faults in every page their
static initializers and module bodies touch: gRPC's one 17 MB shared object
alone leaves 10.6 MB resident, OpenSSL's libcrypto 3.5 MB, libpython 3.9 MB;
27 MB of an idle worker's 63 MB RSS are such file pages. Serving needs far
fewer of them: once they are dropped from the process's page tables, a
minute of load under key auth, limits and the exact cache brought back 9.5
MB (docs/architecture.md, "Memory").

Dropping a clean page of a file loses nothing: the page is the file's, and
the next access maps it again from the page cache (or reads it again, if the
kernel reclaimed it meanwhile), as after any reclaim. A private mapping that
has been written (a library's relocated data: copy-on-write pages, counted as
`Anonymous` in smaps) holds the process's own bytes, which MADV_DONTNEED
would discard: such a mapping is never touched, nor is any writable one.

Linux only (smaps, madvise); elsewhere nothing is released.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Mapping", "parse_smaps", "releasable", "release_file_pages"]

# <sys/mman.h>; the same on every Linux architecture.
MADV_DONTNEED = 4


@dataclass(frozen=True, slots=True)
class Mapping:
    """One mapping of /proc/PID/smaps: its range, permissions ("r-xp"), what it
    maps ("/usr/lib/libc.so.6", "[heap]", "" for anonymous memory), and its
    resident and copy-on-write (anonymous) kB."""

    start: int
    end: int
    perms: str
    path: str
    rss_kb: int
    anonymous_kb: int


def parse_smaps(lines: Iterable[str]) -> list[Mapping]:
    """The mappings of an smaps text, in its order. A mapping's figures are the
    lines that follow its header; a figure it lacks reads 0."""
    out: list[Mapping] = []
    head: list[str] | None = None
    figures: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(" ")
        if not key.endswith(":"):  # a header: "lo-hi perms offset dev inode [path]"
            if head is not None:
                out.append(_mapping(head, figures))
            head, figures = line.split(maxsplit=5), {}
        elif key in ("Rss:", "Anonymous:"):
            figures[key] = int(rest.split()[0])
    if head is not None:
        out.append(_mapping(head, figures))
    return out


def _mapping(head: list[str], figures: dict[str, int]) -> Mapping:
    lo, _, hi = head[0].partition("-")
    return Mapping(
        start=int(lo, 16),
        end=int(hi, 16),
        perms=head[1],
        path=head[5].rstrip("\n") if len(head) > 5 else "",
        rss_kb=figures.get("Rss:", 0),
        anonymous_kb=figures.get("Anonymous:", 0),
    )


def releasable(mapping: Mapping) -> bool:
    """Whether dropping `mapping`'s resident pages loses nothing: a file's pages
    (its path absolute; not "[heap]", "[stack]", anonymous memory), none of
    them the process's own copy (no copy-on-write page), in a mapping nobody
    may write to, and some of them resident."""
    return (
        mapping.path.startswith("/")
        and "w" not in mapping.perms
        and mapping.anonymous_kb == 0
        and mapping.rss_kb > 0
    )


def release_file_pages(
    smaps: str = "/proc/self/smaps",
    madvise: Callable[[int, int], bool] | None = None,
) -> int:
    """Drop this process's resident pages of every releasable mapping of
    `smaps` (MADV_DONTNEED by `madvise(start, length)`, true if done); the kB
    dropped. 0 where there is no smaps or no madvise.

    Call it at a quiet point of the start, after the imports, on the thread
    that imports: it assumes no other thread maps or unmaps files (loads a
    library) between its read of smaps and its last madvise, which would let
    another file's writable mapping take a listed range. Refaulting what is
    used next costs a minor fault a page (a few thousand, once).
    """
    if madvise is None:
        madvise = _libc_madvise()
        if madvise is None:
            return 0
    try:
        with open(smaps) as f:
            mappings = parse_smaps(f)
    except OSError:
        return 0
    dropped = 0
    for m in mappings:
        if releasable(m) and madvise(m.start, m.end - m.start):
            dropped += m.rss_kb
    return dropped


def _libc_madvise() -> Callable[[int, int], bool] | None:
    """libc's madvise(addr, length, MADV_DONTNEED) as a call, or None off
    Linux. ctypes is loaded here, by the one caller at start (some 0.2 MB)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # noqa: PLC0415 - only a process that releases pages loads it

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int

    def madvise(start: int, length: int) -> bool:
        return bool(call(start, length, MADV_DONTNEED) == 0)

    return madvise
