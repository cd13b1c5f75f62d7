"""`pontoctl`: the operators' CLI over the Admin gRPC API.

Exit codes: 0 success; 2 a bad value (flags, a topology file, or a value the
control plane refused as INVALID_ARGUMENT), found before anything is written;
1 any other refusal or failure of the control plane (not found, already
exists, unreachable, not allowed; a call it lacks, said as the control plane
being older than the command), and a write whose answer lacks a field it
asked for (`error: NOT SAVED: ...` after the output, which says what the
answer holds: a control plane older than the field dropped it; see
docs/operations.md). Every error is one message on stderr,
never a traceback (nor a line of gRPC core's log, unless GRPC_VERBOSITY asks
for them); one that failed to reach the control plane names the TLS setting
its cause points to (ponto.linkadvice); a client certificate out of its dates
or a key not its certificate's is refused before any call (exit code 2).
Warnings the control plane sends with a successful reply
(an alias to a model no origin serves, a routing policy or hedge delay for
such a model, a drain that leaves a model no origin, an undrained origin its
drained region keeps from traffic, an undrained region whose origins are all
drained, a purge of a model no origin serves, a region write that leaves the
RTT matrix naming a region that does not exist or not complete) are
`warning: ...` lines on stderr; the exit code stays 0.

Values are checked here with the model's own `validated()` before a call, and
again by the control plane, which checks every client's writes the same way.
"""

from __future__ import annotations

from ponto.grpclog import quiet_import

# None of gRPC core's lines, at any level, before pontoctl's one-line error.
quiet_import("NONE")

import argparse
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, Self, TypeVar

import grpc
import orjson
import yaml
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from controlplane.apply import ApplyError, change_text, non_finite, tenant_changes
from controlplane.compile import DEFAULT_SPILL_THRESHOLD
from controlplane.ejections import FleetEjection
from controlplane.ejections import describe as describe_ejection
from controlplane.errors import (
    CHANGED_SINCE_READ,
    CHECK_FIRST,
    MAY_HAVE_BEEN_MADE,
    InvalidArgument,
)
from controlplane.keypages import MAX_PAGE, spent_of
from controlplane.load import NO_CONTINUATION
from controlplane.messages import origin_of, region_of, tenant_of
from controlplane.model import (
    DEFAULT_WEIGHT,
    MAX_CAPACITY,
    MAX_CONCURRENCY,
    MAX_CONTINUATIONS,
    MAX_RATE,
    MAX_TOKENS_CEILING,
    MAX_TTL_S,
    MAX_WEIGHT,
    Limits,
    Tenant,
    check_model_names,
    check_note,
    escape_hidden,
    rtt_warnings,
)
from controlplane.readiness import STORE
from dataplane.assemble import TOKEN_FIELDS, table_token_field
from ponto import grpcconn as conn
from ponto import linkadvice
from ponto.apikeys import key_expired
from ponto.cliargs import finite_float
from ponto.times import utc, utc_ms
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb
from ponto.version import add_version_flag

ENV_ADDRESS = "PONTO_CONTROL_PLANE"


class UsageError(Exception):
    """The command line or its file is wrong in a way argparse cannot tell (exit code 2)."""


class Missing(Exception):
    """What a command names is not there (exit code 1, as the control
    plane's NOT_FOUND), found by pontoctl itself (trial 54: exit 2, a usage
    error's)."""


class KeptChanging(Exception):
    """A record another writer changed between each of pontoctl's reads and
    writes of it (_read_and_write), nothing saved: run it again (exit code 1)."""


TIMEOUT = 10.0


def _spill(r: pb.Region) -> str:
    """A region's spill threshold in force: 0 is the proxies' default, said
    with its value (a user trial: "default" alone hid the number)."""
    if r.spill_threshold:
        return f"{r.spill_threshold:g}"
    return f"{DEFAULT_SPILL_THRESHOLD:g} (default)"


def _serving(region: pb.Region, origins: Sequence[pb.Origin]) -> list[pb.Origin]:
    """The origins of region that take its traffic: undrained, in an
    undrained region, healthy as the probes see them."""
    if region.drained:
        return []
    return [o for o in origins if o.region == region.name and not o.drained and o.healthy]


def _rows_regions(
    resp: apb.ListRegionsResponse, origins: Sequence[pb.Origin] = ()
) -> tuple[list[str], list[list[str]]]:
    """`get regions`' table; SERVING is of `origins` (a ListOrigins read)."""
    header = ["NAME", "LAT", "LON", "DRAINED", "SPILL", "SERVING", "RTT"]
    rows = []
    for r in resp.regions:
        own = sum(o.region == r.name for o in origins)
        rows.append(
            [
                r.name,
                f"{r.latitude:g}",
                f"{r.longitude:g}",
                "yes" if r.drained else "no",
                _spill(r),
                f"{len(_serving(r, origins))}/{own}",
                _rtt_text(r),
            ]
        )
    return header, rows


def _rtt_text(r: pb.Region) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(r.rtt_ms.items())) or "-"


def _region_notes(regions: Sequence[pb.Region], origins: Sequence[pb.Origin]) -> list[str]:
    """The notes below `get regions`' table: an undrained region with origins
    none of which serves (drained, or unhealthy as the probes see them), and
    what the Admin API's region writes warn of the RTT matrix
    (model.rtt_warnings)."""
    notes = []
    for r in regions:
        own = [o for o in origins if o.region == r.name]
        if r.drained or not own or _serving(r, own):
            continue
        drained = [o.name for o in own if o.drained]
        unhealthy = [o.name for o in own if not o.drained and not o.healthy]
        why = "; ".join(
            f"{label}: {', '.join(names)}"
            for label, names in (("drained", drained), ("unhealthy", unhealthy))
            if names
        )
        notes.append(
            f"note: region {r.name} has no origin serving ({why}): its proxies send "
            "requests to other regions' origins"
        )
    rtts = rtt_warnings({r.name: list(r.rtt_ms) for r in regions})
    return notes + [f"note: {w}" for w in rtts]


# Capacities per unit of weight this many times apart among the origins that
# share a region's requests for a model are noted: the load bound shares a
# full region by weight (docs/routing.md, "The load bound"), so such a
# replica queues while a larger one of the same weight has room (trial 95).
CAPACITY_SKEW = 2.0


def _origin_notes(origins: Sequence[pb.Origin]) -> list[str]:
    """The notes below `get origins`' table: one per region and model whose
    undrained origins with a stated capacity hold capacities per unit of
    weight CAPACITY_SKEW or more times apart (origins with none are placed
    as 4, but were not sized by the operator, so they are left out)."""
    notes = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for region, model in sorted({(o.region, m) for o in origins for m in o.models}):
        group = sorted(
            (o for o in origins if o.region == region and model in o.models
             and not o.drained and o.capacity and o.weight),
            key=lambda o: o.name,
        )  # fmt: skip
        if len(group) < 2:
            continue
        ratios = [o.capacity / o.weight for o in group]
        names = tuple(o.name for o in group)
        if max(ratios) < CAPACITY_SKEW * min(ratios) or (region, names) in seen:
            continue
        seen.add((region, names))
        sizes = ", ".join(f"{o.name} {o.capacity}/{o.weight}" for o in group)
        notes.append(
            f"note: region {region}: capacities per unit of weight differ ({sizes}): "
            "a full region is shared by weight, not capacity, so the smaller replicas "
            "queue while larger ones have room; give weights in proportion to "
            'capacities (docs/routing.md, "The load bound")'
        )
    return notes


# Reads and writes again this many times in all while a write is refused for
# a change made since its read (another pontoctl at once).
CHANGED_TRIES = 5

R = TypeVar("R")


def _read_and_write(attempt: Callable[[], R]) -> R:
    """attempt() reads a record, then writes it with the settings given
    changed, sending what it read as `expected`. Run again while such a write
    is refused for a change made since its read (CHANGED_SINCE_READ), up to
    CHANGED_TRIES times in all: each pontoctl's flags are changes to what it
    read, so several at once all take (trial 52: two `tenant set --alias` at
    once kept one alias, and both said "changed")."""
    for tried in range(1, CHANGED_TRIES + 1):
        try:
            return attempt()
        except grpc.RpcError as exc:
            changed = exc.code() == grpc.StatusCode.FAILED_PRECONDITION and (
                CHANGED_SINCE_READ in (exc.details() or "")
            )
            if not changed:
                raise
            if tried == CHANGED_TRIES:
                raise KeptChanging(
                    f"{exc.details()} (read and written {CHANGED_TRIES} times, each time "
                    "changed by another write meanwhile): run it again"
                ) from exc
    raise AssertionError("unreachable: the last try returns or raises")


def _rows_origins(
    resp: apb.ListOriginsResponse, health_chars: int | None = None
) -> tuple[list[str], list[list[str]]]:
    """`get origins`' table; each HEALTHY cell cut at `health_chars`
    (HEALTH_CHARS when None; 0: whole, `--wide`)."""
    most = HEALTH_CHARS if health_chars is None else health_chars
    header = [
        "NAME",
        "REGION",
        "URL",
        "MODELS",
        "WEIGHT",
        "DRAINED",
        "HEALTHY",
        "SERVER",
        "INFLIGHT",
    ]
    now = time.time()
    ejected = {
        e.origin: describe_ejection(
            FleetEjection(
                e.origin,
                tuple(e.proxies),
                e.ejected_now,
                now - e.for_s,
                e.last_failure,
                now - e.failed_s,
            ),
            now,
        )
        for e in resp.ejections
    }
    rows = [
        [
            o.name,
            o.region,
            o.base_url,
            _served_as(o),
            str(o.weight),
            "yes" if o.drained else "no",
            # Cut: one origin's long detail (a probe's fix, an ejection)
            # widened every row past the screen (review); --wide has it whole
            # (trial 101: -o yaml is the apply file, which has no health).
            _cut(_health(o, ejected.get(o.name, "")), most),
            o.server_kind or "-",
            _inflight(o),
            _continuation(o),
            _probe(o),
        ]
        for o in resp.origins
    ]
    header += ["CONTINUATION", "PROBE"]
    # Only when an origin sets it: most fleets never do, and the table is
    # wide already.
    if any(o.max_tokens_field for o in resp.origins):
        header.append("MAX TOKENS AS")
        for row, o in zip(rows, resp.origins, strict=True):
            row.append(o.max_tokens_field or "max_tokens")
    return header, rows


def _served_as(o: pb.Origin) -> str:
    """An origin's models, each with the name the origin is sent for it when
    that is another: `llama-3.1-8b (as llama3.1:8b),qwen`."""
    names = o.model_names
    return ",".join(f"{m} (as {names[m]})" if m in names else m for m in o.models)


def _inflight(o: pb.Origin) -> str:
    """An origin's requests in flight of its capacity, as the leader's load
    scrape last read them; said to be unknown when it has no figures of the
    origin (trial 66: a llama.cpp origin with 8 in flight read 0/4, as an
    idle one does)."""
    capacity = f"/{o.capacity}" if o.capacity else ""
    if o.inflight_unknown:
        return f"?{capacity} (no load metrics)"
    return f"{o.inflight:g}{capacity}"


def _continuation(o: pb.Origin) -> str:
    """Whether the origin takes continuations, and whether its server (as
    probed) can: `-o json` and every write's warnings say the rest."""
    if o.no_continuation:
        return "off"
    if o.server_kind in NO_CONTINUATION:
        return f"on, but {o.server_kind} cannot continue: set it off"
    return "on"


def _health(o: pb.Origin, ejected: str) -> str:
    """An origin's health as the probes see it, and as the proxies' passive
    health does when it differs (trial 49: an origin failing every request
    passed its /health probes, and read "yes")."""
    if o.not_probed:
        probes = "not probed"
    elif o.healthy:
        # A pass may say what it proved (a 401 answered to a keyless probe).
        probes = f"yes ({o.health_detail})" if o.health_detail else "yes"
    else:
        probes = f"no ({o.health_detail})"
    if not ejected:
        return probes
    return f"{probes}, but {ejected}" if o.healthy and not o.not_probed else f"{probes}; {ejected}"


def _rows_proxies(resp: apb.ListProxiesResponse) -> tuple[list[str], list[list[str]]]:
    now = time.time()
    rows = []
    for p in resp.proxies:
        # Judged against the proxy's own replica, which numbers the same content
        # by the revision it read it at; the answering replica's version otherwise.
        current = p.replica_version or resp.current_version
        state = "current" if p.acked_version == current else "behind"
        if p.last_error:
            state = f"nack: {p.last_error[:60]}"
        if p.unknown:
            # Its replica's word may be stale (it hangs, or died): not current.
            state = f"unknown: {p.unknown}"
        if p.warnings:  # of the table it serves (JSON and YAML output have them whole)
            more = f" (+{len(p.warnings) - 1} more)" if len(p.warnings) > 1 else ""
            state += f"; warning: {p.warnings[0][:80]}{more}"
        rows.append(
            [
                p.info.name,
                p.info.region,
                p.info.address,
                str(p.acked_version),
                state,
                p.control_plane_id,
                p.info.version or "?",
                f"{max(0, now - p.connected_at):.0f}s",
            ]
        )
    header = ["NAME", "REGION", "ADDRESS", "ACKED", "STATE", "CONTROL-PLANE", "VERSION", "AGE"]
    return header, rows


def render(
    message: Message,
    output: str,
    rows: Callable[[Any], tuple[list[str], list[list[str]]] | str],
    shown: Callable[[dict[str, Any]], dict[str, Any]] = lambda d: d,
) -> str:
    """message as JSON or YAML (proto field names, then `shown`), or as the
    text rows() makes of it. Each list of message itself is there when
    empty (`{"keys": []}`), as a script reads it; fields within are not."""
    if output in ("json", "yaml"):
        data = MessageToDict(message, preserving_proto_field_name=True)
        # MessageToDict leaves out empty lists: `key list -o json` printed `{}`
        # for no keys (trial 52). Its always_print_fields_with_no_presence would
        # also add every zero and empty string, at every level.
        for field in message.DESCRIPTOR.fields:
            if field.is_repeated:
                data.setdefault(field.name, {} if _is_map(field) else [])
        data = shown(as_numbers(message, data))
        if output == "json":
            return json.dumps(data, indent=2)
        return yaml.safe_dump(data, sort_keys=False).rstrip()
    made = rows(message)
    return made if isinstance(made, str) else _table(*made)


_WIDE_INTS = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _is_map(field: Any) -> bool:
    """Whether field (a FieldDescriptor) is a map (a repeated field of entries)."""
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def as_numbers(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    """data (MessageToDict of message, proto field names) with its 64-bit
    integers as numbers. Protobuf's JSON mapping writes them as strings, for
    JavaScript's doubles; limits and versions are far below 2**53, and a
    script reading `key list -o json` compared "1000" with 1000 (trial 42)."""
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if _is_map(field):
            continue  # none of the API's maps holds 64-bit integers or messages
        if field.type in _WIDE_INTS:
            data[field.name] = int(value)  # none is repeated (test_cli_json holds both)
        elif field.message_type is not None:
            held = getattr(message, field.name)
            pairs = zip(held, value, strict=True) if isinstance(value, list) else [(held, value)]
            for item, v in pairs:
                if isinstance(v, dict):  # not a well-known type JSON writes as a string
                    as_numbers(item, v)
    return data


def _table(header: list[str], body: list[list[str]]) -> str:
    """header and body as aligned columns, one line a row: each cell's hidden
    characters (model.is_hidden: a newline, an ANSI escape, a bidi override in
    a stored key description or a health detail) are shown escaped."""
    rows = [[escape_hidden(cell) for cell in row] for row in [header, *body]]
    widths = [max(len(c) for c in col) for col in zip(*rows, strict=False)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows
    ]
    return "\n".join(lines)


def parse_rtt(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, ms = item.partition("=")
        try:
            out[name.strip()] = float(ms)
        except ValueError:
            sep = ""
        if not sep:
            raise UsageError(f"--rtt expects REGION=MS[,REGION=MS...], got {item!r}")
    return out


def _count(high: int, low: int = 0) -> Callable[[str], int]:
    """An argparse type: a whole number in low..high (the range the model accepts)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    return parse


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_DAYS = 36500


def _duration(text: str) -> float:
    """An argparse type: a positive duration such as 90s, 30m, 2h or 7d, in seconds,
    at most MAX_DURATION_DAYS (so that now minus it is a time)."""
    number, unit = text[:-1], text[-1:]
    if unit not in _UNITS or not (number.isascii() and number.isdigit()) or int(number) == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive duration such as 90s, 30m, 2h or 7d"
        )
    seconds = int(number) * _UNITS[unit]
    if seconds > MAX_DURATION_DAYS * _UNITS["d"]:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than {MAX_DURATION_DAYS}d")
    return seconds


def _limits_args(p: argparse.ArgumentParser, *, kept: bool = False) -> None:
    """--rpm, --tpm, --concurrency and the budgets. `kept`: a limit not given
    keeps its current value (`limit set`); else it is none (`key create`)."""
    rate = _count(MAX_RATE)
    default = None if kept else 0
    unset = "; not given: kept as it is" if kept else ""
    p.add_argument(
        "--rpm", type=rate, default=default, help=f"requests per minute (0: no limit{unset})"
    )
    p.add_argument(
        "--tpm", type=rate, default=default, help=f"tokens per minute (0: no limit{unset})"
    )
    p.add_argument(
        "--concurrency",
        type=_count(MAX_CONCURRENCY),
        default=default,
        help=f"concurrent requests (0: no limit{unset})",
    )
    p.add_argument(
        "--tokens-per-day",
        type=rate,
        default=default,
        help=f"tokens in a UTC day, for the whole fleet (0: no budget{unset})",
    )
    p.add_argument(
        "--tokens-per-month",
        type=rate,
        default=default,
        help=f"tokens in a UTC calendar month, for the whole fleet (0: no budget{unset})",
    )


# A budgeted scope the leader has not counted yet.
NOTHING_SPENT = apb.BudgetSpent()
# The limits `limit set` and `key create` take, by flag dest.
LIMIT_DESTS = ("rpm", "tpm", "concurrency", "tokens_per_day", "tokens_per_month")


# What argparse takes for a negative number, not an option, as a flag's value:
# its own ^-\d+$|^-\d*\.\d+$, and also exponents, -inf / -nan and negative
# durations, so that `--load-bound -inf` and `key expire ID --in -5m` reach
# the flag's type (finite_float, _duration) and its message rather than
# "expected one argument". No pontoctl option looks like these.
_NEGATIVE_NUMBER = re.compile(
    r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$|^-\d+[smhd]$", re.I
)


class _Parser(argparse.ArgumentParser):
    """argparse with its refusals on one line, like every other pontoctl error;
    subparsers are of this class too (argparse makes them of the parser's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse's private attribute, read as each argument is classified; were
        # it renamed, `--load-bound -inf` would be refused as before, and
        # tests/unit/test_cli_errors.py would say so.
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, and a hint for a model list given as several arguments
        (`--models a b`, `key models ID a b`): argparse would only call the
        second name an unrecognized argument (trial 29)."""
        parsed, extras = super().parse_known_args(args, namespace)
        given = list(sys.argv[1:] if args is None else args)
        if extras and _follows_models(given, extras[0], getattr(parsed, "models", None)):
            listed = ",".join([*parsed.models, *extras])
            self.error(
                f"unrecognized arguments: {' '.join(extras)}; a model list is one argument, "
                f"its names separated by commas with no spaces: {listed}"
            )
        return parsed, extras


def _follows_models(given: list[str], extra: str, models: list[str] | None) -> bool:
    """Whether argument `extra` comes right after the model list `models` in
    `given`: a name that was meant to be on it."""
    for before, after in itertools.pairwise(given):
        if after == extra and models and not extra.startswith("-"):
            with contextlib.suppress(argparse.ArgumentTypeError):
                if set(_model_list(before)) == set(models):
                    return True
    return False


def _addresses(text: str) -> tuple[str, ...]:
    """`--control-plane`'s comma-separated list, as ponto-proxy reads its own."""
    addresses = tuple(a.strip() for a in text.split(",") if a.strip())
    if not addresses:
        raise argparse.ArgumentTypeError(f"{text!r} names no HOST:PORT")
    for address in addresses:
        if why := conn.port_missing(address):
            if text == os.environ.get(ENV_ADDRESS):  # the default, from the environment
                why += f" (from {ENV_ADDRESS})"
            raise argparse.ArgumentTypeError(why)
    return addresses


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pontoctl", description="Operate a Ponto fleet")
    add_version_flag(p)
    p.add_argument(
        "--control-plane",
        type=_addresses,
        default=os.environ.get(ENV_ADDRESS, "127.0.0.1:7070"),
        help=f"control plane HOST:PORT, or several replicas' HOST:PORT,... tried in order "
        f"until one answers (env {ENV_ADDRESS})",
    )
    conn.add_arguments(p)
    sub = p.add_subparsers(dest="command", required=True)

    region = sub.add_parser("region", help="add or delete regions").add_subparsers(
        dest="action", required=True
    )
    ra = region.add_parser("add", help="add a region (--update to change one)")
    ra.add_argument(
        "name",
        help="the region's name: lowercase letters, digits and '-' (not at either end), at most 63",
    )
    ra.add_argument("--lat", type=finite_float, help="latitude, -90..90 (needed to add a region)")
    ra.add_argument(
        "--lon", type=finite_float, help="longitude, -180..180 (needed to add a region)"
    )
    ra.add_argument(
        "--rtt",
        metavar="R=MS,...",
        help="measured round-trip ms to other regions (orders failover by RTT once every "
        "region has them; gaps and unknown regions are warned of); with "
        "--update it replaces the region's list ('' removes them all)",
    )
    ra.add_argument(
        "--spill-threshold",
        type=finite_float,
        help="load fraction (0..1) above which new requests spill to the next region "
        "(0: the default, 0.8)",
    )
    ra.add_argument(
        "--update",
        action="store_true",
        help="update the region if it exists, keeping each setting not given",
    )
    region.add_parser("delete", help="delete a region without origins").add_argument(
        "name", help="the region's name"
    )

    origin = sub.add_parser("origin", help="add or delete origins").add_subparsers(
        dest="action", required=True
    )
    oa = origin.add_parser("add", help="add an origin (--update to change one)")
    oa.add_argument(
        "name",
        help="the origin's name: lowercase letters, digits and '-' (not at either end), at most 63",
    )
    # Needed to add an origin; with --update, each setting not given is kept
    # (trial 44: --update reset every one not repeated, a capacity and a
    # credential among them, and said nothing).
    oa.add_argument("--url", help="OpenAI-compatible base URL, with /v1 (needed to add one)")
    oa.add_argument("--region", help="the region it is in (add that first; needed to add one)")
    oa.add_argument("--models", help="comma-separated model names (needed to add one)")
    oa.add_argument(
        "--model-name",
        action="append",
        default=[],
        metavar="MODEL=OWN_NAME",
        help="the name the origin knows one of its --models by (an Ollama tag such as "
        "llama3.1:8b, an Azure OpenAI deployment): requests for MODEL are sent to this "
        "origin with OWN_NAME as their model (repeatable; MODEL= removes one; a model "
        "dropped from --models drops its name too)",
    )
    oa.add_argument(
        "--weight",
        # 0 is no weight: proxies refuse an origin of weight 0 (drain one to
        # send it no new requests); not given, the control plane's default.
        type=_count(MAX_WEIGHT, low=1),
        default=None,
        help=f"traffic share among equals (1..{MAX_WEIGHT}, default {DEFAULT_WEIGHT}; "
        "to send an origin no new requests, drain it)",
    )
    oa.add_argument(
        "--capacity",
        type=_count(MAX_CAPACITY),
        default=None,
        help="concurrent requests the origin serves well: the load bound of its placement "
        "and the point past which its region spills (docs/routing.md); 0 or not given: "
        "unknown. A full region is shared by --weight, not capacity: give replicas of "
        "different sizes weights in proportion to their capacities",
    )
    oa.add_argument(
        "--credential-env",
        default=None,
        help="environment variable on the proxies holding the origin's API key "
        '(replaces a --credential-file; "" removes it)',
    )
    oa.add_argument(
        "--credential-file",
        default=None,
        help="file on the proxies holding the origin's API key (replaces a --credential-env)",
    )
    oa.add_argument(
        "--continuation",
        choices=["on", "off"],
        default=None,
        help="the origin accepts continuation requests (vLLM's continue_final_message), so "
        "streams cut elsewhere may continue here; on by default (vLLM, SGLang), off for "
        "hosted APIs",
    )
    oa.add_argument(
        "--probe-path",
        default=None,
        metavar="PATH",
        help="where the control plane probes the origin's health, from the root of its URL "
        "(vLLM, SGLang, TGI, llama.cpp: /health; Ollama: / or /api/version; LiteLLM: "
        '/health/liveliness); "" or not given: the control plane\'s --probe-path '
        "(default /health); turns probing on",
    )
    oa.add_argument(
        "--probe",
        choices=["on", "off"],
        default=None,
        help="off: never probe the origin (a hosted API that answers nothing without a key): "
        "it counts as healthy and the proxies' passive health alone judges it; on by default",
    )
    oa.add_argument(
        "--max-tokens-field",
        choices=list(TOKEN_FIELDS),
        default=None,
        help="the field in which the proxies send this origin a max_tokens they add (a "
        "tenant's --max-tokens ceiling or default) to a chat request that names no limit: "
        "max_completion_tokens for "
        "OpenAI's reasoning models (o-series, gpt-5), which refuse max_tokens; max_tokens "
        "(the default) for servers that read only it (Ollama). A client's own field is "
        "never renamed",
    )
    oa.add_argument(
        "--update",
        action="store_true",
        help="update the origin if it exists, keeping each setting not given",
    )
    origin.add_parser("delete", help="delete an origin").add_argument(
        "name", help="the origin's name"
    )

    tenant = sub.add_parser("tenant", help="add, change or delete tenants").add_subparsers(
        dest="action", required=True
    )
    ta = tenant.add_parser("add", help="add a tenant")
    ta.add_argument(
        "name",
        help="the tenant's name: lowercase letters, digits and '-' (not at either end), at most 63",
    )
    ts = tenant.add_parser("set", help="change a tenant's cache, prompt or routing policy")
    ts.add_argument("name", help="the tenant's name")
    ts.add_argument(
        "--cache",
        choices=["off", "exact", "semantic"],
        help="cache mode: off, exact (same request), or semantic (also similar questions)",
    )
    ts.add_argument(
        "--semantic-threshold",
        type=finite_float,
        help="least similarity of a semantic hit, 0.5 to 1; with --semantic-max-error, the "
        "cold-start prior; 0: the proxies' --semantic-threshold (0.90 by default)",
    )
    ts.add_argument(
        "--semantic-max-error",
        type=finite_float,
        metavar="SHARE",
        help="error-bounded semantic hits: the largest share of semantic hits that may be "
        "wrong (0.01 = 1 %%), thresholds learned per entry from checked answers; 0: off",
    )
    ts.add_argument(
        "--cache-ttl",
        type=_count(MAX_TTL_S),
        metavar="SECONDS",
        help="how long cached answers are kept; 0: the proxies' --cache-ttl",
    )
    ts.add_argument(
        "--cache-nondeterministic",
        choices=["on", "off"],
        help="also cache requests with temperature > 0 and no seed",
    )
    ts.add_argument("--system-prompt", help="system prompt added to every request")
    ts.add_argument(
        "--enforce-system-prompt",
        choices=["on", "off"],
        help="on: replace the client's system messages; off: prepend",
    )
    ts.add_argument(
        "--max-tokens",
        type=_count(MAX_TOKENS_CEILING),
        help="ceiling (and default) of max_tokens; added as max_tokens, or in the "
        "origin's --max-tokens-field",
    )
    ts.add_argument(
        "--default",
        action="append",
        default=[],
        metavar="PARAM=JSON",
        help="default parameter, e.g. temperature=0 (repeatable; PARAM= removes one)",
    )
    ts.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="PUBLIC=ORIGIN_MODEL",
        help="model alias (repeatable; PUBLIC= removes one)",
    )
    ts.add_argument(
        "--routing",
        choices=["affinity", "least-loaded", "weighted", "default"],
        help="how requests pick a replica inside a region: affinity (sessions and shared "
        "prefixes stay on one replica, within a load bound), least-loaded, or weighted; "
        "default: affinity for chat and completions, least-loaded for embeddings and rerank",
    )
    ts.add_argument(
        "--model-routing",
        action="append",
        default=[],
        metavar="MODEL=MODE",
        help="routing mode for one model, overriding --routing (repeatable; MODE "
        "'default' removes the override); warns of a model no origin serves",
    )
    ts.add_argument(
        "--user-sessions",
        choices=["on", "off"],
        help="on: the request's `user` field names a session (after prompt_cache_key and "
        "the session header)",
    )
    ts.add_argument(
        "--load-bound",
        type=finite_float,
        metavar="FACTOR",
        help="a replica past FACTOR (1..100) times its share of the region's load (and "
        "its capacity) loses new sessions to the next one; 0 = the default, 1.05",
    )
    ts.add_argument(
        "--continuation",
        choices=["on", "off"],
        help="on: a stream cut after the client got bytes continues on the next origin; "
        "off: it ends with an error event (default on)",
    )
    ts.add_argument(
        "--max-continuations",
        type=_count(MAX_CONTINUATIONS),
        metavar="N",
        help="continuations per request (default 2)",
    )
    ts.add_argument(
        "--stream-idle-timeout",
        type=finite_float,
        metavar="SECONDS",
        help="a stream with no chunk for this long (no event, once it had one: comments do "
        "not count) counts as cut (0: the proxy's default)",
    )
    ts.add_argument(
        "--hedge-ms",
        metavar="N|auto",
        help="send the request to the next origin too when no first byte came after N ms "
        "(auto: the origin's observed p95); 0 turns hedging off (the default)",
    )
    ts.add_argument(
        "--model-hedge-ms",
        action="append",
        default=[],
        metavar="MODEL=N|auto",
        help="hedge delay for one model, overriding --hedge-ms (repeatable; 'default' removes "
        "it); warns of a model no origin serves",
    )
    access = ts.add_mutually_exclusive_group()
    access.add_argument(
        "--models",
        type=_model_list,
        metavar="MODEL[,MODEL...]",
        help="the only models the tenant's callers may name (an alias by its own name); "
        "others are answered 404 model_not_found and left out of /v1/models",
    )
    access.add_argument(
        "--any-model",
        action="store_true",
        default=None,
        help="let the tenant's callers name every model again",
    )
    ts.add_argument(
        "--suspended",
        choices=["on", "off"],
        help="on: refuse every request of the tenant's callers (403 tenant_suspended), keeping "
        "its keys and settings; off: serve them again",
    )
    ts.add_argument(
        "--reason",
        metavar="TEXT",
        help="why it is suspended, for operators, one line of at most 200 characters (`get "
        "tenants`, the status page, which needs no token to read, the audit trail; never its "
        "callers): with --suspended on, or for a tenant suspended already (replaces it)",
    )
    # Which of the parsed values are settings (see _tenant_flags_given).
    ts.set_defaults(
        tenant_settings=tuple(a.dest for a in ts._actions if a.dest not in ("help", "name"))
    )
    tenant.add_parser("delete", help="delete a tenant whose keys are all revoked").add_argument(
        "name", help="the tenant's name"
    )

    key = sub.add_parser(
        "key", help="create, list, expire, suspend, resume and revoke API keys"
    ).add_subparsers(dest="action", required=True)
    kc = key.add_parser("create", help="create a key; it is printed once, on the last line")
    kc.add_argument("--tenant", required=True, help="the tenant the key belongs to")
    kc.add_argument("--description", default="", help="a note shown by `key list`")
    kc.add_argument(
        "--expires-in",
        type=_duration,
        metavar="DURATION",
        help="proxies refuse the key after this long (90s, 30m, 2h, 90d); default: never",
    )
    _limits_args(kc)
    kc.add_argument(
        "--models",
        type=_model_list,
        default=[],
        metavar="MODEL[,MODEL...]",
        help="the only models the key's callers may name, within its tenant's; "
        "default: its tenant's",
    )
    kl = key.add_parser("list", help="list keys (never their secrets)")
    kl.add_argument("--tenant", default="", help="only this tenant's keys")
    shown = kl.add_mutually_exclusive_group()
    shown.add_argument(
        "--all", action="store_true", help="active and revoked keys, with their STATE (the default)"
    )
    shown.add_argument(
        "--active",
        action="store_true",
        help="only keys in use: hide revoked, expired and suspended ones",
    )
    kl.add_argument(
        "-o", "--output", choices=["table", "json", "yaml"], default="table", help="format"
    )
    key.add_parser("revoke", help="revoke a key by its id").add_argument(
        "id", help="the key's id (key list)"
    )
    ks = key.add_parser(
        "suspend",
        help="refuse a key's callers (403 api_key_suspended) until it is resumed, keeping its "
        "limits, spend, models and expiry (a revoke cannot be undone)",
    )
    ks.add_argument("id", help="the key's id (key list)")
    ks.add_argument(
        "--reason",
        metavar="TEXT",
        help="why, for operators, one line of at most 200 characters: `key list` and the "
        "status page (which needs no token to read) show it while the key is suspended, and "
        "the audit trail keeps it (never sent to the key's callers); given again, it replaces "
        "the reason of a suspended key (--reason '' clears it)",
    )
    kr = key.add_parser("resume", help="serve a suspended key's callers again")
    kr.add_argument("id", help="the key's id (key list)")
    kr.add_argument(
        "--reason",
        metavar="TEXT",
        help="why, for the audit trail (a control plane older than reasons drops it)",
    )
    ke = key.add_parser(
        "expire", help="make a key expire (to rotate it: create its successor, then expire it)"
    )
    ke.add_argument("id", help="the key's id (key list)")
    when = ke.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--in", dest="expires_in", type=_duration, metavar="DURATION", help="from now: 7d, 12h"
    )
    when.add_argument("--never", action="store_true", help="remove the key's expiry")
    km = key.add_parser(
        "models", help="set the models a key's callers may name, within its tenant's"
    )
    km.add_argument("id", help="the key's id (key list)")
    names = km.add_mutually_exclusive_group(required=True)
    names.add_argument(
        "models",
        nargs="?",
        type=_model_list,
        metavar="MODEL[,MODEL...]",
        help="the only models the key's callers may name",
    )
    names.add_argument(
        "--any", action="store_true", help="the key's callers may name its tenant's models"
    )

    limit = sub.add_parser("limit", help="set rate limits").add_subparsers(
        dest="action", required=True
    )
    ls = limit.add_parser(
        "set",
        help="set a tenant's or a key's global limits; those not given are kept",
    )
    owner = ls.add_mutually_exclusive_group(required=True)
    owner.add_argument("--tenant", help="the tenant's limits (all its keys together)")
    owner.add_argument("--key", metavar="ID", help="one key's own limits (key list shows ids)")
    _limits_args(ls, kept=True)

    cache = sub.add_parser("cache", help="purge cached answers").add_subparsers(
        dest="action", required=True
    )
    cp = cache.add_parser(
        "purge",
        help="purge by tenant, model, or everything",
        description="Purge cached answers on every proxy (and Redis), by tenant, by model, "
        "or both; --all for everything.",
    )
    cp.add_argument(
        "--tenant", default="", help="only this tenant's answers (with --model: of that model)"
    )
    cp.add_argument(
        "--model",
        default="",
        help="only answers of this model, the name origins serve (an alias's answers are "
        "cached under it); without --tenant, of every tenant",
    )
    cp.add_argument("--all", action="store_true", help="required to purge everything")

    fleet = sub.add_parser(
        "fleet", help="adopt the fleet id the proxies serve (etcd lost for good)"
    ).add_subparsers(dest="action", required=True)
    fa = fleet.add_parser(
        "adopt",
        help="make the control plane's fleet id the one the proxies serve",
        description="Proxies refuse the route tables of a control plane whose etcd lost its "
        "state (or is another fleet's): its fleet id is not theirs. When etcd cannot be "
        "restored from a snapshot, apply the configuration and make keys again, then adopt "
        "the id the proxies name in their refusal (`get proxies -o json`, their "
        "ponto_fleet_info metric): they take the control plane's tables from then on. A proxy "
        "whose table requires a key still refuses one that requires none "
        "(docs/operations.md).",
    )
    fa.add_argument("fleet_id", metavar="ID", help="the fleet id the proxies serve")

    ap = sub.add_parser("apply", help="make regions, origins and tenants match a YAML file")
    ap.add_argument("-f", "--file", required=True, help="topology YAML ('-' for stdin)")
    ap.add_argument("--dry-run", action="store_true", help="show what would change, change nothing")
    ap.add_argument(
        "--prune",
        action="store_true",
        help="also delete the regions, origins and tenants the file leaves out of its lists "
        "(a kind the file has no list of, not even [], is left alone)",
    )

    ex = sub.add_parser(
        "export", help="write the whole topology (regions, origins, tenants) as an apply file"
    )
    ex.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml", help="format")

    get = sub.add_parser(
        "get",
        help="list regions, origins, tenants, keys, proxies, controlplanes, the table or the "
        "audit trail; -o yaml|json of regions, origins and tenants is an apply file",
    )
    get.add_argument(
        "kind",
        choices=[
            "regions", "origins", "tenants", "keys", "proxies", "controlplanes", "table", "audit",
        ],
        help="what to list",
    )  # fmt: skip
    get.add_argument(
        "-o",
        "--output",
        choices=["table", "json", "yaml"],
        default="table",
        help="format (yaml and json of regions, origins and tenants: an apply file)",
    )
    get.add_argument(
        "--wide",
        action="store_true",
        help=f"origins: each HEALTHY cell whole (probe details, ejections), not cut at "
        f"{HEALTH_CHARS} characters",
    )
    audit = get.add_argument_group("audit", "filters of `get audit` (the newest entries first)")
    audit.add_argument(
        "--limit", type=_count(1000, low=1), default=None, help="most entries shown (default 100)"
    )
    audit.add_argument(
        "--since", type=_duration, default=None, metavar="DURATION", help="e.g. 90s, 30m, 2h, 7d"
    )
    audit.add_argument("--action", default="", help="only this call, e.g. DrainRegion")
    audit.add_argument(
        "--actor",
        default="",
        help="only this actor: a client certificate's name (the demo's: ponto-admin), "
        "admin-token or anonymous",
    )

    drain_help = {
        "drain": "A drained region or origin gets no new requests (streams under way finish); "
        "warns of models left with no origin, which then get 503.",
        "undrain": "An undrained region or origin gets new requests again; warns when an "
        "origin's region is drained, or a region's origins all are, as it then still gets none.",
    }
    for verb in ("drain", "undrain"):
        d = sub.add_parser(verb, help=f"{verb} a region or an origin", description=drain_help[verb])
        d.add_argument(
            "kind", choices=["region", "origin"], help="region: all its origins; origin: that one"
        )
        d.add_argument("name", help="the region's or origin's name")
    return p


def _model_list(text: str) -> list[str]:
    """MODEL[,MODEL...]: each name checked as the control plane does."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected MODEL[,MODEL...], got {text!r}")
    try:
        return list(check_model_names(names, "models"))
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"{flag} expects NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _limits_over(current: pb.Limits, args: argparse.Namespace, owner: str) -> pb.Limits:
    """`current` with the limits given on the command line (`limit set`; for
    `key create`, whose limits all default to 0, over none), validated."""
    values = {
        dest: getattr(current, dest) if getattr(args, dest) is None else getattr(args, dest)
        for dest in LIMIT_DESTS
    }
    Limits(**values).validated(owner)
    # A copy of what was read, not a message rebuilt from the fields known
    # here: a newer control plane's limits (fields this pontoctl does not
    # know, kept as unknown fields) go back as they came (trial 69: an older
    # pontoctl's rebuilt limits wiped the budgets it did not know).
    limits = pb.Limits()
    limits.CopyFrom(current)
    for dest, value in values.items():
        setattr(limits, dest, value)
    return limits


def _models_text(
    names: Sequence[str], none: str = "any", mark: Callable[[str], str] = lambda _: ""
) -> str:
    """A model list in one table cell: the names, each with mark(name) after
    it (the first few of a long one, then how many more and how many of
    those are marked), or `none` for no list."""
    shown = ",".join(f"{n}{mark(n)}" for n in names[:MAX_CELL_MODELS])
    hidden = names[MAX_CELL_MODELS:]
    if hidden:
        marked = sum(1 for n in hidden if mark(n))
        shown += f",…(+{len(hidden)}" + (f", {marked} marked)" if marked else ")")
    return shown or none


# Models a table cell names of a list (`-o yaml` shows them all).
MAX_CELL_MODELS = 5


def _budget_notes(limits: pb.Limits, spent: apb.BudgetSpent | None) -> list[str]:
    """What `limit set` says of budgets that take effect otherwise than one
    may think: a month budget under the day's (the day's is never reached),
    or a budget already spent as the leader last counted (refused at once,
    until the period ends)."""
    day, month = limits.tokens_per_day, limits.tokens_per_month
    notes = []
    if 0 < month < day:
        notes.append(
            f"tokens_per_month {month} is less than tokens_per_day {day}: the month's "
            "budget is reached first, and the day's never"
        )
    if spent is not None:  # today's, as the control plane counts days
        for budget, used, kind, period, ends in (
            (day, spent.day_tokens, "day", "today", "00:00 UTC"),
            (month, spent.month_tokens, "month", "this month", "the 1st of next month, 00:00 UTC"),
        ):
            if 0 < budget <= used:
                notes.append(
                    f"{used:.0f} tokens were spent {period}: the new {kind} budget of "
                    f"{budget} is spent, and requests are refused until {ends}"
                )
    return notes


def _limits_text(limits: pb.Limits) -> str:
    """Limits as `limit set` confirms them: the flags' names."""
    shown = [f"{n}={getattr(limits, n)}" for n in LIMIT_DESTS if getattr(limits, n)]
    return " ".join(shown) or "no limits"


def _limits_cell(limits: pb.Limits, spent: apb.BudgetSpent) -> list[str]:
    """A tenant's or key's limits in a table cell (`get tenants`, `key
    list`, alike): short names, and what its budgets spent."""
    parts = [
        f"{k}={v}"
        for k, v in (
            ("rpm", limits.rpm),
            ("tpm", limits.tpm),
            ("conc", limits.concurrency),
            ("tokens/day", limits.tokens_per_day),
            ("tokens/month", limits.tokens_per_month),
        )
        if v
    ]
    return parts + [p for p in _spent_parts(limits, spent) if not p.endswith("=0")]


def _spent_parts(limits: pb.Limits, spent: apb.BudgetSpent) -> list[str]:
    """What a budgeted tenant or key spent today and this month (UTC), as the
    leader last counted, beside its budgets: spent/day=N, spent/month=N."""
    parts = []
    if limits.tokens_per_day:
        parts.append(f"spent/day={spent.day_tokens:.0f}")
    if limits.tokens_per_month:
        parts.append(f"spent/month={spent.month_tokens:.0f}")
    return parts


def _tenant_flags_given(args: argparse.Namespace) -> bool:
    """Whether `tenant set` was given any setting (they all default to None or [])."""
    return any(getattr(args, dest) not in (None, []) for dest in args.tenant_settings)


# The calls the audit trail records (what `get audit --action` may name): the
# Admin API's writes by name, but for those recorded as what they did: drains
# as Drain* or Undrain* (auditing.drain_action), a key's suspension as
# SuspendKey or ResumeKey (auditing.key_suspension_action).
_RENAMED_ACTIONS = {"SetKeySuspended": ("SuspendKey", "ResumeKey")}
_AUDITED = frozenset(
    name
    for m in apb.DESCRIPTOR.services_by_name["Admin"].methods
    if not m.name.startswith(("List", "Get", "Export"))
    for name in _RENAMED_ACTIONS.get(m.name, (m.name, m.name.replace("Drain", "Undrain", 1)))
)


def _tenant_update(args: argparse.Namespace, current: pb.Tenant) -> apb.UpdateTenantRequest:
    req = apb.UpdateTenantRequest(name=args.name)
    cache = pb.CachePolicy()
    cache.CopyFrom(current.cache)
    if args.cache is not None:
        cache.mode = args.cache
    if args.semantic_threshold is not None:
        cache.semantic_threshold = args.semantic_threshold
    if args.semantic_max_error is not None:
        cache.semantic_max_error = args.semantic_max_error
    if args.cache_ttl is not None:
        cache.ttl_s = args.cache_ttl
    if args.cache_nondeterministic is not None:
        cache.cache_nondeterministic = args.cache_nondeterministic == "on"
    if cache != current.cache:
        req.cache.CopyFrom(cache)
    prompt = pb.PromptPolicy()
    prompt.CopyFrom(current.prompt)
    if args.system_prompt is not None:
        prompt.system_prompt = args.system_prompt
    if args.enforce_system_prompt is not None:
        prompt.enforce_system_prompt = args.enforce_system_prompt == "on"
    if args.max_tokens is not None:
        prompt.max_tokens_ceiling = args.max_tokens
    for entries, given, flag in (
        (prompt.defaults, args.default, "--default"),
        (prompt.aliases, args.alias, "--alias"),
    ):
        for name, value in _pairs(given, flag).items():
            if value:
                entries[name] = value
            elif name in entries:  # NAME= removes it
                del entries[name]
    if prompt != current.prompt:
        req.prompt.CopyFrom(prompt)
    routing = pb.RoutingPolicy()
    routing.CopyFrom(current.routing)
    if args.routing is not None:
        routing.mode = "" if args.routing == "default" else args.routing
    for model, mode in _pairs(args.model_routing, "--model-routing").items():
        if mode == "default":
            routing.models.pop(model, None)
        else:
            routing.models[model] = mode
    if args.user_sessions is not None:
        routing.user_sessions = args.user_sessions == "on"
    if args.load_bound is not None:
        routing.load_bound = args.load_bound
    if routing != current.routing:
        req.routing.CopyFrom(routing)
    streams = pb.StreamPolicy()
    streams.CopyFrom(current.streams)
    if args.continuation is not None:
        streams.continuation = "" if args.continuation == "on" else "off"
    if args.max_continuations is not None:
        streams.max_continuations = args.max_continuations
    if args.stream_idle_timeout is not None:
        streams.stream_idle_timeout_s = args.stream_idle_timeout
    if args.hedge_ms is not None:
        streams.hedge_auto = args.hedge_ms == "auto"
        if not streams.hedge_auto:
            streams.hedge_ms = _milliseconds(args.hedge_ms, "--hedge-ms")
        else:
            streams.hedge_ms = 0
    for model, delay in _pairs(args.model_hedge_ms, "--model-hedge-ms").items():
        if delay == "default":
            streams.hedge_models.pop(model, None)
        elif delay == "auto":
            streams.hedge_models[model] = delay
        else:
            streams.hedge_models[model] = str(_milliseconds(delay, "--model-hedge-ms"))
    if streams != current.streams:
        req.streams.CopyFrom(streams)
    if args.models is not None or args.any_model:
        models = pb.ModelAccess(names=[] if args.any_model else args.models)
        if models.names != current.models.names:
            req.models.CopyFrom(models)
    if args.suspended is not None and (args.suspended == "on") != current.suspended:
        req.suspended = args.suspended == "on"
    reason = args.reason.strip() if args.reason is not None else None  # as stored
    if reason is not None:
        if not (args.suspended == "on" or (args.suspended is None and current.suspended)):
            raise UsageError(
                f"--reason says why a tenant is suspended; tenant {args.name} "
                + ("will not be" if args.suspended == "off" else "is not")
                + ": give --suspended on"
            )
        if reason != current.suspended_reason:
            req.suspended_reason = reason
    return req


def _asked_tenant(update: apb.UpdateTenantRequest) -> pb.Tenant:
    """The tenant as `update` would leave the parts it sets, the others
    empty: what its answer must hold."""
    asked = pb.Tenant(name=update.name)
    for part in ("limits", "cache", "prompt", "routing", "streams", "models", "jwt"):
        if update.HasField(part):
            getattr(asked, part).CopyFrom(getattr(update, part))
    if update.HasField("suspended"):
        asked.suspended = update.suspended
    if update.HasField("suspended_reason"):
        asked.suspended_reason = update.suspended_reason
    return asked


def _milliseconds(text: str, flag: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise UsageError(f"{flag} takes milliseconds (0 or more) or auto, not {text!r}")
    return int(text)


# Marks a model a tenant names that no origin lists: an alias's target
# (model.unserved_aliases), a per-model routing policy's or hedge delay's
# (model.unserved_settings); the note says why below the table.
UNSERVED = "(unserved)"
UNSERVED_NOTE = (
    f"{UNSERVED}: no origin serves that model now; requests for it or an alias to it get "
    "404, and a routing policy or hedge delay for it applies to nothing, until one does"
)
# Marks a model on a key's list that its tenant's list lacks (trial 32: the
# write warned, the table did not).
OFF_TENANT = "(not tenant's)"
OFF_TENANT_NOTE = (
    f"{OFF_TENANT}: the key's tenant may not name that model (its model list lacks it); "
    "requests for it get 404 until the tenant's list has it"
)
# Marks a per-model routing policy or hedge delay set for one of the tenant's
# own aliases, served or not: requests for the alias work, but proxies pick
# both settings by the model the alias names, so it never applies (as
# model.unserved_settings warns when it is set); the note names that model.
ALIAS = "(alias)"
ALIAS_NOTE = (
    f"{ALIAS}: a routing policy or hedge delay for an alias never applies (requests are "
    "routed and hedged by the model the alias names); set it for that model instead: "
)


def _served_mark(model: str, served: Collection[str] | None) -> str:
    """UNSERVED when served (the models origins list) is known and lacks model."""
    return UNSERVED if served is not None and model not in served else ""


def _setting_mark(t: pb.Tenant, model: str, served: Collection[str] | None) -> str:
    """The mark of model in tenant t's per-model routing or hedge delays: ALIAS
    for one of t's aliases, else _served_mark."""
    return ALIAS if model in t.prompt.aliases else _served_mark(model, served)


def _listed_mark(t: pb.Tenant | None, model: str, served: Collection[str] | None) -> str:
    """The mark of model on a model list of tenant t's (its own or a key's):
    none for one of t's aliases (an alias is listed by its own name; the
    ALIASES column marks its target), else _served_mark."""
    return "" if t is not None and model in t.prompt.aliases else _served_mark(model, served)


def _key_mark(t: pb.Tenant | None, model: str, served: Collection[str] | None) -> str:
    """The mark of model on a key's list: OFF_TENANT when its tenant t has a
    list without it (the key's callers get 404 for it), else _listed_mark."""
    if t is not None and t.models.names and model not in t.models.names:
        return OFF_TENANT
    return _listed_mark(t, model, served)


def _alias_settings(t: pb.Tenant) -> list[str]:
    """`TENANT: ALIAS -> MODEL` for each of tenant t's per-model settings that
    is for one of its aliases (sorted, once each)."""
    named = {*t.routing.models, *t.streams.hedge_models} & set(t.prompt.aliases)
    return [f"{t.name}: {a} -> {t.prompt.aliases[a]}" for a in sorted(named)]


def _tenant_notes(tenants: Sequence[pb.Tenant], served: Collection[str]) -> list[str]:
    """The notes below `get tenants`' table, for the marks its rows hold."""
    unserved = (
        any(_served_mark(m, served) for t in tenants for m in t.prompt.aliases.values())
        or any(
            _setting_mark(t, m, served) == UNSERVED
            for t in tenants
            for m in (*t.routing.models, *t.streams.hedge_models)
        )
        or any(_listed_mark(t, m, served) for t in tenants for m in t.models.names)
    )
    aliased = [line for t in tenants for line in _alias_settings(t)]
    suspended = [
        _suspension_line(f"tenant {t.name}", t.suspended_at, t.suspended_reason)
        for t in tenants
        # Known of a suspension written by a control plane of reasons.
        if t.suspended and (t.suspended_reason or t.suspended_at)
    ]
    return (
        ([UNSERVED_NOTE] if unserved else [])
        + ([ALIAS_NOTE + "; ".join(aliased)] if aliased else [])
        + suspended
    )


def _routing_text(m: pb.RoutingPolicy, mark: Callable[[str], str] = lambda _: "") -> str:
    """A routing policy on one line: mode, per-model modes (each model with
    mark(model) after it), `user` for user sessions, the load bound."""
    parts = [m.mode or "default"]
    parts += [f"{model}{mark(model)}={mode}" for model, mode in sorted(m.models.items())]
    if m.user_sessions:
        parts.append("user")
    if m.load_bound:
        parts.append(f"bound={m.load_bound:g}")
    return ",".join(parts)


def _rows_tenants(
    resp: apb.ListTenantsResponse, served: Collection[str] | None = None
) -> tuple[list[str], list[list[str]]]:
    """The tenants table; with served (the models origins list), each model a
    tenant names that no origin lists is marked UNSERVED: its aliases' targets,
    its per-model routing policies' and hedge delays' models, the names on its
    model list that are not its aliases. A per-model setting for one of the
    tenant's aliases is marked ALIAS instead, served or not."""

    def aliases(m: pb.PromptPolicy) -> str:
        return (
            ",".join(f"{k}->{v}{_served_mark(v, served)}" for k, v in sorted(m.aliases.items()))
            or "-"
        )

    spent = {b.scope: b for b in resp.spent}

    def limits(t: pb.Tenant) -> str:
        parts = _limits_cell(t.limits, spent.get(f"t/{t.name}", NOTHING_SPENT))
        # The ceiling a request's max_tokens is lowered to (trial 35: set, it
        # was shown nowhere but in `get tenant`'s audit).
        if t.prompt.max_tokens_ceiling:
            parts.append(f"max_tokens<={t.prompt.max_tokens_ceiling}")
        return ",".join(parts) or "-"

    def streams(t: pb.Tenant) -> str:
        m = t.streams
        parts = ["continue" if m.continuation != "off" else "no-continue"]
        if m.hedge_auto or m.hedge_ms:
            parts.append("hedge=" + ("auto" if m.hedge_auto else f"{m.hedge_ms}ms"))
        parts += [
            f"hedge[{model}{_setting_mark(t, model, served)}]={v}"
            for model, v in sorted(m.hedge_models.items())
        ]
        if m.stream_idle_timeout_s:
            parts.append(f"idle={m.stream_idle_timeout_s:g}s")
        return ",".join(parts)

    header = ["NAME", "LIMITS", "CACHE", "TTL", "ROUTING", "STREAMS", "SYSTEM-PROMPT", "ALIASES"]
    return [*header, "MODELS", "JWT", "STATE"], [
        [
            t.name,
            limits(t),
            t.cache.mode
            + (f"@{t.cache.semantic_threshold:g}" if t.cache.semantic_threshold else "")
            + (f",max-err={t.cache.semantic_max_error:g}" if t.cache.semantic_max_error else ""),
            f"{t.cache.ttl_s}s" if t.cache.ttl_s else "default",
            _routing_text(t.routing, functools.partial(_setting_mark, t, served=served)),
            streams(t),
            (t.prompt.system_prompt[:30] + ("…" if len(t.prompt.system_prompt) > 30 else ""))
            or "-",
            aliases(t.prompt),
            _models_text(t.models.names, mark=functools.partial(_listed_mark, t, served=served)),
            t.jwt.issuer if t.HasField("jwt") else "-",
            "suspended" if t.suspended else "serving",
        ]
        for t in resp.tenants
    ]


# The longest CHANGES cell of `get audit`'s table; -o yaml has them whole.
AUDIT_CHANGES_CHARS = 100


def _rows_audit(resp: apb.ListAuditResponse) -> tuple[list[str], list[list[str]]]:
    """The trail's table. CHANGES is what a call replaced, as its entry's
    `changes` says (`limits.rpm 600 -> 900`: UpdateTenant, SetKeyLimits,
    SetKeyModels, drains; trial: a `limit set` read "UpdateTenant, ok" and
    nothing of which limit); empty for calls that write no such line.
    Before RESULT, whose refusals' messages are long: after them, every
    row's CHANGES began past the screen's edge (review)."""
    return ["TIME", "ACTOR", "ACTION", "TARGET", "SOURCE", "CHANGES", "RESULT"], [
        [
            utc(e.time),
            e.actor,
            e.action,
            e.target,
            e.source,
            _cut(_changes_with_reason(e.detail), AUDIT_CHANGES_CHARS),
            # Refusals of Apply list one error a line: the table shows the start.
            e.result if not e.message else f"{e.result}: {' '.join(e.message.split())[:60]}",
        ]
        for e in resp.entries
    ]


def _changes_with_reason(detail: Mapping[str, str]) -> str:
    """An entry's `changes`, and the reason its call gave when the changes
    do not say it already (a key resumed `--reason ...`: trial 72 found it in
    `-o json` alone)."""
    changes, reason = detail.get("changes", ""), detail.get("reason", "").strip()
    # Said already as the reason a suspension stored (not one it removed).
    if not reason or changes.endswith("-> " + json.dumps(reason, ensure_ascii=False)):
        return changes
    said = f"reason: {escape_hidden(reason)}"
    return f"{changes} ({said})" if changes else said


# The longest HEALTHY cell of `get origins`' table.
HEALTH_CHARS = 100


def _cut(text: str, most: int) -> str:
    """`text` of at most `most` characters (0: any), an ellipsis for the rest."""
    return text if not most or len(text) <= most else text[: most - 1] + "…"


def _audit_times(data: dict[str, Any]) -> dict[str, Any]:
    """Each entry's time as RFC 3339 UTC to the millisecond, as the access log
    writes its own (`2026-12-04T11:02:08.421Z`), not Unix seconds."""
    for entry in data.get("entries", ()):
        when = entry.get("time")
        if isinstance(when, int | float):
            entry["time"] = utc_ms(when)
    return data


def _rows_replicas(resp: apb.ListControlPlanesResponse) -> tuple[list[str], list[list[str]]]:
    now = time.time()
    return ["ID", "ADDRESS", "LEADER", "VERSION", "AGE"], [
        [
            r.id,
            r.address,
            "yes" if r.leader else "-",
            r.version or "?",  # a replica older than the field
            f"{max(0, now - r.started_at):.0f}s",
        ]
        for r in resp.replicas
    ]


def _rows_keys(
    resp: apb.ListKeysResponse,
    tenants: Mapping[str, pb.Tenant] | None = None,
    served: Collection[str] | None = None,
) -> tuple[list[str], list[list[str]]]:
    """The keys' table. A key whose tenant is not in tenants (the control plane's,
    by name, when given) shows it as `NAME(deleted)`: a deleted tenant keeps its
    revoked keys, which keep a fleet that ever had a key closed (auth_required).
    With served (the models origins list), a name on a key's model list that
    no origin lists, and that is not its tenant's alias, is marked UNSERVED."""
    now = time.time()
    spent = {b.scope: b for b in resp.spent}
    header = ["ID", "TENANT", "DESCRIPTION", "LIMITS", "MODELS", "CREATED", "EXPIRES", "STATE"]
    return header, [
        [
            k.id,
            k.tenant if tenants is None or k.tenant in tenants else f"{k.tenant}(deleted)",
            k.description or "-",
            ",".join(_limits_cell(k.limits, spent.get(f"k/{k.id}", NOTHING_SPENT))) or "-",
            _models_text(
                k.models,
                none="tenant's",
                mark=functools.partial(
                    _key_mark, None if tenants is None else tenants.get(k.tenant), served=served
                ),
            ),
            # RFC 3339, no spaces: one field per column for awk and cut.
            utc(k.created_at),
            utc(k.expires_at) if k.expires_at else "-",
            _key_state(k, now),
        ]
        for k in resp.keys
    ]


def _keys_shown(resp: apb.ListKeysResponse, data: dict[str, Any]) -> dict[str, Any]:
    """data (resp as JSON) with each key's `state` (_key_state) as the
    table's STATE column says it (trial 52: a script had to compare
    expires_at with the clock itself), then its `spent` (_spent_per_key)."""
    now = time.time()
    for key, k in zip(data.get("keys", []), resp.keys, strict=True):
        key["state"] = _key_state(k, now)
    return _spent_per_key(data)


def _spent_per_key(data: dict[str, Any]) -> dict[str, Any]:
    """data (a keys' list as JSON) with each budgeted key's `spent` (day,
    day_tokens, month_tokens) within it as well as in the top-level list,
    which a reader of one key missed (trial 42). `get tenants -o json` is the
    apply file's form, which has no place for it."""
    spent = {row["scope"]: row for row in data.get("spent", [])}
    for row in spent.values():
        # Whole tokens: JSON's doubles read 18804.0 (and, from a control
        # plane before they were whole, 18804.917).
        row.update((k, round(v)) for k, v in list(row.items()) if k.endswith("_tokens"))
    for key in data.get("keys", []):
        row = spent.get(f"k/{key['id']}")
        if row is not None:
            key["spent"] = {k: v for k, v in row.items() if k != "scope"}
    return data


# Keys a ListKeys answer carries (pontoctl takes every page), the most the
# control plane gives: about 1.1 MB, which pontoctl's channel takes
# (MAX_ADMIN_ANSWER_BYTES). Each page reads and sorts every key again on the
# control plane: at 20,000 keys pages of 1,000 cost it 1.0-1.2 s of CPU
# against 0.16 s for one answer, pages of 5,000 0.33 s.
KEYS_PAGE = MAX_PAGE


def _list_keys(stub: Any, *, tenant: str = "", include_revoked: bool) -> apb.ListKeysResponse:
    """Every key ListKeys lists with this filter, asked a page at a time
    (each answer bounded, however many keys the fleet has), in one answer.
    A control plane older than pages answers every key at once, with no
    token: one call. One asked a later page (pontoctl's connection moved to
    an older replica in an upgrade) answers every key too: that answer,
    more keys than a page holds, is the listing, not the rest of it. The
    spend rows are ordered by scope, as one answer's are (each page's are,
    among themselves)."""
    whole = apb.ListKeysResponse()
    token = ""
    while True:
        page = stub.ListKeys(
            apb.ListKeysRequest(
                tenant=tenant,
                include_revoked=include_revoked,
                page_size=KEYS_PAGE,
                page_token=token,
            )
        )
        if len(page.keys) > KEYS_PAGE:  # every key: an older control plane's
            whole = page
        else:
            whole.keys.extend(page.keys)
            whole.spent.extend(page.spent)
        token = page.next_page_token
        if not token:  # each token names a later key than the one before
            whole.spent.sort(key=lambda s: s.scope)
            return whole


def _render_keys(stub: Any, keys: apb.ListKeysResponse, output: str) -> str:
    """keys as output asks; a table marks the keys of deleted tenants and the
    unserved models on keys' lists (with the note that says why), and says
    under it since when and why each suspended key is (free text: no column
    of its own, which awk and cut would split)."""
    if output != "table":
        return render(keys, output, _rows_keys, functools.partial(_keys_shown, keys))
    tenants = {t.name: t for t in stub.ListTenants(apb.ListRequest()).tenants}
    served = frozenset(m for o in stub.ListOrigins(apb.ListRequest()).origins for m in o.models)
    shown = render(keys, output, lambda r: _rows_keys(r, tenants, served))
    marks = {_key_mark(tenants.get(k.tenant), m, served) for k in keys.keys for m in k.models}
    notes = ((UNSERVED, UNSERVED_NOTE), (OFF_TENANT, OFF_TENANT_NOTE))
    suspensions = [_suspension_note(k) for k in keys.keys if k.suspended and not k.revoked]
    return "\n".join([shown, *(note for mark, note in notes if mark in marks), *suspensions])


def _suspension_note(k: apb.ApiKeyInfo) -> str:
    """A suspended key's line under `key list`: since when and why (hidden
    characters escaped, as in table cells). A key without a time was
    suspended by, or listed by, a control plane older than reasons."""
    if not k.suspended_at:
        return f"key {k.id} suspended: since when and why unknown (an older control plane's)"
    return _suspension_line(f"key {k.id}", k.suspended_at, k.suspended_reason)


def _suspension_line(what: str, at: float, reason: str) -> str:
    """A suspension's line under a table, a tenant's or a key's: since when
    (`at`, when known) and why (hidden characters escaped, as in cells)."""
    since = f" since {utc(at)}" if at else ""
    return f"{what} suspended{since}: {escape_hidden(reason) or 'no reason given'}"


def _keys_text(keys: Sequence[pb.ApiKey]) -> str:
    """The keys of a table: none revoked; those past their expiry, and those
    suspended, said apart."""
    now = time.time()
    expired = sum(1 for k in keys if key_expired(k.expires_at, now))
    suspended = sum(1 for k in keys if k.suspended)
    apart = [f"{n} {what}" for n, what in ((expired, "expired"), (suspended, "suspended")) if n]
    return f"{len(keys)} keys ({', '.join(apart)})" if apart else f"{len(keys)} active keys"


def _key_state(k: apb.ApiKeyInfo, now: float) -> str:
    """active, revoked, expired, suspended, or expired,suspended (one
    field: both must be undone before the key is served)."""
    if k.revoked:
        return "revoked"
    expired = key_expired(k.expires_at, now)
    states = [s for s, on in (("expired", expired), ("suspended", k.suspended)) if on]
    return ",".join(states) or "active"


def _merged(current: pb.Tenant, update: apb.UpdateTenantRequest) -> Tenant:
    """The tenant the control plane will hold after update, as a model value."""
    merged = pb.Tenant()
    merged.CopyFrom(current)
    merged.name = update.name
    for part in ("limits", "cache", "prompt", "routing", "streams", "models"):
        if update.HasField(part):
            getattr(merged, part).CopyFrom(getattr(update, part))
    if update.HasField("suspended"):
        merged.suspended = update.suspended
        if not update.suspended:
            merged.suspended_reason = ""
    if update.HasField("suspended_reason"):
        merged.suspended_reason = update.suspended_reason
    return tenant_of(merged)


def _load(path: str) -> Any:
    """The YAML (or JSON) document in path, '-' for stdin."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text") from exc
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        # Before construction, which keeps the last of a key given twice and
        # merges `<<` keys into the mapping's own (trial 52: `{rpm: 600, rpm: 6}`
        # was applied as rpm 6; apply promises a typo never passes silently).
        if twice := _key_given_twice(loader, node, "", set()):
            raise UsageError(f"{path} is not valid YAML: {twice}")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path} is not valid YAML: {_yaml_problem(exc)}") from exc
    except RecursionError as exc:
        # PyYAML's composer (and the walk above) recurse once per level.
        raise UsageError(f"{path} nests too deep to read (hundreds of levels)") from exc
    finally:
        loader.dispose()


def _key_given_twice(loader: yaml.SafeLoader, node: yaml.Node, at: str, seen: set[int]) -> str:
    """Where the first key given twice in one mapping under node (composed,
    not yet constructed) is, with its path from the document (`tenants[0].limits.rpm`)
    as apply's errors name it; "" if none is. Keys are compared as YAML reads
    them (`rpm` and `"rpm"` are one key); `<<` merge keys may repeat what they merge."""
    if id(node) in seen:  # an alias: its anchor's node was checked (or is being)
        return ""
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if found := _key_given_twice(loader, item, f"{at}[{i}]", seen):
                return found
    elif isinstance(node, yaml.MappingNode):
        first: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = None
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE:
                key = loader.construct_object(key_node)
                if key in first:
                    return (
                        f"{_yaml_mark(key_node.start_mark)}: {at + '.' if at else ''}{key} "
                        f"is given twice (first at {_yaml_mark(first[key].start_mark)}); "
                        "a mapping's keys must differ"
                    )
                first[key] = key_node
            inner = at if key is None else f"{at}.{key}" if at else str(key)
            if found := _key_given_twice(loader, value_node, inner, seen):
                return found
    return ""


_MERGE = "tag:yaml.org,2002:merge"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, at its line and column (PyYAML's own text
    takes five, quotes the document and calls it "<unicode string>")."""
    problem = getattr(exc, "problem", None)
    if not isinstance(problem, str):
        return " ".join(str(exc).split())
    where = _yaml_mark(getattr(exc, "problem_mark", None))
    context = getattr(exc, "context", None)
    if isinstance(context, str):
        # Where the context began is often the mistake (a key without its
        # colon, a quote never closed), the problem's mark only where it showed.
        began = _yaml_mark(getattr(exc, "context_mark", None))
        if began and began != where:
            context += f" at {began}"
        problem += f" ({context})"
    return f"{where}: {problem}" if where else problem


def _yaml_mark(mark: Any) -> str:
    return "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}"


def apply_file(stub: Any, path: str, *, dry_run: bool = False, prune: bool = False) -> str:
    """Send the topology in path to the control plane's Apply; return the report.

    The control plane checks the whole file (the same checks with or without
    dry_run) and writes all of it in one transaction, or nothing. A NaN or an
    infinity anywhere in it is refused here first (ApplyError, with every
    path), as JSON cannot carry one.
    """
    doc = _load(path)
    if found := non_finite(doc):
        # JSON has no NaN or infinity: orjson would write null, which the
        # control plane reads as the field left out (a value removed, or
        # "required"), and dry runs would say so.
        raise ApplyError(
            [
                f"{path or 'the document'}: must be a finite number, not {_yaml(v)}"
                for path, v in found
            ]
        )
    try:
        # Non-string keys become strings, which the control plane then checks as names.
        text = orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError as exc:
        raise UsageError(f"{path} holds a value that is not JSON: {exc}") from exc
    resp = stub.Apply(apb.ApplyRequest(document=text, prune=prune, dry_run=dry_run))
    counts = dict.fromkeys(("created", "updated", "deleted", "unchanged"), 0)
    lines = []
    for c in resp.changes:
        counts[c.action] += 1
        lines.append(f"{c.kind} {c.name} {c.action}" + _change_detail(c))
    summary = ", ".join(f"{n} {action}" for action, n in counts.items())
    suffix = " (dry run: nothing changed)" if resp.dry_run else ""
    return "\n".join([*lines, summary + suffix])


def _yaml(value: float) -> str:
    """A NaN or an infinity as YAML writes it."""
    return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")


def _change_detail(c: apb.Change) -> str:
    """What an update changes, value by value (`: limits.rpm 600 -> removed`); the
    fields alone from a control plane that does not say (an older version)."""
    if c.changes:
        return ": " + change_text((f.path, f.before, f.after) for f in c.changes)
    return f" ({', '.join(c.fields)})" if c.fields else ""


def _export(stub: Any) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(stub.Export(apb.ListRequest()).document)
    return doc


def _dump(doc: dict[str, Any], output: str) -> str:
    if output == "json":
        return json.dumps(doc, indent=2)
    return yaml.safe_dump(doc, sort_keys=False).rstrip()


def _table_summary(resp: apb.GetRouteTableResponse) -> str:
    t = resp.table
    if not t.version:
        return "no route table yet (the control plane has not compiled one)"
    head = (
        f"route table version {t.version} (etag {t.etag[:12]}): {len(t.regions)} regions, "
        f"{len(t.origins)} origins, {len(t.tenants)} tenants, {_keys_text(t.keys)}, "
        f"{sum(not p.birth for p in t.purges)} purges; "
        f"auth {'required' if t.auth_required else 'open'}; "
        f"fleet {t.fleet_id or '? (a control plane older than fleet ids)'}"
    )
    rows = []
    for r in t.regions:
        rows.append([r.name, "drained" if r.drained else "serving", "", "", ""])
        for o in (o for o in t.origins if o.region == r.name):
            load = _inflight(o)
            health = "healthy" if o.healthy else f"unhealthy ({o.health_detail or '?'})"
            state = "drained" if o.drained else "serving"
            rows.append([f"  {o.name}", state, health, load, ",".join(o.models)])
    table = _table(["REGION / ORIGIN", "STATE", "HEALTH", "INFLIGHT", "MODELS"], rows)
    tenants = "tenants: " + (", ".join(x.name for x in t.tenants) or "-")
    return "\n".join([head, table, tenants, "(-o json for the whole table)"])


def _adding(kind: str, args: argparse.Namespace, needed: Mapping[str, object]) -> None:
    """Refuse (UsageError) to add region or origin `args.name` without the
    flags a new one needs (`needed`: flag -> value given, None if not)."""
    missing = ", ".join(flag for flag, value in needed.items() if value is None)
    if not missing:
        return
    if args.update:  # a misspelt name, most likely: exit 1, as a NOT_FOUND is
        raise Missing(f"{kind} {args.name} not found; adding it needs {missing}")
    article = "an" if kind[0] in "aeiou" else "a"
    raise UsageError(
        f"adding {kind} {args.name} needs {missing} (or --update, to change {article} {kind})"
    )


def _region_spec(args: argparse.Namespace, current: pb.Region | None) -> apb.RegionSpec:
    """The region `region add` asks for: its flags, and for a region that
    exists (`current`, with --update) its settings for the flags not given
    (trial 52: an update reset its RTTs and spill threshold, and needed its
    coordinates again)."""
    if current is None:
        _adding("region", args, {"--lat": args.lat, "--lon": args.lon})
    spec = _region_as_spec(current) if current is not None else apb.RegionSpec(name=args.name)
    if args.lat is not None:
        spec.latitude = args.lat
    if args.lon is not None:
        spec.longitude = args.lon
    if args.rtt is not None:
        spec.rtt_ms.clear()
        spec.rtt_ms.update(parse_rtt(args.rtt))
    if args.spill_threshold is not None:
        spec.spill_threshold = args.spill_threshold
    return spec


def _region_as_spec(r: pb.Region) -> apb.RegionSpec:
    """A region's settings, as `region add` gives them."""
    return apb.RegionSpec(
        name=r.name,
        latitude=r.latitude,
        longitude=r.longitude,
        rtt_ms=dict(r.rtt_ms),
        spill_threshold=r.spill_threshold,
    )


def _region_changes(before: pb.Region, after: pb.Region) -> list[str]:
    """What an update changed, as `origin add --update` says it."""

    def shown(r: pb.Region) -> dict[str, str]:
        return {
            "lat": f"{r.latitude:g}",
            "lon": f"{r.longitude:g}",
            "rtt": _rtt_text(r),
            "spill_threshold": _spill(r),
        }

    return _changes(shown(before), shown(after))


def _changes(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """`field old -> new` of each field shown differently."""
    return [f"{k} {old[k]} -> {new[k]}" for k in old if old[k] != new[k]]


def _origin_spec(args: argparse.Namespace, current: pb.Origin | None) -> apb.OriginSpec:
    """The origin `origin add` asks for: its flags, and for an origin that
    exists (`current`, with --update) its settings for the flags not given."""
    if current is None:
        _adding(
            "origin", args, {"--url": args.url, "--region": args.region, "--models": args.models}
        )
    spec = _as_spec(current) if current is not None else apb.OriginSpec(name=args.name)
    if args.url is not None:
        spec.base_url = args.url
    if args.region is not None:
        spec.region = args.region
    if args.models is not None:
        spec.models[:] = [m.strip() for m in args.models.split(",") if m.strip()]
        # A model no longer served keeps no name of its own: it would make
        # the origin invalid, and `--models` alone is how one drops a model.
        for public in [p for p in spec.model_names if p not in spec.models]:
            del spec.model_names[public]
    for public, own in _pairs(args.model_name, "--model-name").items():
        if own:
            spec.model_names[public] = own
        else:  # MODEL= removes it
            spec.model_names.pop(public, None)
    if args.weight:  # 0: not given (a new origin: the default; admin.proto)
        spec.weight = args.weight
    if args.capacity is not None:
        spec.capacity = args.capacity
    if args.credential_env is not None or args.credential_file is not None:
        # one replaces the other
        spec.credential_env, spec.credential_file = (
            args.credential_env or "",
            args.credential_file or "",
        )
    spec.continuation = args.continuation or spec.continuation or "on"
    # A path turns probing on (one is for probing); probing off forgets the
    # path (there is nothing to probe): each replaces the other, as the two
    # credential flags do. Both at once is the control plane's error to give.
    if args.probe_path is not None:
        spec.probe_path, spec.probe = args.probe_path, "on"
    if args.probe is not None:
        spec.probe = args.probe
        if args.probe == "off" and args.probe_path is None:
            spec.probe_path = ""
    spec.probe = spec.probe or "on"
    if args.max_tokens_field is not None:
        # The default as "": the form the control plane answers it in, so
        # that _not_saved can tell it from a field an older one dropped.
        spec.max_tokens_field = table_token_field(args.max_tokens_field)
    return spec


def _as_spec(o: pb.Origin) -> apb.OriginSpec:
    """An origin's settings, as `origin add` gives them."""
    return apb.OriginSpec(
        name=o.name,
        base_url=o.base_url,
        region=o.region,
        models=list(o.models),
        weight=o.weight,
        capacity=o.capacity,
        credential_env=o.credential_env,
        credential_file=o.credential_file,
        continuation="off" if o.no_continuation else "on",
        probe_path=o.probe_path,
        probe="off" if o.not_probed else "on",
        model_names=dict(o.model_names),
        max_tokens_field=o.max_tokens_field,
    )


def _origin_changes(before: pb.Origin, after: pb.Origin) -> list[str]:
    """What an update changed, as `tenant set` says it: `field old -> new`."""

    def shown(o: pb.Origin) -> dict[str, str]:
        return {
            "url": o.base_url,
            "region": o.region,
            "models": _served_as(o),
            "weight": str(o.weight),
            "capacity": str(o.capacity or "unknown"),
            "credential_env": o.credential_env or "-",
            "credential_file": o.credential_file or "-",
            "continuation": "off" if o.no_continuation else "on",
            "probe": _probe(o),
            "max_tokens_field": o.max_tokens_field or "max_tokens",
        }

    return _changes(shown(before), shown(after))


def _probe(o: pb.Origin) -> str:
    """How the control plane probes an origin: "off", or the path it sets
    ("default": the control plane's --probe-path)."""
    return "off" if o.not_probed else o.probe_path or "default"


def _not_saved(asked: Message, got: Message, blank: Message, path: str = "") -> list[str]:
    """The fields that `asked` sets and `got` lacks, nested ones named
    `part.field`, in the order of their numbers. `got` is the control
    plane's answer in `asked`'s type, and `blank` an empty answer in that
    type: a field is lacking when `got` holds it as `blank` does. That is
    what a control plane older than the field answers: protobuf parses what
    it does not know, and its records keep only what it knows (trial 69:
    `limit set --tokens-per-day` and `origin add --probe off` said done, and
    nothing was saved). A field answered otherwise, but not empty, is the
    control plane's normal form of it (a default filled in, a list sorted),
    not a loss. A field asked empty is never named: it cannot be told from
    one dropped, and a control plane without the field has it empty anyway."""
    missing = []
    for field, value in asked.ListFields():
        name = path + field.name
        held, empty = getattr(got, field.name), getattr(blank, field.name)
        if field.message_type is not None and not field.is_repeated:
            missing += _not_saved(value, held, empty, f"{name}.")
        elif value != held and held == empty:
            missing.append(name)
    return missing


NOT_SAVED = "(the control plane does not support it; upgrade every replica)"


class Shown(str):
    """What a command prints on stdout, and `not_saved`: the fields it
    asked the control plane to save that its answer lacks (_not_saved), each
    an `error: NOT SAVED: ...` line on stderr after it, and exit code 1: the
    command did not do all it was asked. The output says what the answer
    holds, never what was sent."""

    not_saved: tuple[str, ...]

    def __new__(cls, text: str, not_saved: Sequence[str] = ()) -> Self:
        made = super().__new__(cls, text)
        made.not_saved = tuple(not_saved)
        return made


# How long `key create` waits for the proxies to take the new key (trial 48:
# a key used as soon as the command returned was refused for 0.13 s), and how
# often it asks. A key is usable at once on the proxies that have it.
KEY_WAIT_S = 3.0
KEY_WAIT_EVERY_S = 0.05


def _not_taken(
    stub: Any,
    revision: int,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """The proxies that have not ACKed a route table of `revision` or later
    (one that holds what was saved then) within KEY_WAIT_S; [] at once for a
    revision of 0 (a control plane that does not say it)."""
    if not revision:
        return []
    deadline = clock() + KEY_WAIT_S
    while True:
        listed = stub.ListProxies(apb.ListRequest()).proxies
        behind = sorted(p.info.name for p in listed if p.acked_version < revision)
        if not behind or clock() >= deadline:
            return behind
        sleep(KEY_WAIT_EVERY_S)


# A tenant's stream idle timeout under this is noted as likely to cut streams.
SHORT_IDLE_S = 1.0


def run(args: argparse.Namespace, stub: Any) -> str:
    """Perform one command; return what to print. Raises grpc.RpcError on refusal."""
    if args.command == "region" and args.action == "add":

        def put_region() -> tuple[pb.Region | None, apb.RegionSpec, pb.Region]:
            current = None
            if args.update:
                listed = stub.ListRegions(apb.ListRequest()).regions
                current = next((r for r in listed if r.name == args.name), None)
            spec = _region_spec(args, current)
            region_of(spec).validated()
            # Saved only if no other change came since `current` was read.
            expected = _region_as_spec(current) if current is not None else None
            if current is not None and spec == expected:
                return current, spec, current  # nothing to write (trial 54: audited anyway)
            request = apb.PutRegionRequest(region=spec, allow_update=args.update, expected=expected)
            return current, spec, stub.PutRegion(request)

        was, asked_region, r = _read_and_write(put_region)
        lost = _not_saved(asked_region, _region_as_spec(r), _region_as_spec(pb.Region()))
        saved = f"region {r.name} ({r.latitude:g}, {r.longitude:g}) saved"
        if was is None:
            return Shown(saved, lost)
        changed = _region_changes(was, r)
        return Shown(
            f"{saved}; " + (f"changed: {'; '.join(changed)}" if changed else "unchanged"), lost
        )
    if args.command == "region" and args.action == "delete":
        stub.DeleteRegion(apb.DeleteRequest(name=args.name))
        return f"region {args.name} deleted"
    if args.command == "origin" and args.action == "add":

        def put_origin() -> tuple[pb.Origin | None, apb.OriginSpec, pb.Origin]:
            current = None
            if args.update:
                listed = stub.ListOrigins(apb.ListRequest()).origins
                current = next((o for o in listed if o.name == args.name), None)
            ospec = _origin_spec(args, current)
            origin_of(ospec).validated()
            # Saved only if no other change came since `current` was read.
            expected = _as_spec(current) if current is not None else None
            if current is not None and ospec == expected:
                return current, ospec, current  # nothing to write (trial 54: audited anyway)
            request = apb.PutOriginRequest(
                origin=ospec, allow_update=args.update, expected=expected
            )
            return current, ospec, stub.PutOrigin(request)

        read, asked_origin, o = _read_and_write(put_origin)
        # Trial 69: `--update --probe off` against a control plane older
        # than probe settings said "unchanged" and exited 0.
        lost = _not_saved(asked_origin, _as_spec(o), _as_spec(pb.Origin()))
        parts = [", ".join(o.models), f"weight {o.weight}"]
        # Trial 95: `--capacity 4` was said nowhere but in `get origins`' INFLIGHT.
        if o.capacity:
            parts.append(f"capacity {o.capacity}")
        # As `get origins` shows it: only when not the default (an origin
        # added with --max-tokens-field said nothing of it).
        if o.max_tokens_field:
            parts.append(f"max tokens as {o.max_tokens_field}")
        saved = f"origin {o.name} in {o.region} saved ({'; '.join(parts)})"
        if read is None:
            return Shown(saved, lost)
        changed = _origin_changes(read, o)
        return Shown(
            f"{saved}; " + (f"changed: {'; '.join(changed)}" if changed else "unchanged"), lost
        )
    if args.command == "origin" and args.action == "delete":
        stub.DeleteOrigin(apb.DeleteRequest(name=args.name))
        return f"origin {args.name} deleted"
    if args.command == "tenant":
        if args.action == "add":
            stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name=args.name)))
            return f"tenant {args.name} added"
        if args.action == "delete":
            stub.DeleteTenant(apb.DeleteRequest(name=args.name))
            return f"tenant {args.name} deleted"
        if not _tenant_flags_given(args):
            raise UsageError("give a setting to change (pontoctl tenant set --help)")

        def set_tenant() -> tuple[pb.Tenant, apb.UpdateTenantRequest, pb.Tenant | None]:
            tenants = stub.ListTenants(apb.ListRequest()).tenants
            current = next((t for t in tenants if t.name == args.name), pb.Tenant(name=args.name))
            update = _tenant_update(args, current)
            known = any(t.name == args.name for t in tenants)
            if known and [f.name for f, _ in update.ListFields()] == ["name"]:
                return current, update, None
            merged = _merged(current, update)
            # As the control plane checks it: a prompt kept as stored is not refused.
            merged.validated(stored=merged.prompt.system_prompt == current.prompt.system_prompt)
            # Saved only if no other change came since `current` was read:
            # `update` carries whole parts of it (every alias, every limit).
            update.expected.CopyFrom(current)
            return current, update, stub.UpdateTenant(update)

        current, update, saved_tenant = _read_and_write(set_tenant)
        if saved_tenant is None:
            return f"tenant {args.name} unchanged: it already has these settings"
        t = saved_tenant
        # The whole routing policy, as `get tenants` shows it: a change of one
        # model's mode, the load bound or user sessions is seen in it too.
        # And its models, when it has a list or this set one.
        listed = update.HasField("models") or bool(t.models.names)
        saved = (
            f"tenant {t.name} saved (cache {t.cache.mode}; routing {_routing_text(t.routing)}"
            + (f"; models {_models_text(t.models.names)})" if listed else ")")
        )
        if update.models.names and not t.models.names:
            # A control plane older than model lists drops the field (review 45).
            saved += (
                " WITHOUT A MODEL LIST: the control plane does not support one; upgrade it "
                "and set it again"
            )
        if t.suspended:
            saved += " SUSPENDED: its callers are refused (403 tenant_suspended)"
            if t.suspended_reason:
                saved += f" ({escape_hidden(t.suspended_reason)})"
        elif update.HasField("suspended") and update.suspended:
            # An older control plane drops the field, as it drops model lists.
            saved += (
                " NOT SUSPENDED: the control plane does not support suspension; upgrade it "
                "and set it again"
            )
        idle = t.streams.stream_idle_timeout_s
        if 0 < idle < SHORT_IDLE_S and args.stream_idle_timeout is not None:
            # A note, not a refusal: stored tenants are validated as they are
            # read, and one refused there would be dropped (trial 45: 0.001 s
            # was saved, and every stream then failed with a 502).
            saved += (
                f"\n  note: a stream idle timeout of {idle:g} s ends every stream whose origin "
                "is silent that long, before its first chunk too (a model's first token "
                "often takes seconds): streams may fail with 502 or be cut"
            )
        # What changed, as the audit trail says it (trial 35: the line above
        # did not say that --max-tokens took, or from what).
        with contextlib.suppress(InvalidArgument):  # a record it cannot read: said above
            changes = tenant_changes(tenant_of(current), tenant_of(t))
            if changes:
                saved += f"\n  changed: {changes}"
        return Shown(saved, _not_saved(_asked_tenant(update), t, pb.Tenant()))
    if args.command == "key":
        if args.action == "create":
            check_note("key description", args.description)
            create = apb.CreateKeyRequest(
                tenant=args.tenant,
                description=args.description,
                limits=_limits_over(pb.Limits(), args, "the key"),
                # The control plane's clock decides, not this machine's.
                expires_in_s=args.expires_in or 0.0,
                models=args.models,
            )
            resp = stub.CreateKey(create)
            asked_key = apb.ApiKeyInfo(
                tenant=create.tenant,
                description=create.description,
                limits=create.limits,
                models=create.models,
            )
            lost = _not_saved(asked_key, resp.key, apb.ApiKeyInfo())
            if create.expires_in_s and not resp.key.expires_at:
                lost.append("expires_in")
            expiry = f", expiring {utc(resp.key.expires_at)}" if resp.key.expires_at else ""
            if args.expires_in and not resp.key.expires_at:
                # A control plane older than key expiry drops the field.
                expiry = (
                    " WITHOUT AN EXPIRY: the control plane does not support one (upgrade it, "
                    f"then `pontoctl key expire {resp.key.id} --in ...`)"
                )
            naming = f", naming only {', '.join(resp.key.models)}" if resp.key.models else ""
            if args.models and not resp.key.models:
                # So does one older than model lists (review 45).
                naming = (
                    " WITHOUT A MODEL LIST: the control plane does not support one (upgrade "
                    f"it, then `pontoctl key models {resp.key.id} ...`)"
                )
            # The key is saved: nothing here may keep its secret from being
            # printed (helper-191: a failed ListProxies, or a Ctrl-C, did).
            try:
                behind = _not_taken(stub, resp.revision)
            except (grpc.RpcError, KeyboardInterrupt) as exc:
                why = "interrupted" if isinstance(exc, KeyboardInterrupt) else _status_of(exc)
                taken = f"; could not learn whether the proxies have it ({why})"
            else:
                taken = (
                    f"; proxies {', '.join(behind)} have not taken it yet ({KEY_WAIT_S:g} s): "
                    "they refuse it until they do (`pontoctl get proxies`)"
                    if behind
                    else ""
                )
            # The key alone on the last line, so scripts can take `tail -n1`.
            return OnceShown(
                f"key {resp.key.id} created for tenant {resp.key.tenant}{expiry}{naming}{taken}; "
                "it is shown only now, store it safely:\n" + str(resp.secret),
                resp.key.id,
                lost,
            )
        if args.action == "list":
            keys = _list_keys(stub, tenant=args.tenant, include_revoked=not args.active)
            if args.active:
                now = time.time()
                live = [k for k in keys.keys if _key_state(k, now) == "active"]
                # The spend of the keys listed alone, as ListKeys' pages give.
                live_spent = spent_of((k.id for k in live), keys.spent)
                keys = apb.ListKeysResponse(keys=live, spent=live_spent)
            return _render_keys(stub, keys, args.output)
        if args.action == "models":
            # A control plane older than model lists has no such call: UNIMPLEMENTED.
            k = stub.SetKeyModels(apb.SetKeyModelsRequest(id=args.id, models=args.models or []))
            shown = ", ".join(k.models) if k.models else f"those of tenant {k.tenant}"
            return f"key {k.id} of tenant {k.tenant} may name models: {shown}"
        if args.action in ("suspend", "resume"):
            return _suspend(stub, args.id, args.action == "suspend", args.reason)
        if args.action == "expire":
            k = stub.SetKeyExpiry(
                apb.SetKeyExpiryRequest(id=args.id, expires_in_s=args.expires_in or 0.0)
            )
            if not k.expires_at:
                return f"key {k.id} of tenant {k.tenant} no longer expires"
            return f"key {k.id} of tenant {k.tenant} expires {utc(k.expires_at)}"
        return _revoke(stub, args.id)
    if args.command == "limit":
        if all(getattr(args, dest) is None for dest in LIMIT_DESTS):
            raise UsageError(
                "give --rpm, --tpm, --concurrency, --tokens-per-day or --tokens-per-month "
                "(0 removes that limit)"
            )

        # Each saved only if no other change came since its limits were read.
        def key_limits() -> tuple[pb.Limits, pb.Limits, pb.Limits, Sequence[apb.BudgetSpent]]:
            listed = _list_keys(stub, include_revoked=True)
            key = next((k for k in listed.keys if k.id == args.key), None)
            current = key.limits if key is not None else pb.Limits()
            limits = _limits_over(current, args, f"key {args.key!r}")
            if key is not None and limits == current:
                return current, limits, current, listed.spent  # nothing to write
            request = apb.SetKeyLimitsRequest(id=args.key, limits=limits)
            if key is not None:
                request.expected.CopyFrom(current)
            return current, limits, stub.SetKeyLimits(request).limits, listed.spent

        def tenant_limits() -> tuple[pb.Limits, pb.Limits, pb.Limits, Sequence[apb.BudgetSpent]]:
            tenants = stub.ListTenants(apb.ListRequest())
            tenant = next(
                (t for t in tenants.tenants if t.name == args.tenant), pb.Tenant(name=args.tenant)
            )
            current = tenant.limits
            limits = _limits_over(current, args, f"tenant {args.tenant!r}")
            if limits == current and any(t.name == args.tenant for t in tenants.tenants):
                return current, limits, current, tenants.spent  # nothing to write (trial 54)
            request = apb.UpdateTenantRequest(name=args.tenant, limits=limits, expected=tenant)
            return current, limits, stub.UpdateTenant(request).limits, tenants.spent

        if args.key:
            were, asked_limits, limits, spent = _read_and_write(key_limits)
            owner, scope = f"key {args.key}", f"k/{args.key}"
        else:
            were, asked_limits, limits, spent = _read_and_write(tenant_limits)
            owner, scope = f"tenant {args.tenant}", f"t/{args.tenant}"
        # What the answer holds, not what was sent (trial 69: a control plane
        # older than budgets dropped --tokens-per-day, and this said it was set).
        if were == limits:
            said = f"limits of {owner} unchanged: {_limits_text(limits)}"
        else:
            said = f"limits of {owner} set: {_limits_text(limits)} (were: {_limits_text(were)})"
        notes = _budget_notes(limits, next((b for b in spent if b.scope == scope), None))
        return Shown(
            "\n".join([said, *(f"note: {n}" for n in notes)]),
            _not_saved(asked_limits, limits, pb.Limits()),
        )
    if args.command == "fleet":
        adopted = stub.AdoptFleet(apb.AdoptFleetRequest(fleet_id=args.fleet_id))
        if adopted.previous == adopted.fleet_id:
            return f"the fleet id is {adopted.fleet_id} already"
        return (
            f"the fleet id is {adopted.fleet_id} now (was {adopted.previous or 'none'}): "
            "proxies of that fleet take the route tables from the next one on; `get proxies` "
            "shows whether they do"
        )
    if args.command == "cache":
        if not (args.tenant or args.model or args.all):
            raise UsageError("give --tenant, --model, or --all to purge everything")
        if args.all and (args.tenant or args.model):
            raise UsageError("--all purges everything: give it alone, or --tenant/--model")
        resp = stub.PurgeCache(apb.PurgeCacheRequest(tenant=args.tenant, model=args.model))
        scope = (
            " ".join(
                filter(
                    None,
                    [
                        f"tenant {args.tenant}" if args.tenant else "",
                        f"model {args.model}" if args.model else "",
                    ],
                )
            )
            or "everything"
        )
        return f"cache purge of {scope} sent (revision {resp.purge.revision})"
    if args.command == "apply":
        return apply_file(stub, args.file, dry_run=args.dry_run, prune=args.prune)
    if args.command == "export":
        return _dump(_export(stub), args.output)
    if args.command == "get":
        req = apb.ListRequest()
        filters = (args.limit, args.since, args.action or None, args.actor or None)
        if args.kind == "audit":
            if args.action and args.action not in _AUDITED:
                raise UsageError(
                    f"--action {args.action!r} is no audited call; one of: "
                    + ", ".join(sorted(_AUDITED))
                )
            audit = apb.ListAuditRequest(
                limit=args.limit or 0,
                action=args.action,
                actor=args.actor,
                since=time.time() - args.since if args.since else 0.0,
            )
            return render(stub.ListAudit(audit), args.output, _rows_audit, _audit_times)
        if any(f is not None for f in filters):
            raise UsageError("--limit, --since, --action and --actor are filters of `get audit`")
        if args.wide and args.kind != "origins":
            raise UsageError("--wide is of `get origins`")
        if args.kind in ("regions", "origins", "tenants") and args.output != "table":
            # The apply file's representation, so the output is valid `apply -f` input.
            return _dump({args.kind: _export(stub)[args.kind]}, args.output)
        if args.kind == "regions":
            regions = stub.ListRegions(req)
            # One more read, of what `get origins` shows, for SERVING.
            origins = stub.ListOrigins(req).origins
            shown = render(regions, args.output, lambda r: _rows_regions(r, origins))
            return "\n".join([shown, *_region_notes(regions.regions, origins)])
        if args.kind == "origins":
            listed = stub.ListOrigins(req)
            cut = 0 if args.wide else HEALTH_CHARS
            shown = render(listed, args.output, lambda r: _rows_origins(r, cut))
            return "\n".join([shown, *_origin_notes(listed.origins)])
        if args.kind == "tenants":
            tenants = stub.ListTenants(req)
            served = frozenset(m for o in stub.ListOrigins(req).origins for m in o.models)
            # A table only: JSON and YAML are the apply file's (above).
            shown = render(tenants, args.output, lambda r: _rows_tenants(r, served))
            return "\n".join([shown, *_tenant_notes(tenants.tenants, served)])
        if args.kind == "keys":
            keys = _list_keys(stub, include_revoked=True)
            return _render_keys(stub, keys, args.output)
        if args.kind == "proxies":
            return render(stub.ListProxies(req), args.output, _rows_proxies)
        if args.kind == "controlplanes":
            return render(stub.ListControlPlanes(req), args.output, _rows_replicas)
        return render(stub.GetRouteTable(req), args.output, _table_summary)
    if args.command in ("drain", "undrain"):
        return _drain(stub, args.kind, args.name, drained=args.command == "drain")
    raise AssertionError(f"unhandled command {args}")


def _drain(stub: Any, kind: str, name: str, *, drained: bool) -> str:
    """Drain or undrain region or origin name (kind); one already so is left
    alone and said to be. The control plane warns of the models a drain
    leaves no origin to serve (their requests then get 503), and of what
    still keeps an undrained one from traffic, changed by this undrain or not."""
    listing = stub.ListRegions if kind == "region" else stub.ListOrigins
    items = listing(apb.ListRequest())
    current = next((x for x in getattr(items, f"{kind}s") if x.name == name), None)
    request = apb.DrainRequest(name=name, drained=drained)
    call = stub.DrainRegion if kind == "region" else stub.DrainOrigin
    if current is not None and current.drained == drained:
        # Unknown names go on to the call, whose NOT_FOUND says so. An undrain
        # that changes nothing is asked as a dry run (no write, so it cannot
        # undo a drain made since the listing, and no audit entry): its
        # warnings say why what is not drained may get no traffic.
        if not drained:
            call(apb.DrainRequest(name=name, drained=False, dry_run=True))
        state = "already drained" if drained else "not drained"
        return f"{kind} {name} is {state}: nothing changed"
    call(request)
    return f"{kind} {name} {'drained' if drained else 'undrained'}"


def _revoke(stub: Any, key_id: str) -> str:
    """Revoke key `key_id`; one already revoked is left alone and said to be,
    as `_drain` says a region already drained is. The key is read first: the
    control plane's revoke of a revoked key changes nothing and answers as
    if it had (and would record a revoke in the audit log). An unknown id
    goes on to the call, whose NOT_FOUND says so."""
    listed = _list_keys(stub, include_revoked=True)
    current = next((k for k in listed.keys if k.id == key_id), None)
    if current is not None and current.revoked:
        return f"key {key_id} of tenant {current.tenant} was already revoked: nothing changed"
    k = stub.RevokeKey(apb.KeyRequest(id=key_id))
    return f"key {k.id} of tenant {k.tenant} revoked"


def _suspend(stub: Any, key_id: str, suspended: bool, reason: str | None = None) -> str:
    """Suspend or resume key `key_id`, saying what the proxies do now. A
    control plane older than suspension has no such call: UNIMPLEMENTED; one
    older than reasons drops a suspension's reason (NOT SAVED: reason).
    `reason` None: not given (a suspended key keeps its own); "": none."""
    if reason is not None:
        reason = reason.strip()  # as stored: one of spaces is none
    before = _list_keys(stub, include_revoked=True)
    current = next((k for k in before.keys if k.id == key_id), None)
    asked = apb.SetKeySuspendedRequest(id=key_id, suspended=suspended, reason=reason)
    k = stub.SetKeySuspended(asked)
    # Dropped, or (an older control plane) a clear not applied.
    lost = ("reason",) if suspended and reason is not None and k.suspended_reason != reason else ()
    if current is not None and current.suspended == suspended:
        if suspended and reason is not None and current.suspended_reason != k.suspended_reason:
            now = f"now {escape_hidden(reason)!r}" if reason else "cleared"
            return Shown(f"key {k.id} of tenant {k.tenant} was suspended: reason {now}")
        if suspended:
            return Shown(
                f"key {k.id} of tenant {k.tenant} was already suspended: nothing changed", lost
            )
        return f"key {k.id} of tenant {k.tenant} was not suspended: nothing changed"
    if suspended:
        because = f" ({escape_hidden(k.suspended_reason)})" if k.suspended_reason else ""
        return Shown(
            f"key {k.id} of tenant {k.tenant} suspended{because}: proxies refuse its callers "
            f"(403 api_key_suspended) once they take the next table; `pontoctl key resume "
            f"{k.id}` serves them again",
            lost,
        )
    if key_expired(k.expires_at, time.time()):
        return (
            f"key {k.id} of tenant {k.tenant} resumed, but it expired {utc(k.expires_at)}: "
            f"proxies refuse it as expired (`pontoctl key expire {k.id} --in ...` or --never)"
        )
    tenant = next(
        (t for t in stub.ListTenants(apb.ListRequest()).tenants if t.name == k.tenant), None
    )
    if tenant is not None and tenant.suspended:
        # Trial 70: "resumed", exit 0, and its callers still refused.
        return (
            f"key {k.id} of tenant {k.tenant} resumed, but its tenant is suspended: proxies "
            f"refuse its callers (403 tenant_suspended) until `pontoctl tenant set {k.tenant} "
            "--suspended off`"
        )
    return f"key {k.id} of tenant {k.tenant} resumed"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a refused command line (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        options = conn.ClientOptions.from_args(args)
        # A key not the certificate's, or a certificate out of its dates, said
        # as such: the control plane's refusal would blame the CA.
        options.check_files(datetime.datetime.now(datetime.UTC))
        address, channel, cut_off = connect(args.control_plane, options)  # reads the TLS files
    except conn.CredentialError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = conn.CallDefaults(admin_pb2_grpc.AdminStub(channel), TIMEOUT)
        try:
            shown = run(args, stub)
            # What the control plane allowed but warns of, such as an alias to
            # a model no origin serves: on stderr, the exit code stays 0.
            for warning in stub.warnings:
                print(f"warning: {warning}", file=sys.stderr)
        except (UsageError, InvalidArgument) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (KeptChanging, Missing) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:
            # run() only builds messages from the arguments: a ValueError is a
            # number protobuf cannot hold (a negative count, 2**32).
            print(f"error: a value is out of range: {exc}", file=sys.stderr)
            return 2
        except grpc.RpcError as exc:
            return _refused(
                exc, address, options, cut_off, check=_check_with(args), command=_command(args)
            )
    return finish(shown)


def finish(shown: str) -> int:
    """Write a command's output (`write`), then, on stderr, each field it
    asked for that the control plane did not save (Shown.not_saved); the
    exit code: 1 if any was not, else write's."""
    written = write(shown)
    not_saved = shown.not_saved if isinstance(shown, Shown) else ()
    for field in not_saved:
        print(f"error: NOT SAVED: {field} {NOT_SAVED}", file=sys.stderr)
    return 1 if not_saved else written


def _command(args: argparse.Namespace) -> str:
    """The command line's command, as `pontoctl --help` names it: `key
    models`, `get audit`."""
    # `get audit` has an --action of its own: a get's is its kind.
    if args.command in ("get", "drain", "undrain"):
        return f"{args.command} {args.kind}"
    action = getattr(args, "action", None)
    return f"{args.command} {action}" if action else str(args.command)


def _check_with(args: argparse.Namespace) -> str | None:
    """The command that shows what `args`' command changes, to run before
    running it again when its outcome is unknown; None for a command that
    changes nothing."""
    command, action = args.command, getattr(args, "action", "")
    if command in ("get", "export") or (command, action) == ("key", "list"):
        return None
    if command in ("drain", "undrain"):
        return f"pontoctl get {args.kind}s"
    if command in ("region", "origin", "tenant"):
        return f"pontoctl get {command}s"
    if command == "key" or (command == "limit" and args.key):
        return "pontoctl get keys"
    if command == "limit":
        return "pontoctl get tenants"
    if command == "apply":
        return "pontoctl export"
    return ""  # a purge, an adoption: doing it again does no harm


class OnceShown(Shown):
    """Output holding a secret the control plane gives only once (key
    create's), and the id of its key, which `write` names if it is lost."""

    key_id: str

    def __new__(cls, text: str, key_id: str, not_saved: Sequence[str] = ()) -> Self:
        made = super().__new__(cls, text, not_saved)
        made.key_id = key_id
        return made


def write(shown: str) -> int:
    """Print shown on stdout; the exit code: 0, or 1 when it could not be
    written, with no traceback (and none at exit, when Python flushes stdout
    again). A reader that left (`pontoctl get audit | head`, EPIPE) is not
    told of; any other failure (a full disk, ENOSPC) is one line on stderr.
    The command's change, if any, is made either way; a lost secret
    (OnceShown) is said to be, with its key, which is of no use without it."""
    try:
        print(shown, flush=True)
    except OSError as exc:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        why = exc.strerror or str(exc)
        if isinstance(shown, OnceShown):
            print(
                f"error: key {shown.key_id} was created, but its secret could not be written "
                f"({why}) and cannot be shown again: revoke the key (`pontoctl key revoke "
                f"{shown.key_id}`) and create another",
                file=sys.stderr,
            )
        elif not isinstance(exc, BrokenPipeError):
            print(f"error: cannot write output: {why}", file=sys.stderr)
        return 1
    return 0


# How long a replica of several may take to connect (TLS included) before the
# next is tried; one that refuses the connection is passed over at once.
CONNECT_TIMEOUT = 3.0


def connect(
    addresses: Sequence[str], options: conn.ClientOptions, timeout: float = CONNECT_TIMEOUT
) -> tuple[str, grpc.Channel, list[str]]:
    """The first of addresses whose channel connects within timeout, that
    channel, and those passed over because they cannot reach their state
    store; the last address is returned unprobed, so that its failure is the
    call's own and gets `unreachable`'s advice. Each one passed over is a
    `warning:` line on stderr.

    The choice is made before any call, and every call of the command then goes
    to that replica: a write is never sent twice (any replica serves the Admin
    API, all over the same etcd).
    """
    cut_off: list[str] = []
    for address in addresses[:-1]:
        channel = conn.admin_channel(address, options)
        state = _connects(channel, timeout)
        if state is grpc.ChannelConnectivity.READY:
            if _reaches_store(channel):
                return address, channel, cut_off
            # Trial 17: a replica cut off from etcd answered every call with
            # "state store unavailable", the others not tried.
            why = "it cannot reach its state store (etcd)"
            cut_off.append(address)
        else:
            # A refused connection, a name that does not resolve, or a TLS
            # handshake that failed (a certificate the CA did not sign: a
            # misconfiguration, or someone in between), in gRPC's words.
            why = (
                f"no connection within {timeout:g} s"
                if state is None
                else _failure(conn.admin_channel(address, dataclasses.replace(options, token="")))
            )
        channel.close()
        print(
            f"warning: cannot use the control plane at {address}: {why}; trying the next",
            file=sys.stderr,
        )
    return addresses[-1], conn.admin_channel(addresses[-1], options), cut_off


def _reaches_store(channel: grpc.Channel) -> bool:
    """Whether the replica on channel says it reads its state store (its
    gRPC health `ponto.store`, see controlplane.readiness); True when it does
    not say (no answer in a second, or no such check): its calls will."""
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    try:
        said = check(health_pb2.HealthCheckRequest(service=STORE), timeout=1.0)
    except grpc.RpcError:
        return True
    return bool(said.status != health_pb2.HealthCheckResponse.NOT_SERVING)


def _connects(channel: grpc.Channel, timeout: float) -> grpc.ChannelConnectivity | None:
    """READY, or the failure state, as soon as channel settles; None when it
    did neither within timeout."""
    settled = threading.Event()
    state: grpc.ChannelConnectivity | None = None

    def watch(now: grpc.ChannelConnectivity) -> None:
        nonlocal state
        if now in (
            grpc.ChannelConnectivity.READY,
            grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN,
        ):
            state = now
            settled.set()

    channel.subscribe(watch, try_to_connect=True)
    try:
        settled.wait(timeout)
    finally:
        channel.unsubscribe(watch)
    return state


def _failure(channel: grpc.Channel) -> str:
    """Why channel (one without the admin token: the caller's) failed to
    connect, as gRPC tells a call on it: the standard health check, so that
    nothing of the operator's leaves for an address that could not be
    trusted. Closes channel."""
    check: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
        "/grpc.health.v1.Health/Check"
    )
    try:
        check(b"", timeout=1.0)
    except grpc.RpcError as exc:
        return _status_of(exc)
    finally:
        channel.close()
    return "it connected only after failing once"


def _status_of(exc: grpc.RpcError) -> str:
    """A refused call's code and details, in one line."""
    code = getattr(exc, "code", lambda: None)()
    details = getattr(exc, "details", lambda: "")()
    return " ".join(str(part) for part in (getattr(code, "name", code), details) if part)


def _refused(
    exc: grpc.RpcError,
    address: str,
    options: conn.ClientOptions,
    cut_off: Sequence[str] = (),
    *,
    check: str | None = None,
    command: str = "",
) -> int:
    """Print the control plane's refusal on one line; return the exit code.
    `cut_off`: the replicas passed over as unable to reach their state store.
    `check`: what shows the command's change (_check_with), None for a
    command that changes nothing: a change with no answer may have been made,
    and is said to be, with what to run before running it again (the call is
    never sent again by pontoctl, to this replica or another). `command`:
    the command (_command), which an UNIMPLEMENTED names: the control plane
    is older than it (trial 69: `key models` said `Method not found!`)."""
    code: grpc.StatusCode | None = getattr(exc, "code", lambda: None)()
    detail: str = getattr(exc, "details", lambda: "")() or str(code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        print(f"error: {detail}", file=sys.stderr)
        return 2
    if code == grpc.StatusCode.UNAVAILABLE and "state store" not in detail:
        detail = linkadvice.unreachable(detail, address, options)
        if cut_off:
            # Trial 43: the last replica's failure (it was stopped) was the
            # error, though the cause of it all was etcd, which none reached.
            detail += (
                f"; and the replicas before it ({', '.join(cut_off)}) cannot reach their "
                "state store: is etcd down?"
            )
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        if "not this control plane's" in detail:
            detail += f"; check the admin token in {options.token_source or 'use'}"
        else:
            detail += "; give the admin token with --admin-token-file (or PONTO_ADMIN_TOKEN_FILE)"
    elif code == grpc.StatusCode.UNIMPLEMENTED and "unknown service" in detail:
        # No Admin API at all (review: etcd's port, or a proxy's, was read
        # as an older control plane).
        detail = (
            f"{address} does not serve Ponto's Admin API ({detail}): is it the control "
            "plane's gRPC port (not etcd's, not a proxy's)?"
        )
    elif code == grpc.StatusCode.UNIMPLEMENTED:
        # A call this pontoctl knows and the replica's Admin API does not: a
        # replica older than the command (one call of a rolling upgrade may
        # reach an old replica, the next a new one).
        detail = (
            f"the control plane at {address} is older than "
            + (f"`pontoctl {command}`" if command else "this command")
            + f" ({detail}): upgrade every replica to use it"
        )
    elif code == grpc.StatusCode.PERMISSION_DENIED and "Admin API" not in detail:
        detail += "; this credential may not use the Admin API"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and MAY_HAVE_BEEN_MADE in detail:
        # The control plane's: its state store did not confirm the write.
        if check:
            detail = detail.replace("`pontoctl get`", f"`{check}`")
        elif check == "":
            detail = detail.replace(CHECK_FIRST, "running it again does no harm")
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        detail = f"control plane at {address} did not answer within {TIMEOUT:g} s"
        if check:
            detail += f": {MAY_HAVE_BEEN_MADE}; check with `{check}` before running it again"
        elif check == "":
            detail += f": {MAY_HAVE_BEEN_MADE}; running it again does no harm"
    name = code.name if code is not None else "UNKNOWN"
    print(f"error: {detail} [{name}]", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
