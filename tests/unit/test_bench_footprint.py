"""bench/footprint.py: packages are measured after the packages they import, so
each one's figure is its own, and the measuring interpreter reports each one."""

from __future__ import annotations

from bench.footprint import groups, imports


def test_a_package_comes_after_those_it_imports() -> None:
    # As -X importtime lists them, each module when it finished: aiohttp's
    # first submodule finished before yarl, which aiohttp imports, and
    # aiohttp itself last.
    order = ["aiohttp.hdrs", "yarl._url", "yarl", "aiohttp.client", "aiohttp", "email"]
    assert groups(order) == [
        ["yarl._url", "yarl"],
        ["aiohttp.hdrs", "aiohttp.client", "aiohttp"],
        ["email"],
    ]


def test_each_package_imported_gets_its_row() -> None:
    report = imports("json")
    packages = [row["package"] for row in report["packages"]]
    assert "json" in packages
    assert len(packages) == len(set(packages))
    assert report["start_kb"]["VmRSS"] > 0
