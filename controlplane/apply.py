"""`pontoctl apply -f`: make regions, origins and tenants match a YAML file.

The file is the desired state; applying it twice changes nothing the second
time. Each object is compared with what the control plane holds, and only the
differences are written, in dependency order (regions, then origins, then
tenants; deletions under --prune in the reverse order). Keys are never in the
file: they are secrets and are made with `pontoctl key create`.

    regions:
      - {name: us-east, lat: 38.9, lon: -77.4, rtt_ms: {eu-west: 75}, spill_threshold: 0.8}
    origins:
      - {name: vllm-use1, region: us-east, url: "http://vllm:8000/v1", models: [llama-3-8b],
         weight: 100, capacity: 64, credential_env: ORIGIN_USE1_KEY}
    tenants:
      - name: acme
        limits: {rpm: 600, tpm: 100000, concurrency: 20}
        cache: {mode: semantic, ttl_s: 3600, semantic_threshold: 0.9}
        prompt: {system_prompt: "Be brief.", max_tokens: 1024, aliases: {gpt-4o: llama-3-8b},
                 defaults: {temperature: 0}}
        jwt: {issuer: "https://id.acme.example", audiences: [ponto], algorithms: [RS256],
              jwks_file: /etc/ponto/acme-jwks.json}
        routing: {mode: affinity, models: {embed-small: least-loaded}, user_sessions: true,
                  load_bound: 1.25}
        streams: {continuation: true, max_continuations: 2, stream_idle_timeout_s: 30,
                  hedge_ms: auto, hedge_models: {llama-3-8b: "500"}}

Unknown fields are refused with their path, so a typo never passes silently.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import yaml
from google.protobuf.message import Message

from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


class ApplyError(Exception):
    """The file is invalid; nothing was changed."""


REGION_FIELDS = {"name", "lat", "lon", "rtt_ms", "spill_threshold", "drained"}
ORIGIN_FIELDS = {
    "name",
    "region",
    "url",
    "models",
    "weight",
    "capacity",
    "credential_env",
    "credential_file",
    "drained",
    "continuation",
}
TENANT_FIELDS = {"name", "limits", "cache", "prompt", "jwt", "routing", "streams"}
STREAM_FIELDS = {
    "continuation",
    "max_continuations",
    "stream_idle_timeout_s",
    "hedge_ms",
    "hedge_models",
}
ROUTING_FIELDS = {"mode", "models", "user_sessions", "load_bound"}
LIMIT_FIELDS = {"rpm", "tpm", "concurrency"}
CACHE_FIELDS = {"mode", "ttl_s", "semantic_threshold", "cache_nondeterministic", "store_truncated"}
PROMPT_FIELDS = {"system_prompt", "enforce_system_prompt", "defaults", "max_tokens", "aliases"}
JWT_FIELDS = {
    "issuer",
    "audiences",
    "algorithms",
    "jwks_file",
    "hs256_secret_file",
    "hs256_secret_env",
    "leeway_s",
    "max_lifetime_s",
}


def _obj(
    value: Any, path: str, allowed: set[str], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApplyError(f"{path}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ApplyError(
            f"{path}: unknown field(s) {', '.join(map(str, unknown))}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    for name in required:
        if name not in value:
            raise ApplyError(f"{path}: {name} is required")
    return value


def _typed(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; a YAML "yes" must not pass as a number.
    if isinstance(value, bool) and bool not in kinds:
        raise ApplyError(f"{path}.{key}: expected {kinds[0].__name__}, got a boolean")
    if not isinstance(value, kinds):
        raise ApplyError(f"{path}.{key}: expected {kinds[0].__name__}, got {value!r}")
    return value


def _get(
    obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str, default: Any
) -> Any:
    return _typed(obj, key, kind, path) if key in obj and obj[key] is not None else default


def _list(doc: Mapping[str, Any], key: str) -> list[Any]:
    items = doc.get(key) or []
    if not isinstance(items, list):
        raise ApplyError(f"{key}: expected a list")
    return items


def _unique(items: list[Message], kind: str) -> None:
    seen: set[str] = set()
    for item in items:
        name = item.name  # type: ignore[attr-defined]
        if name in seen:
            raise ApplyError(f"{kind} {name!r} is listed twice")
        seen.add(name)


def _hedge_ms(value: int | str, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ApplyError(f"{path}.hedge_ms: expected milliseconds (0 or more) or auto")


def _limits(raw: Any, path: str) -> pb.Limits:
    obj = _obj(raw, path, LIMIT_FIELDS)
    return pb.Limits(**{k: _typed(obj, k, int, path) for k in obj})


@dataclass
class Desired:
    """A topology document, normalised as the server stores its objects."""

    regions: list[pb.Region] = field(default_factory=list)
    origins: list[pb.Origin] = field(default_factory=list)
    tenants: list[pb.Tenant] = field(default_factory=list)
    # (kind, name) of regions and origins whose `drained` the file leaves out:
    # their drain state is the operators' (pontoctl drain), not the file's.
    drain_unset: set[tuple[str, str]] = field(default_factory=set)


def parse(doc: Any) -> Desired:
    """The desired state a document describes; ApplyError names what is wrong."""
    try:
        return _parse(doc)
    except ValueError as exc:  # a number protobuf cannot hold (a negative count, 2**32)
        raise ApplyError(f"a value is out of range: {exc}") from exc


def _parse(doc: Any) -> Desired:
    """The desired objects of a topology document; raises ApplyError."""
    drain_unset: set[tuple[str, str]] = set()
    if doc is None:
        doc = {}
    doc = _obj(doc, "file", {"regions", "origins", "tenants"})
    regions: list[pb.Region] = []
    for i, raw in enumerate(_list(doc, "regions")):
        path = f"regions[{i}]"
        r = _obj(raw, path, REGION_FIELDS, ("name", "lat", "lon"))
        rtt = _get(r, "rtt_ms", dict, path, {})
        regions.append(
            pb.Region(
                name=str(_typed(r, "name", str, path)),
                latitude=float(_typed(r, "lat", (int, float), path)),
                longitude=float(_typed(r, "lon", (int, float), path)),
                rtt_ms={str(k): float(v) for k, v in rtt.items()},
                spill_threshold=float(_get(r, "spill_threshold", (int, float), path, 0.0)),
                drained=bool(_get(r, "drained", bool, path, False)),
            )
        )
        if "drained" not in r:
            drain_unset.add(("region", r["name"]))
    origins: list[pb.Origin] = []
    for i, raw in enumerate(_list(doc, "origins")):
        path = f"origins[{i}]"
        o = _obj(raw, path, ORIGIN_FIELDS, ("name", "region", "url", "models"))
        models = _typed(o, "models", list, path)
        origins.append(
            pb.Origin(
                name=_typed(o, "name", str, path),
                region=_typed(o, "region", str, path),
                base_url=str(_typed(o, "url", str, path)).rstrip("/"),
                models=sorted(str(m) for m in models),
                weight=_get(o, "weight", int, path, 0) or 100,
                capacity=_get(o, "capacity", int, path, 0),
                credential_env=_get(o, "credential_env", str, path, ""),
                credential_file=_get(o, "credential_file", str, path, ""),
                drained=_get(o, "drained", bool, path, False),
                no_continuation=not _get(o, "continuation", bool, path, True),
            )
        )
        if "drained" not in o:
            drain_unset.add(("origin", o["name"]))
    tenants: list[pb.Tenant] = []
    for i, raw in enumerate(_list(doc, "tenants")):
        path = f"tenants[{i}]"
        t = _obj(raw, path, TENANT_FIELDS, ("name",))
        tenant = pb.Tenant(name=_typed(t, "name", str, path))
        if t.get("limits") is not None:
            tenant.limits.CopyFrom(_limits(t["limits"], f"{path}.limits"))
        cache = _obj(t.get("cache") or {}, f"{path}.cache", CACHE_FIELDS)
        cpath = f"{path}.cache"
        tenant.cache.CopyFrom(
            pb.CachePolicy(
                mode=_get(cache, "mode", str, cpath, "exact"),
                ttl_s=_get(cache, "ttl_s", int, cpath, 0),
                semantic_threshold=float(_get(cache, "semantic_threshold", (int, float), cpath, 0)),
                cache_nondeterministic=_get(cache, "cache_nondeterministic", bool, cpath, False),
                store_truncated=_get(cache, "store_truncated", bool, cpath, False),
            )
        )
        routing = _obj(t.get("routing") or {}, f"{path}.routing", ROUTING_FIELDS)
        rpath = f"{path}.routing"
        tenant.routing.CopyFrom(
            pb.RoutingPolicy(
                mode=_get(routing, "mode", str, rpath, ""),
                models={
                    str(k): str(v) for k, v in _get(routing, "models", dict, rpath, {}).items()
                },
                user_sessions=_get(routing, "user_sessions", bool, rpath, False),
                load_bound=float(_get(routing, "load_bound", (int, float), rpath, 0)),
            )
        )
        streams = _obj(t.get("streams") or {}, f"{path}.streams", STREAM_FIELDS)
        spath = f"{path}.streams"
        hedge = _get(streams, "hedge_ms", (int, str), spath, 0)
        continuation = _get(streams, "continuation", bool, spath, True)
        tenant.streams.CopyFrom(
            pb.StreamPolicy(
                continuation="" if continuation else "off",
                max_continuations=_get(streams, "max_continuations", int, spath, 0),
                stream_idle_timeout_s=float(
                    _get(streams, "stream_idle_timeout_s", (int, float), spath, 0)
                ),
                hedge_ms=0 if hedge == "auto" else _hedge_ms(hedge, spath),
                hedge_auto=hedge == "auto",
                hedge_models={
                    str(k): str(v)
                    for k, v in _get(streams, "hedge_models", dict, spath, {}).items()
                },
            )
        )
        prompt = _obj(t.get("prompt") or {}, f"{path}.prompt", PROMPT_FIELDS)
        ppath = f"{path}.prompt"
        defaults = _get(prompt, "defaults", dict, ppath, {})
        aliases = _get(prompt, "aliases", dict, ppath, {})
        tenant.prompt.CopyFrom(
            pb.PromptPolicy(
                system_prompt=_get(prompt, "system_prompt", str, ppath, ""),
                enforce_system_prompt=_get(prompt, "enforce_system_prompt", bool, ppath, False),
                max_tokens_ceiling=_get(prompt, "max_tokens", int, ppath, 0),
                defaults={str(k): orjson.dumps(v).decode() for k, v in defaults.items()},
                aliases={str(k): str(v) for k, v in aliases.items()},
            )
        )
        if t.get("jwt") is not None:
            jpath = f"{path}.jwt"
            j = _obj(t["jwt"], jpath, JWT_FIELDS, ("issuer",))
            tenant.jwt.CopyFrom(
                pb.JwtIssuer(
                    issuer=_typed(j, "issuer", str, jpath),
                    audiences=[str(a) for a in _get(j, "audiences", list, jpath, [])],
                    algorithms=sorted(
                        {str(a) for a in _get(j, "algorithms", list, jpath, ["RS256"])}
                    ),
                    jwks_file=_get(j, "jwks_file", str, jpath, ""),
                    hs256_secret_file=_get(j, "hs256_secret_file", str, jpath, ""),
                    hs256_secret_env=_get(j, "hs256_secret_env", str, jpath, ""),
                    leeway_s=float(_get(j, "leeway_s", (int, float), jpath, 30.0)),
                    max_lifetime_s=float(_get(j, "max_lifetime_s", (int, float), jpath, 0)),
                )
            )
        tenants.append(tenant)
    _unique(list(regions), "region")
    _unique(list(origins), "origin")
    _unique(list(tenants), "tenant")
    return Desired(regions, origins, tenants, drain_unset)


def _region_view(r: pb.Region) -> pb.Region:
    return pb.Region(
        name=r.name,
        latitude=r.latitude,
        longitude=r.longitude,
        rtt_ms=dict(r.rtt_ms),
        spill_threshold=r.spill_threshold,
        drained=r.drained,
    )


def _origin_view(o: pb.Origin) -> pb.Origin:
    return pb.Origin(
        name=o.name,
        region=o.region,
        base_url=o.base_url,
        models=sorted(o.models),
        weight=o.weight,
        capacity=o.capacity,
        credential_env=o.credential_env,
        credential_file=o.credential_file,
        drained=o.drained,
        no_continuation=o.no_continuation,
    )


def _changed_fields(old: Message, new: Message) -> list[str]:
    names = [f.name for f in new.DESCRIPTOR.fields]
    return [n for n in names if getattr(old, n) != getattr(new, n)]


class _Plan:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.steps: list[Callable[[], object]] = []
        self.counts = {"created": 0, "updated": 0, "deleted": 0, "unchanged": 0}

    def add(
        self, verb: str, what: str, step: Callable[[], object] | None, detail: str = ""
    ) -> None:
        self.counts[verb] += 1
        self.lines.append(f"{what} {verb}" + (f" ({detail})" if detail else ""))
        if step is not None:
            self.steps.append(step)


def plan(stub: Any, desired: Desired, *, prune: bool) -> _Plan:
    """Compare the desired objects with the control plane's; return the writes to make."""
    out = _Plan()
    regions, origins, tenants = desired.regions, desired.origins, desired.tenants
    have_regions = {r.name: _region_view(r) for r in stub.ListRegions(apb.ListRequest()).regions}
    have_origins = {o.name: _origin_view(o) for o in stub.ListOrigins(apb.ListRequest()).origins}
    have_tenants = {t.name: t for t in stub.ListTenants(apb.ListRequest()).tenants}
    for r in regions:
        if ("region", r.name) in desired.drain_unset and r.name in have_regions:
            r.drained = have_regions[r.name].drained
    for o in origins:
        if ("origin", o.name) in desired.drain_unset and o.name in have_origins:
            o.drained = have_origins[o.name].drained

    for r in regions:
        spec = apb.RegionSpec(
            name=r.name,
            latitude=r.latitude,
            longitude=r.longitude,
            rtt_ms=dict(r.rtt_ms),
            spill_threshold=r.spill_threshold,
        )
        old = have_regions.get(r.name)
        put = apb.PutRegionRequest(region=spec, allow_update=old is not None)
        changed = _changed_fields(old, r) if old is not None else []
        if old is None:
            out.add("created", f"region {r.name}", partial(stub.PutRegion, put))
            if r.drained:
                out.steps.append(
                    partial(stub.DrainRegion, apb.DrainRequest(name=r.name, drained=True))
                )
        elif changed:
            steps: list[Callable[[], object]] = []
            if set(changed) - {"drained"}:
                steps.append(partial(stub.PutRegion, put))
            if "drained" in changed:
                steps.append(
                    partial(stub.DrainRegion, apb.DrainRequest(name=r.name, drained=r.drained))
                )
            out.add("updated", f"region {r.name}", None, ", ".join(changed))
            out.steps.extend(steps)
        else:
            out.add("unchanged", f"region {r.name}", None)

    for o in origins:
        ospec = apb.OriginSpec(
            name=o.name,
            base_url=o.base_url,
            region=o.region,
            models=list(o.models),
            weight=o.weight,
            capacity=o.capacity,
            credential_env=o.credential_env,
            credential_file=o.credential_file,
            continuation="off" if o.no_continuation else "on",
        )
        old_o = have_origins.get(o.name)
        oput = apb.PutOriginRequest(origin=ospec, allow_update=old_o is not None)
        if old_o is None:
            out.add("created", f"origin {o.name}", partial(stub.PutOrigin, oput))
            if o.drained:
                out.steps.append(
                    partial(stub.DrainOrigin, apb.DrainRequest(name=o.name, drained=True))
                )
            continue
        changed = _changed_fields(old_o, o)
        if not changed:
            out.add("unchanged", f"origin {o.name}", None)
            continue
        if set(changed) - {"drained"}:
            out.steps.append(partial(stub.PutOrigin, oput))
        if "drained" in changed:
            out.steps.append(
                partial(stub.DrainOrigin, apb.DrainRequest(name=o.name, drained=o.drained))
            )
        out.add("updated", f"origin {o.name}", None, ", ".join(changed))

    for t in tenants:
        old_t = have_tenants.get(t.name)
        if old_t is None:
            out.add(
                "created",
                f"tenant {t.name}",
                partial(stub.PutTenant, apb.PutTenantRequest(tenant=t)),
            )
            continue
        changed = _changed_fields(old_t, t)
        if not changed:
            out.add("unchanged", f"tenant {t.name}", None)
            continue
        out.add(
            "updated",
            f"tenant {t.name}",
            partial(stub.PutTenant, apb.PutTenantRequest(tenant=t, allow_update=True)),
            ", ".join(changed),
        )

    if prune:
        # Dependants first: tenants and origins, then the regions they were in.
        for kind, have, wanted, delete in (
            ("tenant", have_tenants, tenants, stub.DeleteTenant),
            ("origin", have_origins, origins, stub.DeleteOrigin),
            ("region", have_regions, regions, stub.DeleteRegion),
        ):
            keep = {m.name for m in wanted}
            for name in sorted(set(have) - keep):
                out.add("deleted", f"{kind} {name}", partial(delete, apb.DeleteRequest(name=name)))
    return out


def load(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ApplyError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ApplyError(f"{path} is not valid YAML: {exc}") from exc


def apply_file(stub: Any, path: str, *, dry_run: bool = False, prune: bool = False) -> str:
    """Apply the topology in path; return the report to print.

    Validation that needs the server (unknown region, bad URL, latitude out of
    range) happens on the first write that fails; the report then says which
    object failed, and the writes before it stay (each write is atomic).
    """
    p = plan(stub, parse(load(path)), prune=prune)
    if not dry_run:
        for step in p.steps:
            step()
    summary = ", ".join(f"{n} {verb}" for verb, n in p.counts.items())
    suffix = " (dry run: nothing changed)" if dry_run else ""
    return "\n".join([*p.lines, summary + suffix])
