"""Which OTEL_* settings turn tracing on, and which stop the proxy's start."""

from __future__ import annotations

import pytest

from dataplane.telemetry.config import TraceConfig, TraceConfigError, drops_roots, trace_config

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


def test_off_without_any_variable() -> None:
    assert trace_config({}) is None


@pytest.mark.parametrize(
    "env",
    [
        ENDPOINT,
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"},
        {"OTEL_TRACES_EXPORTER": "otlp"},
        {"OTEL_TRACES_EXPORTER": " OTLP "},
    ],
)
def test_an_endpoint_or_the_otlp_exporter_turns_it_on(env: dict[str, str]) -> None:
    assert trace_config(env) == TraceConfig(("otlp",), "http/protobuf")


@pytest.mark.parametrize(
    "env",
    [
        {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"},
        {**ENDPOINT, "OTEL_SDK_DISABLED": "true"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"},
        # Disabled wins even over values that would be refused.
        {"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_SDK_DISABLED": "true"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "  "},
    ],
)
def test_none_or_disabled_turns_it_off(env: dict[str, str]) -> None:
    assert trace_config(env) is None


def test_console_and_otlp_together() -> None:
    config = trace_config({"OTEL_TRACES_EXPORTER": "console,otlp,console"})
    assert config == TraceConfig(("console", "otlp"), "http/protobuf")


def test_the_traces_protocol_overrides_the_general_one() -> None:
    env = {**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert trace_config(env) == TraceConfig(("otlp",), "http/protobuf")
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "grpc"
    assert trace_config(env) == TraceConfig(("otlp",), "grpc")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'"),
        ({"OTEL_TRACES_EXPORTER": "otlp,none"}, "none cannot be combined"),
        (
            {**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol 'http/json'",
        ),
        (
            {**ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: unsupported protocol 'thrift'",
        ),
        ({**ENDPOINT, "OTEL_TRACES_SAMPLER": "sometimes"}, "unknown sampler 'sometimes'"),
        (
            {
                **ENDPOINT,
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "1.5",
            },
            "OTEL_TRACES_SAMPLER_ARG: '1.5' is not a ratio",
        ),
        (
            {**ENDPOINT, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"},
            "is not a ratio",
        ),
    ],
)
def test_values_it_cannot_honour_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(TraceConfigError, match=message):
        trace_config(env)


def test_the_protocol_is_not_checked_for_the_console_exporter_alone() -> None:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    assert trace_config(env) == TraceConfig(("console",), "http/protobuf")


def test_a_ratio_sampler_with_a_valid_argument_is_accepted() -> None:
    env = {
        **ENDPOINT,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    }
    assert trace_config(env) is not None


@pytest.mark.parametrize(
    ("sampler", "arg", "drops"),
    [
        ("", "", False),  # the SDK's default, parentbased_always_on
        ("always_on", "", False),
        ("parentbased_always_on", "", False),
        ("always_off", "", True),
        ("parentbased_always_off", "", True),
        ("traceidratio", "0", True),
        ("parentbased_traceidratio", "0", True),
        ("parentbased_traceidratio", "0.0", True),
        ("parentbased_traceidratio", "0.01", False),
        ("parentbased_traceidratio", "", False),  # no argument: the SDK's ratio 1
        (" ALWAYS_OFF ", "", True),
    ],
)
def test_which_samplers_drop_every_root(sampler: str, arg: str, drops: bool) -> None:
    env = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": arg}
    assert drops_roots(env) is drops
