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

Only the mappings of the executable and of the shared objects loaded before
smaps is read are dropped, never another file's (a GeoIP database, a model,
Python's mmap module): the loader never unmaps a loaded object (CPython never
unloads one), so its ranges still hold its pages when madvise reaches them,
whatever other threads do meanwhile. Another file's mapping may be unmapped
by its thread after the read and its range taken by that thread's malloc,
whose live bytes MADV_DONTNEED would zero; an object a thread is loading
(dlopen maps it whole, then its data writable over it) is not yet listed.

Linux only (smaps, madvise); elsewhere nothing is released.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

__all__ = ["Mapping", "loaded_objects", "parse_smaps", "releasable", "release_file_pages"]

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


def releasable(mapping: Mapping, objects: Collection[str]) -> bool:
    """Whether dropping `mapping`'s resident pages loses nothing: pages of one of
    the loaded `objects` (the executable's and shared objects' real paths),
    none of them the process's own copy (no copy-on-write page), in a mapping
    nobody may write to, and some of them resident."""
    return (
        mapping.path in objects
        and "w" not in mapping.perms
        and mapping.anonymous_kb == 0
        and mapping.rss_kb > 0
    )


def release_file_pages(
    smaps: str = "/proc/self/smaps",
    madvise: Callable[[int, int], bool] | None = None,
    objects: Callable[[], Collection[str]] | None = None,
) -> int:
    """Drop this process's resident pages of every releasable mapping of
    `smaps` (MADV_DONTNEED by `madvise(start, length)`, true if done) of the
    `objects()` loaded, listed before smaps is read; the kB dropped. 0 where
    there is no smaps or no madvise.

    Safe while other threads run, as long as none unloads a shared object
    (dlclose; see the module docstring). Refaulting what is used next costs a
    minor fault a page (a few thousand, once).
    """
    if madvise is None:
        madvise = _libc_madvise()
        if madvise is None:
            return 0
    try:
        loaded = (objects or loaded_objects)()
        with open(smaps) as f:
            mappings = parse_smaps(f)
    except OSError:
        return 0
    dropped = 0
    for m in mappings:
        if releasable(m, loaded) and madvise(m.start, m.end - m.start):
            dropped += m.rss_kb
    return dropped


def loaded_objects() -> frozenset[str]:
    """The real paths of the executable and of every shared object the loader
    has mapped (dl_iterate_phdr: an object is listed once mapped whole)."""
    import ctypes  # noqa: PLC0415 - see _libc_madvise

    class Info(ctypes.Structure):
        _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]

    names: list[bytes] = []

    def each(info: ctypes._Pointer[Info], size: int, data: int | None) -> int:
        names.append(info.contents.name or b"")
        return 0

    visit = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)
    ctypes.CDLL(None).dl_iterate_phdr(visit(each), None)
    # The executable is listed unnamed, the vDSO by a bare name.
    paths = [os.readlink("/proc/self/exe").encode()] + [n for n in names if n.startswith(b"/")]
    return frozenset(os.path.realpath(os.fsdecode(n)) for n in paths)


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
