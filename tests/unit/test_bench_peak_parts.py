"""bench/peak_parts.py: the probe loaded beside a proxy reports its memory's
parts when asked, each allocator's figures read (not left out unnoticed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.peak_parts import PROBE, ask


def test_the_probe_reports_each_part_when_asked(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(PROBE)
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PEAK_PARTS_DIR": str(tmp_path),
    }
    # "dataplane" among its arguments, as the proxy's command line has it.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "dataplane"], env=env
    )
    try:
        report = ask(tmp_path, "now", timeout=30)
    finally:
        child.kill()
        child.wait()
    assert report["rss_kb"]["VmRSS"] > 0
    assert report["rollup_kb"]["Anonymous"] > 0
    files = dict(report["file_pages_kb"])
    assert any(name.startswith(("libpython", "python", "libc.so")) for name in files), files
    assert all(kb > 0 for kb in files.values())
    assert report["malloc"]["heap"] > 0
    pymalloc = report["pymalloc"]
    assert pymalloc["arenas allocated current"] > 0
    assert 0 < pymalloc["bytes in allocated blocks"] < pymalloc["Total"]
    assert report["gc_objects"] > 0
    assert set(report["given_back_kb"]) == {"gc", "trim"}
