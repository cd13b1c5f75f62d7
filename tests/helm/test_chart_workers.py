"""The chart's `proxy.workers` (given, or the whole cores of the proxy's CPU limit),
a region's resources merged over the proxy's, and the HPA's CPU target that follows
what a pod's workers can use."""

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
        ({"proxy": {"workers": 3, "resources": {"limits": {"cpu": "3"}}}}, "3"),
        ({"proxy": {"workers": 3, "resources": {"limits": {"cpu": None}}}}, "3"),
        ({"proxy": {"resources": {"limits": {"cpu": "1500m"}}}}, "1"),
        ({"proxy": {"resources": {"limits": {"cpu": "4000m"}}}}, "4"),
        ({"proxy": {"resources": {"limits": {"cpu": 2.5}}}}, "2"),
        ({"proxy": {"resources": {"limits": {"cpu": "250m"}}}}, "1"),
        # One worker is what 0 gives under a limit below a core: accepted as given too.
        ({"proxy": {"workers": 1, "resources": {"limits": {"cpu": "500m"}}}}, "1"),
        ({"proxy": {"workers": 1, "resources": {"limits": {"cpu": 0.25}}}}, "1"),
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


@pytest.mark.parametrize(
    "values",
    [
        {"proxy": {"workers": 3}},  # the default CPU limit is "2"
        {"proxy": {"workers": 2, "resources": {"limits": {"cpu": "1500m"}}}},
        {"proxy": {"workers": 2, "resources": {"limits": {"cpu": "500m"}}}},
        {"proxy": {"regions": [{"name": "us-east", "lat": 1, "lon": 2, "workers": 3}]}},
        {
            "proxy": {
                "workers": 2,
                "regions": [
                    {"name": "us-east", "lat": 1, "lon": 2, "resources": {"limits": {"cpu": "1"}}}
                ],
            }
        },
    ],
)
def test_more_workers_than_the_cpu_limit_has_cores_is_refused(
    helm: Path, tmp_path: Path, values: Doc
) -> None:
    message = refused(helm, "-f", values_file(tmp_path, values))
    assert "region us-east: workers" in message
    assert "is above the CPU limit" in message


def resources(docs: list[Doc], region: str) -> Doc:
    found: Doc = container(one(docs, "Deployment", f"ponto-proxy-{region}"))["resources"]
    return found


def test_a_region_s_resources_merge_over_the_proxy_s_key_by_key(helm: Path, tmp_path: Path) -> None:
    regions: list[Doc] = [
        {"name": "only-requests", "lat": 1, "lon": 2, "resources": {"requests": {"cpu": "1"}}},
        {"name": "only-limits", "lat": 1, "lon": 2, "resources": {"limits": {"memory": "2Gi"}}},
        # null drops the default's key: no CPU limit here, so one worker.
        {"name": "no-cpu-limit", "lat": 1, "lon": 2, "resources": {"limits": {"cpu": None}}},
        {"name": "none", "lat": 1, "lon": 2},
    ]
    docs = render(helm, "-f", values_file(tmp_path, {"proxy": {"regions": regions}}))
    default_requests = {"cpu": "250m", "memory": "256Mi"}
    default_limits = {"cpu": "2", "memory": "1Gi"}
    assert resources(docs, "only-requests") == {
        "requests": {"cpu": "1", "memory": "256Mi"},
        "limits": default_limits,
    }
    assert workers(docs, "only-requests") == "2"
    assert resources(docs, "only-limits") == {
        "requests": default_requests,
        "limits": {"cpu": "2", "memory": "2Gi"},
    }
    assert resources(docs, "no-cpu-limit") == {
        "requests": default_requests,
        "limits": {"memory": "1Gi"},
    }
    assert workers(docs, "no-cpu-limit") == "1"
    assert resources(docs, "none") == {"requests": default_requests, "limits": default_limits}


@pytest.mark.parametrize(
    ("own", "said"),
    [
        # A request above the default limit (cpu "2"; memory 1Gi).
        ({"requests": {"cpu": "4"}}, "resources.requests.cpu 4 is above resources.limits.cpu 2"),
        # A limit under the default request (memory 256Mi).
        (
            {"limits": {"memory": "128Mi"}},
            "resources.requests.memory 256Mi is above resources.limits.memory 128Mi",
        ),
    ],
)
def test_a_merged_request_above_its_limit_is_refused(
    helm: Path, tmp_path: Path, own: Doc, said: str
) -> None:
    # The API server would refuse the Deployment at install or upgrade (review
    # 15): the render says which values to set instead.
    regions = [{"name": "big", "lat": 1, "lon": 2, "resources": own}]
    message = refused(helm, "-f", values_file(tmp_path, {"proxy": {"regions": regions}}))
    assert f"region big: {said}" in message


def test_a_region_that_raises_both_request_and_limit_renders(helm: Path, tmp_path: Path) -> None:
    own = {"requests": {"cpu": "4", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}
    regions = [{"name": "big", "lat": 1, "lon": 2, "resources": own}]
    docs = render(helm, "-f", values_file(tmp_path, {"proxy": {"regions": regions}}))
    assert resources(docs, "big") == own
    assert workers(docs, "big") == "4"


def cpu_target(docs: list[Doc], region: str = "us-east") -> Doc:
    hpa = one(docs, "HorizontalPodAutoscaler", f"ponto-proxy-{region}")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    target: Doc = metric["resource"]["target"]
    return target


@pytest.mark.parametrize(
    ("proxy", "average"),
    [
        # 70 % of the default "2" CPU limit, which the default two workers can use,
        # not 70 % of the 250m request (175m a pod).
        ({}, "1400m"),
        ({"autoscaling": {"targetCPUUtilizationPercentage": 50}}, "1000m"),
        # "1500m" runs one worker, which uses one core of it.
        ({"resources": {"limits": {"cpu": "1500m"}}}, "700m"),
        ({"workers": 1}, "700m"),
        # No CPU limit: a core per worker.
        ({"workers": 3, "resources": {"limits": {"cpu": None}}}, "2100m"),
        ({"resources": {"limits": {"cpu": None}}}, "700m"),
    ],
)
def test_the_hpa_targets_a_share_of_what_the_workers_can_use(
    helm: Path, tmp_path: Path, proxy: Doc, average: str
) -> None:
    values: Doc = {
        "proxy": {**proxy, "autoscaling": {"enabled": True, **proxy.get("autoscaling", {})}}
    }
    docs = render(helm, "-f", values_file(tmp_path, values))
    assert cpu_target(docs) == {"type": "AverageValue", "averageValue": average}


def test_a_region_s_hpa_target_follows_its_own_limit(helm: Path, tmp_path: Path) -> None:
    regions: list[Doc] = [
        {"name": "us-east", "lat": 1, "lon": 2},
        {"name": "eu-west", "lat": 1, "lon": 2, "resources": {"limits": {"cpu": "4"}}},
    ]
    values: Doc = {"proxy": {"autoscaling": {"enabled": True}, "regions": regions}}
    docs = render(helm, "-f", values_file(tmp_path, values))
    assert cpu_target(docs, "us-east")["averageValue"] == "1400m"
    assert cpu_target(docs, "eu-west")["averageValue"] == "2800m"
