"""Whether and how the proxy exports traces, from the standard OTEL_* variables.

Pure: reads the mapping it is given, imports no OpenTelemetry code. Only the
choices the proxy itself makes are decided here (on or off, which exporter,
which OTLP protocol, a sampler the SDK knows); the SDK and the exporters read
the rest of the variables themselves (endpoints, headers, timeouts,
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*), as the
specification says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "EXPORTERS",
    "PROTOCOLS",
    "SAMPLERS",
    "TraceConfig",
    "TraceConfigError",
    "drops_roots",
    "trace_config",
]

EXPORTERS = ("otlp", "console")
PROTOCOLS = ("http/protobuf", "grpc")
# The samplers the Python SDK builds from OTEL_TRACES_SAMPLER; the ratio ones
# take OTEL_TRACES_SAMPLER_ARG.
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


class TraceConfigError(ValueError):
    """An OTEL_* value the proxy cannot honour; the message names the variable."""


@dataclass(frozen=True, slots=True)
class TraceConfig:
    exporters: tuple[str, ...]  # each one of EXPORTERS
    protocol: str  # one of PROTOCOLS; read only when "otlp" is among the exporters


def _get(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def trace_config(env: Mapping[str, str]) -> TraceConfig | None:
    """The tracing `env` asks for, or None for none; TraceConfigError for a
    value the proxy cannot honour.

    On when OTEL_TRACES_EXPORTER names otlp or console (a comma-separated
    list, as the specification allows), or when it is unset and an OTLP
    endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or ..._TRACES_ENDPOINT) is. Off when
    it is `none`, and whatever else is set when OTEL_SDK_DISABLED is true.
    The protocol is ..._TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
    else http/protobuf.
    """
    if _get(env, "OTEL_SDK_DISABLED").lower() == "true":
        return None
    named = _get(env, "OTEL_TRACES_EXPORTER").lower()
    if named:
        exporters = tuple(dict.fromkeys(e.strip() for e in named.split(",") if e.strip()))
        unknown = [e for e in exporters if e not in (*EXPORTERS, "none")]
        if unknown:
            raise TraceConfigError(
                f"OTEL_TRACES_EXPORTER: unknown exporter {unknown[0]!r} "
                f"(expected {', '.join(EXPORTERS)} or none)"
            )
        if "none" in exporters:
            if len(exporters) > 1:
                raise TraceConfigError("OTEL_TRACES_EXPORTER: none cannot be combined with others")
            return None
    elif _get(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _get(
        env, "OTEL_EXPORTER_OTLP_ENDPOINT"
    ):
        exporters = ("otlp",)
    else:
        return None
    protocol = "http/protobuf"
    if "otlp" in exporters:
        for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            value = _get(env, name).lower()
            if value:
                if value not in PROTOCOLS:
                    raise TraceConfigError(
                        f"{name}: unsupported protocol {value!r} "
                        f"(expected {' or '.join(PROTOCOLS)})"
                    )
                protocol = value
                break
    _check_sampler(env)
    return TraceConfig(exporters, protocol)


def _check_sampler(env: Mapping[str, str]) -> None:
    """Refuse what the SDK would only warn about and replace by its default."""
    sampler = _sampler(env)
    if sampler and sampler not in SAMPLERS:
        raise TraceConfigError(
            f"OTEL_TRACES_SAMPLER: unknown sampler {sampler!r} "
            f"(expected one of {', '.join(SAMPLERS)})"
        )
    if sampler in _RATIO_SAMPLERS:
        ratio = _ratio(env)
        if ratio is None or not 0.0 <= ratio <= 1.0:
            arg = _get(env, "OTEL_TRACES_SAMPLER_ARG")
            raise TraceConfigError(
                f"OTEL_TRACES_SAMPLER_ARG: {arg!r} is not a ratio between 0 and 1"
            )


def drops_roots(env: Mapping[str, str]) -> bool:
    """True when the sampler `env` names (as the SDK reads OTEL_TRACES_SAMPLER
    and its argument; unset is parentbased_always_on) drops every request that
    arrives without a parent: always_off, parentbased_always_off, or a ratio
    sampler at 0. Such a request can be known unsampled before the SDK is
    asked, which is what makes tracing "sampled at 0" cost nothing."""
    sampler = _sampler(env)
    if sampler in ("always_off", "parentbased_always_off"):
        return True
    return sampler in _RATIO_SAMPLERS and _ratio(env) == 0.0


def _sampler(env: Mapping[str, str]) -> str:
    return _get(env, "OTEL_TRACES_SAMPLER").lower()


def _ratio(env: Mapping[str, str]) -> float | None:
    """OTEL_TRACES_SAMPLER_ARG as a ratio sampler reads it: 1.0 when unset (the
    SDK's default), None when it is not a number."""
    arg = _get(env, "OTEL_TRACES_SAMPLER_ARG")
    if not arg:
        return 1.0
    try:
        return float(arg)
    except ValueError:
        return None
