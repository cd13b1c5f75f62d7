"""Checks the chart makes at render time, where Kubernetes would otherwise accept
the objects and fail later (pods never created, a Service rendered over another) or
refuse them with a message that does not name the value to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helm.test_chart import Doc, helm, objects, refused, render, values_file

__all__ = ["helm"]  # the session fixture, used here by name


def _regions(*names: str) -> Doc:
    return {"proxy": {"regions": [{"name": n, "lat": 1, "lon": 2} for n in names]}}


# ---------------------------------------------------------------- names


def test_the_metrics_service_name_is_checked_against_the_dns_label_limit(
    helm: Path, tmp_path: Path
) -> None:
    # "<fullname>-proxy-<region>" is 56 characters, its metrics Service's name 64.
    name = "f" * 42
    values = {
        **_regions("us-east"),
        "etcd": {"enabled": False, "external": {"endpoints": ["e:2379"]}},
    }
    message = refused(
        helm, "--set", f"fullnameOverride={name}", "-f", values_file(tmp_path, values)
    )
    assert f'name "{name}-proxy-us-east-metrics" is longer than 63 characters' in message


def test_two_regions_whose_services_would_share_a_name_are_refused(
    helm: Path, tmp_path: Path
) -> None:
    message = refused(helm, "-f", values_file(tmp_path, _regions("us", "us-metrics")))
    assert (
        'the metrics Service of region "us" and the proxy Service of region "us-metrics"' in message
    )
    assert 'would both be named "ponto-proxy-us-metrics"' in message


def test_every_service_has_its_own_name(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, "-f", values_file(tmp_path, _regions("us", "us-east", "metrics")))
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    assert len(names) == len(set(names))
    assert {"ponto-proxy-us-metrics", "ponto-proxy-metrics-metrics"} <= set(names)


def test_an_etcd_statefulset_name_its_pods_could_not_carry_is_refused(
    helm: Path, tmp_path: Path
) -> None:
    # 48 + "-etcd": 53 characters, within a DNS label, but the pods' label
    # controller-revision-hash=<name>-<10 characters> would be 64.
    values = values_file(tmp_path, _regions("a"))
    message = refused(helm, "--set", f"fullnameOverride={'f' * 48}", "-f", values)
    assert "StatefulSet name" in message
    assert "is 53 characters, above 52" in message
    assert "controller-revision-hash" in message
    docs = render(helm, "--set", f"fullnameOverride={'f' * 47}", "-f", values)
    (etcd,) = objects(docs, "StatefulSet")
    assert len(etcd) == 52
