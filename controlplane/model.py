"""Desired state of the fleet: frozen values with validation and JSON codecs.

Values are stored in etcd as JSON objects (one key each) so that operators can
read them with etcdctl; unknown fields in stored JSON are ignored, so a newer
control plane can add fields without breaking an older replica.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import orjson

from controlplane.errors import InvalidArgument

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,254}$")
DEFAULT_WEIGHT = 100
MAX_WEIGHT = 1000
MAX_CAPACITY = 1_000_000


def check_name(kind: str, name: str) -> str:
    if not NAME_RE.match(name):
        raise InvalidArgument(
            f"{kind} name {name!r} is invalid: use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"base URL {url!r} is invalid: expected http(s)://host[:port]/path")
    try:
        _ = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"base URL {url!r} has an invalid port") from exc
    if parts.query or parts.fragment:
        raise InvalidArgument(f"base URL {url!r} must not have a query or fragment")
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    latitude: float
    longitude: float
    drained: bool = False
    # (other region, round-trip ms), sorted; empty: order by distance.
    rtt_ms: tuple[tuple[str, float], ...] = ()
    # Load fraction above which new requests spill to the next region; 0 = default.
    spill_threshold: float = 0.0

    def validated(self) -> Region:
        check_name("region", self.name)
        for label, value, bound in (
            ("latitude", self.latitude, 90),
            ("longitude", self.longitude, 180),
        ):
            if not math.isfinite(value) or not -bound <= value <= bound:
                raise InvalidArgument(
                    f"{label} {value} of region {self.name!r} is out of range [-{bound}, {bound}]"
                )
        for other, ms in self.rtt_ms:
            check_name("region", other)
            if not math.isfinite(ms) or not 0 <= ms <= 10_000:
                raise InvalidArgument(
                    f"RTT {ms} ms from {self.name!r} to {other!r} is not in 0..10000"
                )
        if not math.isfinite(self.spill_threshold) or not 0 <= self.spill_threshold <= 1:
            raise InvalidArgument(
                f"spill threshold {self.spill_threshold} of region {self.name!r} is not in 0..1"
            )
        return replace(self, rtt_ms=tuple(sorted(dict(self.rtt_ms).items())))


@dataclass(frozen=True, slots=True)
class Origin:
    name: str
    base_url: str
    region: str
    models: tuple[str, ...]
    weight: int = DEFAULT_WEIGHT
    drained: bool = False
    capacity: int = 0

    def validated(self) -> Origin:
        check_name("origin", self.name)
        check_name("region", self.region)
        url = check_url(self.base_url)
        if not self.models:
            raise InvalidArgument(f"origin {self.name!r} must serve at least one model")
        for model in self.models:
            if not MODEL_RE.match(model):
                raise InvalidArgument(f"model name {model!r} of origin {self.name!r} is invalid")
        if len(set(self.models)) != len(self.models):
            raise InvalidArgument(f"origin {self.name!r} lists a model twice")
        weight = self.weight or DEFAULT_WEIGHT
        if not 1 <= weight <= MAX_WEIGHT:
            raise InvalidArgument(
                f"weight {weight} of origin {self.name!r} is not in 1..{MAX_WEIGHT}"
            )
        return replace(self, base_url=url, weight=weight, models=tuple(sorted(self.models)))


@dataclass(frozen=True, slots=True)
class ProxyRecord:
    name: str
    region: str
    address: str
    version: str
    session_id: str
    control_plane_id: str
    connected_at: float
    acked_version: int = 0
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class OriginHealth:
    """What the leader's probes last saw of an origin."""

    origin: str
    healthy: bool
    inflight: float = 0.0  # running + waiting requests (vLLM metrics)
    detail: str = ""
    checked_at: float = 0.0


@dataclass(frozen=True, slots=True)
class State:
    """Everything a route table is compiled from, read at one store revision."""

    revision: int
    regions: tuple[Region, ...] = ()
    origins: tuple[Origin, ...] = ()
    health: dict[str, OriginHealth] = field(default_factory=dict)


def encode(value: Region | Origin | ProxyRecord | OriginHealth) -> bytes:
    return orjson.dumps(asdict(value), option=orjson.OPT_SORT_KEYS)


def _fields(cls: type, raw: bytes) -> dict[str, Any]:
    data = orjson.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("stored value is not an object")
    names = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return {k: v for k, v in data.items() if k in names}


def decode_region(raw: bytes) -> Region:
    fields = _fields(Region, raw)
    fields["rtt_ms"] = tuple((str(k), float(v)) for k, v in fields.get("rtt_ms", ()))
    return Region(**fields)


def decode_health(raw: bytes) -> OriginHealth:
    return OriginHealth(**_fields(OriginHealth, raw))


def decode_origin(raw: bytes) -> Origin:
    fields = _fields(Origin, raw)
    fields["models"] = tuple(fields.get("models", ()))
    return Origin(**fields)


def decode_proxy(raw: bytes) -> ProxyRecord:
    return ProxyRecord(**_fields(ProxyRecord, raw))
