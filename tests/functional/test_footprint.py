"""What a proxy loads: libraries a configuration does not use stay out of the
process (docs/architecture.md, "Memory: the footprint is the base plus the
cache bound"; issue 17's RSS aim).

Each test builds and starts the app in a fresh interpreter, as `ponto-proxy`
does, and reads sys.modules: a library imported anywhere on the way, even by
a module that only names it, shows up there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ponto.devenv import python_entry, spawn
from ponto.geodb import write_city_db
from tests.geodb import DOC_RANGES

SERVE = """
import asyncio, json, sys, tempfile
import dataplane.run
from dataplane.http.server import build_app
from dataplane.settings import parse
from aiohttp.test_utils import TestServer

async def main(flags):
    with tempfile.TemporaryDirectory() as d:
        flags = ["--region=r1", "--control-plane=127.0.0.1:9", f"--state-dir={d}", *flags]
        app = build_app(parse(flags))
        server = TestServer(app)
        await server.start_server()
        await server.close()

asyncio.run(main(sys.argv[1:]))
print(json.dumps(sorted(sys.modules)))
"""


def loaded(*flags: str, interpreter: tuple[str, ...] = ()) -> set[str]:
    """sys.modules of a proxy started with `flags` (and the interpreter's own
    `interpreter` flags): each module, and each package it belongs to ("a.b.c"
    as "a.b.c", "a.b" and "a")."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, *interpreter, "-c", SERVE, *flags],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    names = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        ".".join(parts[:i])
        for parts in (n.split(".") for n in names)
        for i in range(1, len(parts) + 1)
    }


def test_a_default_proxy_loads_neither_geoip_code_nor_importlib_metadata() -> None:
    """geoip2 and maxminddb only with --geoip-db; importlib.metadata (and the
    zipfile it brings) not even for the proxy's own version (ponto.release)."""
    assert {"geoip2", "maxminddb", "importlib.metadata", "zipfile"} & loaded() == set()


def test_a_proxy_with_a_geoip_database_loads_geoip2(tmp_path: Path) -> None:
    db = write_city_db(tmp_path / "city.mmdb", DOC_RANGES)
    assert {"geoip2", "maxminddb"} <= loaded(f"--geoip-db={db}")


def test_a_proxy_starts_without_docstrings_or_asserts() -> None:
    """PYTHONOPTIMIZE=2 (`python -OO`) is a documented way to a smaller base
    (docs/architecture.md, "Memory"): nothing the proxy loads on its way to
    serving may read a docstring (None under -OO) or need an assert."""
    assert "dataplane.http.server" in loaded(interpreter=("-OO",))


def status_kb(pid: int | str, *fields: str) -> list[int]:
    """`fields` of /proc/PID/status (RssFile, VmHWM...), in kB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    values = {k: v for k, _, v in (line.partition(":") for line in lines)}
    return [int(values[field].split()[0]) for field in fields]


def test_a_serving_proxy_keeps_fewer_file_pages_than_its_imports_touched(tmp_path: Path) -> None:
    """A proxy drops the pages of its libraries' code that starting touched
    (ponto.filepages): those of its imports before it builds the app, so
    that its peak since start is where the imports end (a bare `import
    dataplane.run`: 58 MB; without this release, 62 MB at the first table);
    then, once its control-plane link has tried (here: refused), those of
    gRPC core's start, holding fewer file pages than the bare import leaves
    (21 MB; with the release 13 MB, without it 26)."""
    probe = (
        "import dataplane.run\n"
        "from tests.functional.test_footprint import status_kb\n"
        "print(*status_kb('self', 'VmRSS', 'RssFile'))\n"
    )
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    rss, rss_file = map(int, imported.stdout.split())
    ready = tmp_path / "proxy.addr"
    flags = ["--region=r1", "--control-plane=127.0.0.1:9", f"--state-dir={tmp_path / 'state'}",
             "--listen=127.0.0.1:0", "--workers=1", f"--ready-file={ready}",
             "--log-level=DEBUG"]  # fmt: skip
    proxy = spawn("proxy", [*python_entry("dataplane"), *flags], tmp_path, ready_file=ready)
    try:
        deadline = time.monotonic() + 30
        while "released" not in proxy.log_path.read_text():
            assert time.monotonic() < deadline, "the proxy released no file pages"
            time.sleep(0.1)
        peak, held = status_kb(proxy.pid, "VmHWM", "RssFile")
        assert held < rss_file
        assert peak < rss + 1024, (peak, rss)
    finally:
        proxy.stop()
