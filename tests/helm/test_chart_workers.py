"""The chart's `proxy.workers`: given, or the whole cores of the proxy's CPU limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helm.test_chart import Doc, container, flags, helm, one, refused, render, values_file

__all__ = ["helm"]  # the session fixture, used here by name


def workers(docs: list[Doc], region: str = "us-east") -> str:
    return flags(container(one(docs, "Deployment", f"ponto-proxy-{region}")))["--workers"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, "2"),  # the default CPU limit is "2"
        ({"proxy": {"workers": 3}}, "3"),
        ({"proxy": {"resources": {"limits": {"cpu": "1500m"}}}}, "1"),
        ({"proxy": {"resources": {"limits": {"cpu": "4000m"}}}}, "4"),
        ({"proxy": {"resources": {"limits": {"cpu": 2.5}}}}, "2"),
        ({"proxy": {"resources": {"limits": {"cpu": "250m"}}}}, "1"),
        # Values merge into the defaults: null removes the default limit.
        ({"proxy": {"resources": {"limits": {"cpu": None}}}}, "1"),
    ],
)
def test_workers_are_given_or_follow_the_cpu_limit(
    helm: Path, tmp_path: Path, values: Doc, expected: str
) -> None:
    assert workers(render(helm, "-f", values_file(tmp_path, values))) == expected


def test_a_region_takes_its_own_workers_or_its_own_limit(helm: Path, tmp_path: Path) -> None:
    regions: list[Doc] = [
        {"name": "us-east", "lat": 38.9, "lon": -77.4, "workers": 1},
        {"name": "eu-west", "lat": 53.3, "lon": -6.3, "resources": {"limits": {"cpu": "3"}}},
        {"name": "ap-southeast", "lat": 1.35, "lon": 103.8},
    ]
    docs = render(helm, "-f", values_file(tmp_path, {"proxy": {"regions": regions}}))
    assert [workers(docs, r["name"]) for r in regions] == ["1", "3", "2"]


@pytest.mark.parametrize("bad", [-1, "two"])
def test_schema_refuses_a_wrong_worker_count(helm: Path, tmp_path: Path, bad: object) -> None:
    message = refused(helm, "-f", values_file(tmp_path, {"proxy": {"workers": bad}}))
    assert "proxy.workers" in message
