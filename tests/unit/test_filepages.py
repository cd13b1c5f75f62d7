"""ponto.filepages: which mappings' pages may be dropped, and that dropping them
loses nothing (in this process: the release is safe wherever it runs)."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

from ponto.filepages import Mapping, loaded_objects, parse_smaps, releasable, release_file_pages

SMAPS = """\
55d0c0000000-55d0c0001000 r--p 00000000 fd:01 131 /usr/bin/python3.11
Size:                  4 kB
Rss:                   4 kB
Anonymous:             0 kB
VmFlags: rd mr mw me sd
7f0000000000-7f0000010000 r-xp 00001000 fd:01 132 /usr/lib/libcrypto.so.3
Rss:                  48 kB
Pss:                  12 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me sd
7f0000010000-7f0000012000 r--p 00011000 fd:01 132 /usr/lib/libcrypto.so.3
Rss:                   8 kB
Anonymous:             8 kB
7f0000012000-7f0000013000 rw-p 00013000 fd:01 132 /usr/lib/libcrypto.so.3
Rss:                   4 kB
Anonymous:             0 kB
7f0000020000-7f0000040000 ---p 00000000 fd:01 132 /usr/lib/libcrypto.so.3
Rss:                   0 kB
Anonymous:             0 kB
7f0000040000-7f0000041000 r--s 00000000 fd:01 140 /data/city db.mmdb (deleted)
Rss:                   4 kB
Anonymous:             0 kB
7f0000050000-7f0000150000 rw-p 00000000 00:00 0 [heap]
Rss:                1024 kB
Anonymous:          1024 kB
7f0000150000-7f0000160000 r--p 00000000 00:00 0
Rss:                  64 kB
Anonymous:            64 kB
7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   8 kB
Anonymous:             0 kB
"""
# What the loader has mapped: the executable and the library, not the
# database (mapped by its reader, which may unmap it at any time).
OBJECTS = frozenset({"/usr/bin/python3.11", "/usr/lib/libcrypto.so.3"})


def test_smaps_reads_as_its_mappings_with_their_figures() -> None:
    maps = parse_smaps(SMAPS.splitlines(keepends=True))
    assert [m.path for m in maps] == [
        "/usr/bin/python3.11",
        *["/usr/lib/libcrypto.so.3"] * 4,
        "/data/city db.mmdb (deleted)",
        "[heap]",
        "",
        "[vdso]",
    ]
    assert maps[1] == Mapping(0x7F0000000000, 0x7F0000010000, "r-xp", maps[1].path, 48, 0)
    assert (maps[2].rss_kb, maps[2].anonymous_kb) == (8, 8)


def test_only_clean_read_only_resident_pages_of_loaded_objects_are_releasable() -> None:
    maps = parse_smaps(SMAPS.splitlines(keepends=True))
    # The binary's and the library's code; not the library's relocated data
    # (its copy-on-write pages are the process's own), its writable data,
    # its guard (nothing resident), a file no loaded object is, the heap,
    # anonymous memory, the vdso.
    assert [releasable(m, OBJECTS) for m in maps] == [True, True] + [False] * 7
    assert releasable(maps[5], {maps[5].path})  # the database, were it an object


def test_the_release_advises_the_releasable_ranges_and_counts_what_was_dropped(
    tmp_path: Path,
) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    advised: list[tuple[int, int]] = []

    def madvise(start: int, length: int) -> bool:
        advised.append((start, length))
        return start != 0x55D0C0000000  # refused: not counted

    assert release_file_pages(str(smaps), madvise, lambda: OBJECTS) == 48
    assert advised == [(0x55D0C0000000, 0x1000), (0x7F0000000000, 0x10000)]
    assert release_file_pages(str(tmp_path / "none"), madvise, lambda: OBJECTS) == 0


def resident_kb(path: Path, perms: str) -> int:
    """The Rss of this process's one mapping of `path` with `perms`."""
    with open("/proc/self/smaps") as f:
        [m] = [m for m in parse_smaps(f) if (m.path, m.perms) == (str(path), perms)]
    return m.rss_kb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps and madvise are Linux's")
def test_loaded_objects_are_released_and_read_the_same_and_other_files_are_left_mapped(
    tmp_path: Path,
) -> None:
    data = bytes(range(256)) * 64  # 16 KiB, four pages
    path = tmp_path / "blob"
    path.write_bytes(data)
    with path.open("rb") as f:
        code = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with path.open("r+b") as f:
        copy = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    assert code[:] == data
    copy[:4] = b"mine"
    assert resident_kb(path, "r--s") == 16
    python = os.path.realpath(sys.executable)
    libraries = {p for p in loaded_objects() if p != python}
    assert libraries
    assert release_file_pages() > 0
    with open("/proc/self/smaps") as f:
        left = {m.path for m in parse_smaps(f) if m.rss_kb and m.perms == "r-xp"}
    # The libraries' code was dropped (but what this test runs mapped again)
    # ... and, still there, reads the same: the test goes on.
    assert libraries - left
    # A file mapped by mmap is no loaded object: its thread may unmap it at
    # any time and reuse its range, so it is never released.
    assert resident_kb(path, "r--s") == 16
    assert code[:] == data
    assert copy[:8] == b"mine" + data[4:8]  # the process's own copy was left alone
    assert path.read_bytes() == data
    code.close()
    copy.close()
