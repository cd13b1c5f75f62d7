"""Desired state of the fleet: frozen values with validation and JSON codecs.

Values are stored in etcd as JSON objects (one key each) so that operators can
read them with etcdctl; unknown fields in stored JSON are ignored when read, so
a newer control plane can add fields without breaking an older replica, and
kept when a record is written again (`encode_over`), so that this replica does
not erase them.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import re
import types
import typing
import unicodedata
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

import orjson

from controlplane.errors import InvalidArgument
from dataplane.assemble import RESPONSES_TOKEN_FIELDS, TOKEN_FIELDS, table_token_field
from dataplane.http.fields import check_default

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
# An origin's own name for a model (Origin.model_names), in UTF-8 bytes.
MAX_OWN_MODEL_NAME_BYTES = 256
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,254}\Z")
# What MODEL_RE takes, said with every refusal of a model name (trial 66: a
# llama.cpp server's default id, its model file's path, was refused without it).
MODEL_RULE = "use 1-255 letters, digits and . _ : / @ + -, starting with a letter or digit"


def model_invalid(refusal: str, model: str) -> str:
    """`refusal` of `model` with the rule; a path also gets how to name it."""
    hint = (
        " (a file path, as llama.cpp's server names its model by default: start it with "
        "--alias NAME and list that name)"
        if model.startswith(("/", "."))
        else ""
    )
    return f"{refusal}: {MODEL_RULE}{hint}"


ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
# An origin's probe path: absolute, of URL path and query characters only
# (RFC 3986 pchar, "/" and "?"), so that it is sent as written and cannot
# name another host or carry a fragment.
PROBE_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]{0,255}\Z")
PARAM_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}\Z")
CACHE_MODES = ("off", "exact", "semantic")
ROUTING_MODES = ("affinity", "least-loaded", "weighted")
MAX_CONTINUATIONS = 10
MAX_IDLE_TIMEOUT_S = 3600.0
MAX_HEDGE_MS = 600_000
JWT_ALGORITHMS = ("HS256", "RS256", "ES256")
# A token valid for longer than its issuer's maximum is refused (a leaked
# long-lived token is a standing credential). 24 h unless the tenant says;
# at most a year.
JWT_DEFAULT_MAX_LIFETIME_S = 86_400.0
JWT_LONGEST_MAX_LIFETIME_S = 31_536_000
# Request fields a tenant's defaults may not set: they carry the request itself.
NOT_DEFAULTABLE = frozenset({"model", "messages", "prompt", "input", "stream"})
MAX_TTL_S = 30 * 86_400
# A bound at or past one wrong hit in two is no bound.
MAX_SEMANTIC_ERROR = 0.5
MAX_CONCURRENCY = 2**32 - 1  # a uint32 in the route table
MAX_RATE = 10**12  # rpm and tpm
MAX_TOKENS_CEILING = 10**7
MAX_SYSTEM_PROMPT = 64 * 1024
# The controls (Unicode category Cc) a system prompt may hold: it is text sent
# as the first message of every request, where a tab or a line break is prose,
# and any other control (a NUL, an ANSI escape, a DEL) a mistake the model
# would get in every request (trial 52: `--system-prompt $'a\x01b'` was saved).
PROMPT_CONTROLS = frozenset("\t\n\r")
# Models one tenant or key may be limited to (ModelAccess).
MAX_ACCESS_MODELS = 1000
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


# What a one-line note (a key's description) may not hold, as a terminal
# would not show it as itself: controls (a newline splits a table's row, an
# ANSI escape recolours the operator's terminal), line and paragraph
# separators, and the bidi embeddings, overrides and isolates, which reorder
# what follows them. Other format characters are ordinary text: the joiners
# of emoji sequences and Indic scripts, the direction marks of mixed
# right-to-left text (LRM, RLM, ALM), the tags of subdivision flags, a soft
# hyphen (review 39).
HIDDEN_CATEGORIES = frozenset({"Cc", "Zl", "Zp"})
_REORDERING = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def is_hidden(char: str) -> bool:
    """Whether char (one character) is one a terminal would not show as itself
    (HIDDEN_CATEGORIES, or a bidi embedding, override or isolate); pure."""
    return char in _REORDERING or unicodedata.category(char) in HIDDEN_CATEGORIES


# The longest reason a suspension keeps (a key's or a tenant's).
MAX_REASON = 200


def check_reason(what: str, text: str) -> str:
    """text, a suspension's reason: check_note's one printable line, of at
    most MAX_REASON characters; else InvalidArgument naming what. Pure."""
    check_note(what, text)
    if len(text) > MAX_REASON:
        raise InvalidArgument(f"{what} is longer than {MAX_REASON} characters")
    return text


def escape_hidden(text: str) -> str:
    """text with each hidden character (is_hidden) as its Python escape
    (\\n, \\x1b, \\u202e): what a terminal or a check_note shows as itself. Pure."""
    return "".join(ascii(c)[1:-1] if is_hidden(c) else c for c in text)


def readable_reason(text: str) -> str:
    """A stored reason as check_reason takes it: each hidden character as
    its escape, cut to MAX_REASON. Pure."""
    return escape_hidden(text.strip())[:MAX_REASON]


def check_note(what: str, text: str) -> str:
    """text, when it is one line of characters shown as themselves (no
    is_hidden one); else InvalidArgument naming what and the first such
    character, escaped. Pure."""
    for at, char in enumerate(text, 1):
        if is_hidden(char):
            raise InvalidArgument(
                f"{what} holds the hidden character {char!a} (character {at}): "
                "give one line of printable text"
            )
    return text


# The user:password@ part of a URL's authority; its query; its fragment.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")
_QUERY_ON = re.compile(r"([?#]).*$", re.DOTALL)


def redact_userinfo(url: str) -> str:
    """url with any user:password@ shown as ***@, for logs, messages and the audit trail."""
    return _USERINFO.sub(r"\1***@", url)


def redact_url(url: str) -> str:
    """url with its user:password@, its query and its fragment shown as ***
    (`?token=...` is as much a secret as a password, and a base URL has
    neither: one with them is refused, but was kept whole in the audit
    trail and the refusal's message; trial 23)."""
    return _QUERY_ON.sub(r"\1***", redact_userinfo(url))


# A URL inside a longer text (a JSON value, a change's before or after): up
# to a space, a quote, a backslash (a JSON escape) or a bracket, but for the
# brackets of an IPv6 host (http://u:p@[fd00::1]:8000/v1?token=...), whose
# opening one had ended the URL before its query (trial 78: a refused IPv6
# origin's ?api_key= was kept whole in the audit trail). The closing one is
# optional: a URL refused for leaving it out (http://[fd00::1/v1?token=...)
# is recorded too.
_URL_IN_TEXT = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://"
    r"(?:[^\s\"'\\<>{}\[\]/?#]*\[[^\s\"'\\<>{}\[\]]*\]?)?"
    r"[^\s\"'\\<>{}\[\]]*"
)


def redact_urls(text: str) -> str:
    """text with each URL in it redacted (redact_url): what the audit trail
    and its log lines keep of a value that may hold one (a tenant's JWKS URL,
    an origin's, in a block shown whole; review 291)."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


MAX_JWKS_URL_CHARS = 2048


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, bracketed or not, or a name) is this
    machine's alone: what is sent to it crosses no network."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def check_jwks_url(url: str, owner: str) -> None:
    """InvalidArgument unless url can be a JWKS URL: https (http to a loopback
    host), a host, no user:password@, query or fragment (the URL is shown in
    the audit trail, logs and metrics, and no identity provider's has them)."""
    shown = redact_url(url)[:200]
    if len(url) > MAX_JWKS_URL_CHARS:
        raise InvalidArgument(
            f"{owner}: JWKS URL is {len(url)} characters long, over {MAX_JWKS_URL_CHARS}",
            field="jwks_url",
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed IPv6 bracket: "Invalid IPv6 URL"
        raise InvalidArgument(
            f"{owner}: JWKS URL {shown!r} is invalid: {exc}", field="jwks_url"
        ) from None
    try:
        _ = parts.port
    except ValueError:
        raise InvalidArgument(
            f"{owner}: JWKS URL {shown!r} has an invalid port", field="jwks_url"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(
            f"{owner}: JWKS URL {shown!r} is invalid: expected https://host[:port]/path",
            field="jwks_url",
        )
    if any(not "!" <= char <= "~" for char in url):
        raise InvalidArgument(
            f"{owner}: JWKS URL {shown!r} holds a space or a character that is not printable "
            "ASCII (percent-encode it)",
            field="jwks_url",
        )
    if redact_url(url) != url:
        raise InvalidArgument(
            f"{owner}: JWKS URL {shown!r} must not carry user:password@, a query or a fragment",
            field="jwks_url",
        )
    # Over plain http only to the proxy's own machine (an identity provider's
    # sidecar, a test): anywhere else the network between them could swap the
    # keys, and with them sign any token.
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise InvalidArgument(
            f"{owner}: JWKS URL {shown!r} must be https: over http anyone on the path "
            "could replace the keys and sign tokens (http is taken for a loopback host only)",
            field="jwks_url",
        )


def check_url(url: str) -> str:
    """The base URL without a trailing slash. Refused with userinfo: the URL goes into
    every route table, the status page and the audit trail, while a credential has
    its own fields (credential_env, credential_file) that keep it out of etcd."""
    if redact_userinfo(url) != url:
        raise InvalidArgument(
            f"base URL {redact_url(url)!r} must not carry credentials (user:password@): name the "
            "origin's credential with credential_env or credential_file"
        )
    expected = "expected http(s)://host[:port]/path"
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed IPv6 bracket (trial 78: an INTERNAL error)
        raise InvalidArgument(
            f"base URL {redact_url(url)!r} is invalid: {exc}; {expected}"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"base URL {redact_url(url)!r} is invalid: {expected}")
    try:
        _ = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"base URL {redact_url(url)!r} has an invalid port") from exc
    if parts.query or parts.fragment:
        raise InvalidArgument(f"base URL {redact_url(url)!r} must not have a query or fragment")
    path = parts.path.rstrip("/").lower()
    for endpoint in ENDPOINT_PATHS:
        if path.endswith(endpoint):
            raise InvalidArgument(
                f"base URL {redact_url(url)!r} names an endpoint ({endpoint}): give the "
                "base URL an OpenAI SDK is given, which the proxy extends with each "
                "endpoint's path "
                f"(here {url[: len(url.rstrip('/')) - len(endpoint)]!r})"
            )
    return url.rstrip("/")


# The paths the proxy adds to an origin's base URL (dataplane.http.endpoints):
# a base URL that already ends with one would call .../chat/completions/chat/completions.
ENDPOINT_PATHS = (
    "/chat/completions",
    "/completions",
    "/embeddings",
    "/rerank",
    "/responses",
    "/models",
)


def url_warnings(origin: Origin) -> tuple[str, ...]:
    """What is probably wrong with an origin's (checked) base URL, though it may
    be right: one not ending with /v1, where OpenAI-compatible servers (vLLM,
    SGLang, TGI, llama.cpp, hosted APIs) serve; the origin's 404s would look
    like the client's fault."""
    path = urlsplit(origin.base_url).path.rstrip("/")
    if path.endswith("/v1/v1"):  # /v1 written twice: the paths would hold it twice
        return (
            f"origin {origin.name!r}: base URL {origin.base_url!r} ends with /v1/v1; "
            f"requests go to {origin.base_url.rstrip('/') + '/chat/completions'!r} and the like",
        )
    if path.endswith("/v1"):  # as written: servers match paths case-sensitively
        return ()
    return (
        f"origin {origin.name!r}: base URL {origin.base_url!r} does not end with /v1; "
        f"requests go to {origin.base_url.rstrip('/') + '/chat/completions'!r} and the like, "
        "where OpenAI-compatible servers serve /v1/chat/completions",
    )


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
                    f"{label} {value} of region {self.name!r} is out of range [-{bound}, {bound}]",
                    field=label[:3],
                )
        for other, ms in self.rtt_ms:
            try:
                check_name("region", other)
            except InvalidArgument as exc:
                exc.within(f"rtt_ms.{other}")
                raise
            if not math.isfinite(ms) or not 0 <= ms <= 10_000:
                raise InvalidArgument(
                    f"RTT {ms} ms from {self.name!r} to {other!r} is not in 0..10000",
                    field=f"rtt_ms.{other}",
                )
        if not math.isfinite(self.spill_threshold) or not 0 <= self.spill_threshold <= 1:
            raise InvalidArgument(
                f"spill threshold {self.spill_threshold} of region {self.name!r} is not in 0..1",
                field="spill_threshold",
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
    # Where proxies read the upstream credential; never the credential itself.
    credential_env: str = ""
    credential_file: str = ""
    # Accepts continuation requests (vLLM's continue_final_message): on by
    # default, as Ponto's origins are vLLM-compatible unless said otherwise.
    continuation: bool = True
    # Where the leader probes the origin's health, from the root of its URL
    # ("": the fleet's --probe-path), for servers without vLLM's /health
    # (Ollama answers at /, LiteLLM at /health/liveliness).
    probe_path: str = ""
    # False: the leader never probes it (a hosted API that answers no
    # unauthenticated path): it counts as healthy in every table, and the
    # proxies' passive health (ejection) alone judges it.
    probe: bool = True
    # (public model name, the origin's own name for it), sorted by public
    # name: what the proxies put in the `model` of a request they send it
    # (an Ollama tag, an Azure OpenAI deployment); a model not named here is
    # sent under its public name. Pairs rather than a dict: frozen, hashable.
    model_names: tuple[tuple[str, str], ...] = ()
    # The field (one of TOKEN_FIELDS) the proxies send it a max_tokens in
    # when they add one (a tenant's ceiling or default) to a chat request
    # that named no limit: OpenAI's reasoning models refuse max_tokens,
    # Ollama reads only it. A field the client sent is never renamed.
    max_tokens_field: str = "max_tokens"

    @property
    def table_token_field(self) -> str:
        """max_tokens_field as route tables and the admin API carry it: ""
        for the default, which a table without the field means too."""
        return table_token_field(self.max_tokens_field)

    def validated(self) -> Origin:
        check_name("origin", self.name)
        try:
            check_name("region", self.region)
        except InvalidArgument as exc:
            exc.within("region")
            raise
        try:
            url = check_url(self.base_url)
        except InvalidArgument as exc:
            exc.within("url")
            raise
        if not self.models:
            raise InvalidArgument(
                f"origin {self.name!r} must serve at least one model", field="models"
            )
        for model in self.models:
            if not MODEL_RE.match(model):
                raise InvalidArgument(
                    model_invalid(
                        f"model name {model!r} of origin {self.name!r} is invalid", model
                    ),
                    field="models",
                )
        if len(set(self.models)) != len(self.models):
            raise InvalidArgument(f"origin {self.name!r} lists a model twice", field="models")
        weight = self.weight or DEFAULT_WEIGHT
        if not 1 <= weight <= MAX_WEIGHT:
            raise InvalidArgument(
                f"weight {weight} of origin {self.name!r} is not in 1..{MAX_WEIGHT}",
                field="weight",
            )
        if not 0 <= self.capacity <= MAX_CAPACITY:
            raise InvalidArgument(
                f"capacity {self.capacity} of origin {self.name!r} is not in 0..{MAX_CAPACITY}",
                field="capacity",
            )
        if self.credential_env and self.credential_file:
            raise InvalidArgument(
                f"origin {self.name!r}: give credential_env or credential_file, not both"
            )
        if self.credential_env and not ENV_RE.match(self.credential_env):
            raise InvalidArgument(
                f"credential_env {self.credential_env!r} of origin {self.name!r} is not an "
                "environment variable name",
                field="credential_env",
            )
        if self.credential_file and not self.credential_file.startswith("/"):
            raise InvalidArgument(
                f"credential_file {self.credential_file!r} of origin {self.name!r} must be "
                "an absolute path",
                field="credential_file",
            )
        if self.probe_path and not PROBE_PATH_RE.match(self.probe_path):
            raise InvalidArgument(
                f"probe path {self.probe_path!r} of origin {self.name!r} is not an absolute "
                "path from the origin's root (e.g. /health, /api/version), of at most 256 "
                "URL path characters",
                field="probe_path",
            )
        if self.probe_path and not self.probe:
            raise InvalidArgument(
                f"origin {self.name!r}: a probe path with probing off (give one or the other)",
                field="probe_path",
            )
        if self.max_tokens_field not in TOKEN_FIELDS:
            raise InvalidArgument(
                f"max_tokens_field {self.max_tokens_field!r} of origin {self.name!r} is not "
                f"one of {', '.join(TOKEN_FIELDS)}",
                field="max_tokens_field",
            )
        served = set(self.models)
        names = dict(self.model_names)
        if len(names) != len(self.model_names):
            raise InvalidArgument(
                f"origin {self.name!r} gives a model two own names", field="model_names"
            )
        for public, own in names.items():
            if public not in served:
                raise InvalidArgument(
                    f"model_names of origin {self.name!r} names {public!r}, which is not among "
                    f"its models ({', '.join(sorted(served))}): add it to its models, or map "
                    "one of those",
                    field=f"model_names.{public}",
                )
            problem = own_model_name_problem(own)
            if problem:
                raise InvalidArgument(
                    f"origin {self.name!r}: its own name for model {public!r} {problem}",
                    field=f"model_names.{public}",
                )
        return replace(
            self,
            base_url=url,
            weight=weight,
            models=tuple(sorted(self.models)),
            model_names=tuple(sorted(names.items())),
        )


def own_model_name_problem(name: str) -> str:
    """What is wrong with `name` as an origin's own name for a model, "" when
    nothing is. Looser than MODEL_RE on purpose: clients never send it, and
    origins' names are not ours to choose (an Azure deployment, a llama.cpp
    model file's path). Only what cannot go into a JSON string a server reads
    as a name is refused."""
    if not name:
        return "is empty"
    if len(name.encode()) > MAX_OWN_MODEL_NAME_BYTES:
        return f"is over {MAX_OWN_MODEL_NAME_BYTES} bytes"
    if any(ch < " " or "\x7f" <= ch <= "\x9f" for ch in name):
        return f"{name!r} holds a control character"
    return ""


@dataclass(frozen=True, slots=True)
class ProxyRecord:
    name: str
    region: str
    address: str
    version: str
    session_id: str
    control_plane_id: str
    connected_at: float
    # When the proxy's process started (Unix time; 0: it did not say): of two
    # processes of one name, the later one keeps the registration.
    started_at: float = 0.0
    # When its counters were 0 (its start), by its replica's clock: the
    # registration less the process's age then, by the proxy's own clock,
    # so neither clock's skew counts (0: not known).
    counting_from: float = 0.0
    # The host its registration came from (the gRPC peer's address, without
    # its port; "": unknown), which tells two proxies given one --name and
    # one --advertise apart from a group's workers.
    host: str = ""
    acked_version: int = 0
    last_error: str = ""
    # What it last said, with an ACK or a report, it cannot use of the table
    # it serves (a tenant whose JWT config it could not load), each a sentence
    # for operators.
    warnings: tuple[str, ...] = ()
    # The latest version of its replica (from that replica's ACK summary).
    replica_version: int = 0
    # The etag (a hash of the content) of that table ("": not known), which
    # any replica gives the same content: tells a replica behind another.
    replica_etag: str = ""
    # The address of another process refused this name lately, started
    # before this one: two proxies given one --name, the other serving its
    # last table unseen ("": none).
    conflict: str = ""
    # Cumulative counters of its last report (requests answered, 5xx, 4xx) and
    # when its replica last heard from it (Unix time; 0: not yet).
    requests: int = 0
    server_errors: int = 0
    client_errors: int = 0
    heard_at: float = 0.0
    # Of its last report too: (region, requests, errors) of the proxied
    # requests each region served for it, and (tenant, requests refused by a
    # rate limit, requests that waited for a concurrency slot).
    served: tuple[tuple[str, int, int], ...] = ()
    limited: tuple[tuple[str, int, int], ...] = ()
    # And the origins its passive health ejected, by name.
    ejected: tuple[OriginEjected, ...] = ()
    # What it enforces of the table among the settings only some builds know
    # (ponto/features.py); () from a build older than the list.
    features: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class OriginEjected:
    """An origin a proxy reported it ejected since the origin last answered
    (RouteRequest.ejected), in its replica's Unix time."""

    origin: str
    since: float  # its first ejection after its last answer
    ejections: int
    last_failure: str
    failed_at: float
    until: float  # the current ejection's end (not after failed_at: ended)


@dataclass(frozen=True, slots=True)
class OriginHealth:
    """What the leader's probes last saw of an origin."""

    origin: str
    healthy: bool
    # Running + waiting requests as read when the record was written (a flip
    # of health, a new server kind), not kept current: nothing reads it for
    # routing or for operators, who get the leader's scrape (controlplane.
    # loadsync); a move of load alone is never written (controlplane.health).
    inflight: float = 0.0
    detail: str = ""
    checked_at: float = 0.0
    # The server its metrics page shows (controlplane.load.KINDS); "" until
    # a page was read.
    server_kind: str = ""
    # No load figures were read: `inflight` is 0 but not measured. False in
    # a record written before the field (whose inflight was as measured).
    inflight_unknown: bool = False


@dataclass(frozen=True, slots=True)
class State:
    """Everything a route table is compiled from, read at one store revision."""

    revision: int
    regions: tuple[Region, ...] = ()
    origins: tuple[Origin, ...] = ()
    health: dict[str, OriginHealth] = field(default_factory=dict)
    tenants: tuple[Tenant, ...] = ()
    keys: tuple[ApiKeyRecord, ...] = ()
    purges: tuple[Purge, ...] = ()
    # Each tenant's record's create revision: the table carries it as a purge
    # of the tenant (compile.py), never trimmed with the purges.
    created: dict[str, int] = field(default_factory=dict)
    # The Responses ids' MAC keys, the signing one first (catalog.RESPONSE_ID_KEYS);
    # () until a replica made them.
    response_id_keys: tuple[bytes, ...] = ()
    # The create revision of catalog.RESPONSE_ID_OWNERS (RouteTable.
    # response_id_owners_from); 0 until a replica made it.
    response_id_owners_from: int = 0
    # The fleet's id (catalog.FLEET_ID, RouteTable.fleet_id); "" until a
    # replica made it.
    fleet_id: str = ""
    # The fleet has had a JWT issuer or a key (catalog.AUTH_REQUIRED): its
    # tables require auth even once the last issuer is gone.
    auth_ever: bool = False
    # Why the stored fleet id is not one (edited by hand, or a bad write):
    # fleet_id is "" then, but the store is not one without an id, and the
    # fleet's tables go out without one (the proxies' guard judges them by
    # auth alone) until `pontoctl fleet adopt` replaces it. "" when it is
    # one, or none is stored.
    fleet_id_invalid: str = ""


def encode(value: Any) -> bytes:
    """JSON of a dataclass value, keys sorted, as stored in etcd."""
    return orjson.dumps(asdict(value), option=orjson.OPT_SORT_KEYS)


def encode_over(value: Any, stored: bytes | None) -> bytes:
    """encode(value) for a record that replaces `stored` (its value as
    stored, None for a new one), keeping what `stored` holds that this
    version does not know: the fields a newer control plane added, at any
    depth of nested records. A replica that rewrites a record during a
    rolling upgrade (a drain, a change of cache TTL) must not erase the
    settings a newer replica wrote (trial 69: an older replica un-suspended a
    tenant for good, and dropped its budgets and model list). A stored value
    that is not a JSON object keeps nothing.

    What this asks of every later version (review): a stored field is never
    renamed or given a new meaning (an older replica would write the old name
    beside a stale copy of the new one), and a rule tying a new field to
    older ones is settled by precedence when the record is read, never by
    refusing it (an older replica changes the older fields without knowing
    the rule, and a refused record takes its tenant or origin away)."""
    new = asdict(value)
    if stored:
        try:
            old = orjson.loads(stored)
        except orjson.JSONDecodeError:
            old = None
        if isinstance(old, dict):
            _keep_unknown(old, new, type(value))
    return orjson.dumps(new, option=orjson.OPT_SORT_KEYS)


def _keep_unknown(old: dict[str, Any], new: dict[str, Any], cls: type) -> None:
    known = _field_records(cls)
    for key, value in old.items():
        if key not in known:
            new[key] = value
        elif isinstance(value, dict) and isinstance(new.get(key), dict):
            nested = known[key]
            if nested is not None:
                _keep_unknown(value, new[key], nested)


@functools.cache
def _field_records(cls: type) -> dict[str, type | None]:
    """cls's fields, each with the record type it holds (a dataclass, alone
    or `| None`), None for a field of another kind (whose stored value is
    replaced whole)."""
    hints = typing.get_type_hints(cls)
    found: dict[str, type | None] = {}
    for name in cls.__dataclass_fields__:  # type: ignore[attr-defined]
        hint = hints[name]
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        found[name] = next(
            (t for t in options if isinstance(t, type) and dataclasses.is_dataclass(t)), None
        )
    return found


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
    fields["model_names"] = tuple((str(k), str(v)) for k, v in fields.get("model_names", ()))
    return Origin(**fields)


def decode_proxy(raw: bytes) -> ProxyRecord:
    fields = _fields(ProxyRecord, raw)
    fields["served"] = tuple((str(r), int(n), int(e)) for r, n, e in fields.get("served", ()))
    fields["features"] = tuple(str(f) for f in fields.get("features", ()))
    return ProxyRecord(**fields)


# ---------------------------------------------------------------- tenants


@dataclass(frozen=True, slots=True)
class Limits:
    """Global limits of a tenant or key; 0 means no limit."""

    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0
    # Budgets: tokens in a UTC day, in a UTC calendar month (docs/rate-limits.md).
    tokens_per_day: int = 0
    tokens_per_month: int = 0

    def validated(self, owner: str) -> Limits:
        if not 0 <= self.concurrency <= MAX_CONCURRENCY:
            raise InvalidArgument(
                f"concurrency {self.concurrency} of {owner} is not in 0..{MAX_CONCURRENCY}",
                field="concurrency",
            )
        for label, value in (
            ("rpm", self.rpm),
            ("tpm", self.tpm),
            ("tokens_per_day", self.tokens_per_day),
            ("tokens_per_month", self.tokens_per_month),
        ):
            if not 0 <= value <= MAX_RATE:
                raise InvalidArgument(f"{label} {value} of {owner} is not in 0..10^12", field=label)
        return self


def check_prompt_controls(text: str, owner: str) -> None:
    """Refuse (InvalidArgument) a system prompt holding a control character
    other than PROMPT_CONTROLS. Only of a prompt being set: one stored before
    the rule is kept, and a write that leaves it as it is (a limit, a
    suspension) is not refused for it (review 200)."""
    for at, char in enumerate(text, 1):
        if unicodedata.category(char) == "Cc" and char not in PROMPT_CONTROLS:
            raise InvalidArgument(
                f"system prompt of {owner} holds the control character {char!a} "
                f"(character {at}): of the controls, only tab, newline and carriage "
                "return may be in it",
                field="system_prompt",
            )


@dataclass(frozen=True, slots=True)
class PromptPolicy:
    system_prompt: str = ""
    enforce_system_prompt: bool = False
    # (parameter, JSON text), sorted.
    defaults: tuple[tuple[str, str], ...] = ()
    max_tokens_ceiling: int = 0
    # (public model, origin model), sorted.
    aliases: tuple[tuple[str, str], ...] = ()

    def validated(self, owner: str, *, stored: bool = False) -> PromptPolicy:
        """This policy normalised; InvalidArgument naming owner and the field
        otherwise. `stored`: a value read back from the store, which a rule
        added since it was written (PROMPT_CONTROLS) does not refuse: the
        tenant would drop out of the route table (its next write is refused)."""
        if len(self.system_prompt) > MAX_SYSTEM_PROMPT:
            raise InvalidArgument(
                f"system prompt of {owner} is longer than {MAX_SYSTEM_PROMPT}",
                field="system_prompt",
            )
        if not stored:
            check_prompt_controls(self.system_prompt, owner)
        for name, text in self.defaults:
            if not PARAM_RE.match(name) or name in NOT_DEFAULTABLE:
                raise InvalidArgument(
                    f"{owner}: {name!r} cannot have a default", field=f"defaults.{name}"
                )
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                raise InvalidArgument(
                    f"{owner}: default of {name!r} is not valid JSON: {text!r}",
                    field=f"defaults.{name}",
                ) from exc
            # The proxy checks requests before it adds defaults: a bad default
            # would reach every origin.
            if (why := check_default(name, value)) is not None:
                raise InvalidArgument(
                    f"{owner}: default of {name!r}: {why}", field=f"defaults.{name}"
                )
        if not 0 <= self.max_tokens_ceiling <= MAX_TOKENS_CEILING:
            raise InvalidArgument(
                f"max_tokens ceiling of {owner} is not in 0..10^7", field="max_tokens"
            )
        for public, target in self.aliases:
            for model in (public, target):
                if not MODEL_RE.match(model):
                    raise InvalidArgument(
                        model_invalid(
                            f"{owner}: model name {model!r} in aliases is invalid", model
                        ),
                        field=f"aliases.{public}",
                    )
            if public == target:
                raise InvalidArgument(
                    f"{owner}: alias {public!r} maps to itself", field=f"aliases.{public}"
                )
        return replace(
            self,
            defaults=tuple(sorted(dict(self.defaults).items())),
            aliases=tuple(sorted(dict(self.aliases).items())),
        )


@dataclass(frozen=True, slots=True)
class CachePolicy:
    mode: str = "exact"
    semantic_threshold: float = 0.0  # 0: the proxy's default
    ttl_s: int = 0  # 0: the proxy's default
    cache_nondeterministic: bool = False
    store_truncated: bool = False
    # Error-bounded semantic hits (docs/semantic-cache.md); 0: a fixed threshold.
    semantic_max_error: float = 0.0

    def validated(self, owner: str) -> CachePolicy:
        mode = self.mode or "exact"
        if mode not in CACHE_MODES:
            raise InvalidArgument(
                f"cache mode {self.mode!r} of {owner} is not one of {', '.join(CACHE_MODES)}",
                field="mode",
            )
        t = self.semantic_threshold
        if not math.isfinite(t) or not (t == 0 or 0.5 <= t <= 1):
            raise InvalidArgument(
                f"semantic threshold {t} of {owner} is not in 0.5..1", field="semantic_threshold"
            )
        e = self.semantic_max_error
        if not math.isfinite(e) or not 0 <= e < MAX_SEMANTIC_ERROR:
            raise InvalidArgument(
                f"semantic max error {e} of {owner} is not in [0, {MAX_SEMANTIC_ERROR})",
                field="semantic_max_error",
            )
        if not 0 <= self.ttl_s <= MAX_TTL_S:
            raise InvalidArgument(
                f"cache TTL {self.ttl_s} s of {owner} is not in 0..{MAX_TTL_S}", field="ttl_s"
            )
        return replace(self, mode=mode)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """How a tenant's requests pick a replica inside a region (docs/routing.md)."""

    mode: str = ""  # "": affinity for chat and completions, least-loaded for embeddings, rerank
    models: tuple[tuple[str, str], ...] = ()  # (model, mode) overrides
    user_sessions: bool = False
    load_bound: float = 0.0  # 0: the proxy's default (1.05)

    def validated(self, owner: str) -> RoutingPolicy:
        for where, mode in (("mode", self.mode), *((f"models.{k}", m) for k, m in self.models)):
            if mode and mode not in ROUTING_MODES:
                raise InvalidArgument(
                    f"routing mode {mode!r} of {owner} is not one of {', '.join(ROUTING_MODES)}",
                    field=where,
                )
        if any(not model or not mode for model, mode in self.models):
            raise InvalidArgument(
                f"a per-model routing mode of {owner} names no model or mode", field="models"
            )
        for model, _ in self.models:
            if not MODEL_RE.match(model):
                raise InvalidArgument(
                    model_invalid(f"{owner}: model name {model!r} in routing is invalid", model),
                    field=f"models.{model}",
                )
        b = self.load_bound
        if not math.isfinite(b) or not (b == 0 or 1 <= b <= 100):
            raise InvalidArgument(
                f"load bound {b:g} of {owner} is not in 1..100", field="load_bound"
            )
        return replace(self, models=tuple(sorted(dict(self.models).items())))


@dataclass(frozen=True, slots=True)
class StreamPolicy:
    """Continuation of broken streams, stall detection and hedging (docs/streams.md)."""

    continuation: str = ""  # "" or "on": continue cut streams; "off": error event
    max_continuations: int = 0  # 0: the default (2)
    stream_idle_timeout_s: float = 0.0  # 0: the proxy's --stream-idle-timeout
    hedge_ms: int = 0  # 0: no hedging
    hedge_auto: bool = False  # hedge after the origin's observed TTFT p95
    hedge_models: tuple[tuple[str, str], ...] = ()  # (model, "N" | "auto" | "0")

    def validated(self, owner: str) -> StreamPolicy:
        if self.continuation not in ("", "on", "off"):
            raise InvalidArgument(
                f"continuation {self.continuation!r} of {owner} is not on or off",
                field="continuation",
            )
        if not 0 <= self.max_continuations <= MAX_CONTINUATIONS:
            raise InvalidArgument(
                f"max continuations {self.max_continuations} of {owner} is not in "
                f"0..{MAX_CONTINUATIONS}",
                field="max_continuations",
            )
        t = self.stream_idle_timeout_s
        if not math.isfinite(t) or not 0 <= t <= MAX_IDLE_TIMEOUT_S:
            raise InvalidArgument(
                f"stream idle timeout {t} s of {owner} is not in 0..{MAX_IDLE_TIMEOUT_S}",
                field="stream_idle_timeout_s",
            )
        delays = (
            ("hedge_ms", str(self.hedge_ms)),
            *((f"hedge_models.{m}", v) for m, v in self.hedge_models),
        )
        for where, ms in delays:
            if ms != "auto" and not (ms.isascii() and ms.isdigit() and int(ms) <= MAX_HEDGE_MS):
                raise InvalidArgument(
                    f"hedge delay {ms!r} of {owner} is not auto or 0..{MAX_HEDGE_MS} ms",
                    field=where,
                )
        for model, _ in self.hedge_models:
            if not MODEL_RE.match(model):
                raise InvalidArgument(
                    model_invalid(
                        f"{owner}: model name {model!r} in hedge_models is invalid", model
                    ),
                    field=f"hedge_models.{model}",
                )
        return replace(self, hedge_models=tuple(sorted(dict(self.hedge_models).items())))


def check_model_names(names: Iterable[str], owner: str) -> tuple[str, ...]:
    """names sorted, each once, after checking each is a model name and
    there are at most MAX_ACCESS_MODELS; InvalidArgument otherwise."""
    unique = sorted(set(names))
    for name in unique:
        if not MODEL_RE.match(name):
            raise InvalidArgument(model_invalid(f"{owner}: model name {name!r} is invalid", name))
    if len(unique) > MAX_ACCESS_MODELS:
        raise InvalidArgument(f"{owner}: {len(unique)} models, more than {MAX_ACCESS_MODELS}")
    return tuple(unique)


@dataclass(frozen=True, slots=True)
class ModelAccess:
    """The models a tenant's callers may name (routing.proto's ModelAccess):
    names as clients send them, an alias by its own; () is every model."""

    names: tuple[str, ...] = ()

    def validated(self, owner: str) -> ModelAccess:
        return ModelAccess(check_model_names(self.names, f"models of {owner}"))

    def allows(self, model: str) -> bool:
        return not self.names or model in self.names


@dataclass(frozen=True, slots=True)
class JwtIssuer:
    issuer: str
    audiences: tuple[str, ...] = ()
    algorithms: tuple[str, ...] = ("RS256",)
    jwks_file: str = ""
    hs256_secret_file: str = ""
    hs256_secret_env: str = ""
    leeway_s: float = 30.0
    max_lifetime_s: float = JWT_DEFAULT_MAX_LIFETIME_S
    # The issuer's published key set, which each proxy fetches (check_jwks_url).
    jwks_url: str = ""

    def validated(self, owner: str) -> JwtIssuer:
        if not self.issuer:
            raise InvalidArgument(f"JWT issuer of {owner} is empty")
        algorithms = self.algorithms or ("RS256",)
        bad = [a for a in algorithms if a not in JWT_ALGORITHMS]
        if bad:
            raise InvalidArgument(
                f"JWT algorithms {bad} of {owner} are not supported; "
                f"use {', '.join(JWT_ALGORITHMS)}"
            )
        if "HS256" in algorithms and not (self.hs256_secret_file or self.hs256_secret_env):
            raise InvalidArgument(f"{owner}: HS256 needs hs256_secret_file or hs256_secret_env")
        if self.hs256_secret_file and self.hs256_secret_env:
            raise InvalidArgument(f"{owner}: give hs256_secret_file or hs256_secret_env, not both")
        if (self.hs256_secret_file or self.hs256_secret_env) and "HS256" not in algorithms:
            raise InvalidArgument(f"{owner}: an HS256 secret is given but HS256 is not allowed")
        if any(not a for a in self.audiences):
            raise InvalidArgument(f"{owner}: an audience is empty")
        if self.hs256_secret_env and not ENV_RE.match(self.hs256_secret_env):
            raise InvalidArgument(f"{owner}: {self.hs256_secret_env!r} is not a variable name")
        if self.jwks_file and self.jwks_url:
            raise InvalidArgument(f"{owner}: give jwks_file or jwks_url, not both")
        if set(algorithms) - {"HS256"} and not (self.jwks_file or self.jwks_url):
            raise InvalidArgument(f"{owner}: RS256 and ES256 need a jwks_url or a jwks_file")
        if self.jwks_url:
            check_jwks_url(self.jwks_url, owner)
        for path in (self.jwks_file, self.hs256_secret_file):
            if path and not path.startswith("/"):
                raise InvalidArgument(f"{owner}: {path!r} must be an absolute path")
        if not math.isfinite(self.leeway_s) or not 0 <= self.leeway_s <= 600:
            raise InvalidArgument(f"{owner}: JWT leeway {self.leeway_s} s is not in 0..600")
        if (
            not math.isfinite(self.max_lifetime_s)
            or not 60 <= self.max_lifetime_s <= JWT_LONGEST_MAX_LIFETIME_S
        ):
            raise InvalidArgument(
                f"{owner}: JWT max_lifetime_s {self.max_lifetime_s:g} is not in "
                f"60..{JWT_LONGEST_MAX_LIFETIME_S} (seconds)"
            )
        return replace(self, algorithms=tuple(sorted(set(algorithms))))


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    limits: Limits = Limits()
    prompt: PromptPolicy = PromptPolicy()
    cache: CachePolicy = CachePolicy()
    jwt: JwtIssuer | None = None
    routing: RoutingPolicy = RoutingPolicy()
    streams: StreamPolicy = StreamPolicy()
    models: ModelAccess = ModelAccess()
    # Its callers are refused (403 tenant_suspended); keys and settings kept.
    suspended: bool = False
    # While suspended: the operator's reason (never in route tables), and
    # since when (Unix seconds; 0: not known), which the catalog sets
    # (suspension_stamped), never a caller.
    suspended_reason: str = ""
    suspended_at: float = 0.0

    def validated(self, *, stored: bool = False) -> Tenant:
        """This tenant with each block validated; the first block's
        InvalidArgument otherwise (`problems` has one per block). `stored`:
        as read back from the store (PromptPolicy.validated)."""
        check_name("tenant", self.name)
        blocks, problems = self._blocks(stored=stored)
        if problems:
            raise problems[0]
        return replace(self, **blocks)

    def problems(self, *, stored: bool = False) -> list[InvalidArgument]:
        """Every block's first error, or the name's alone: `pontoctl apply`
        reports them all in one pass, where a document with a bad limit and
        a bad cache TTL took two runs to learn of both. `stored` as for
        validated."""
        try:
            check_name("tenant", self.name)
        except InvalidArgument as exc:
            return [exc]
        return self._blocks(stored=stored)[1]

    def _blocks(self, *, stored: bool = False) -> tuple[dict[str, Any], list[InvalidArgument]]:
        owner = f"tenant {self.name!r}"
        blocks: dict[str, Any] = {"jwt": None}
        problems: list[InvalidArgument] = []
        try:
            reason = check_reason(f"{owner}: suspended_reason", self.suspended_reason.strip())
            blocks["suspended_reason"] = reason
            if reason and not self.suspended:
                raise InvalidArgument(
                    f"{owner}: suspended_reason is given, but the tenant is not suspended"
                )
        except InvalidArgument as exc:
            exc.within("suspended_reason")
            problems.append(exc)
        for part, block in (
            ("limits", self.limits),
            ("prompt", self.prompt),
            ("cache", self.cache),
            ("jwt", self.jwt),
            ("routing", self.routing),
            ("streams", self.streams),
            ("models", self.models),
        ):
            if block is None:
                continue
            try:
                if isinstance(block, PromptPolicy):
                    blocks[part] = block.validated(owner, stored=stored)
                else:
                    blocks[part] = block.validated(owner)
            except InvalidArgument as exc:
                # The block's name in the apply document, so its error names the field.
                exc.within(part)
                problems.append(exc)
        return blocks, problems


def served_models(origins: Iterable[Origin]) -> set[str]:
    """The models the origins list, drained or unhealthy ones' too: proxies
    know them (and answer 503 while none can take one, not 404)."""
    return {model for o in origins for model in o.models}


def unserved_aliases(tenant: Tenant, origins: Iterable[Origin]) -> tuple[str, ...]:
    """A warning for each of tenant's aliases whose target no origin lists; pure.

    Such an alias is accepted (its origins may register later), but until an
    origin lists the target the proxies answer requests for the alias 404
    model_not_found, as for any model they do not know. A target that only
    drained or unhealthy origins list counts as served: the proxies know the
    model and answer 503 while no origin can take it.
    """
    served = served_models(origins)
    return tuple(
        f"no origin serves model {target!r} now; requests for alias {alias!r} of tenant "
        f"{tenant.name!r} will get 404 until one does"
        for alias, target in tenant.prompt.aliases
        if target not in served
    )


def access_warnings(
    tenant: Tenant,
    origins: Iterable[Origin],
    key: ApiKeyRecord | None = None,
    keys: Iterable[ApiKeyRecord] = (),
) -> tuple[str, ...]:
    """A warning for each model tenant's callers (with key: that key's) may
    name that nothing answers; of a tenant, for each of its aliases it may
    not name, for each of its `keys` whose list names models it may not
    (a tenant's list narrowed under its keys' own, review 45), and for each
    default its max_tokens ceiling clamps (clamped_defaults); pure.

    Such a list is accepted (its origins may register later), but a misspelt
    name would leave a model refused unnoticed. A name answers when an
    origin lists it or it is one of the tenant's aliases; a key's names
    must also be among its tenant's, when the tenant has a list.
    """
    served = served_models(origins)
    aliases = dict(tenant.prompt.aliases)
    if key is not None:
        names, whose = key.models, f"key {key.id!r}"
    else:
        names, whose = tenant.models.names, f"tenant {tenant.name!r}"
    # What refuses requests now first, then what nothing serves yet: a reply's
    # warnings are cut past a size, and a long list's unserved names would hide
    # the others (trial 29).
    refused: list[str] = []
    for k in keys:
        lost = [name for name in k.models if not tenant.models.allows(name)]
        if lost:
            none = "; the key may name no model at all" if len(lost) == len(k.models) else ""
            refused.append(
                f"key {k.id!r} of tenant {tenant.name!r} lists {_some(lost)}, which the tenant "
                f"may not name: requests for {'them' if len(lost) > 1 else 'it'} get 404{none} "
                f"(`pontoctl key models {k.id} ...`)"
            )
    if key is None:
        refused.extend(
            f"alias {alias!r} of tenant {tenant.name!r} is not among the models it may name: "
            "requests for it get 404"
            for alias, _ in tenant.prompt.aliases
            if not tenant.models.allows(alias)
        )
    if key is None:
        refused.extend(clamped_defaults(tenant))
    unserved: list[str] = []
    for name in names:
        if key is not None and not tenant.models.allows(name):
            refused.append(
                f"{whose} may name model {name!r}, which its tenant {tenant.name!r} may not: "
                "requests for it get 404"
            )
        elif name not in served and name not in aliases:
            unserved.append(
                f"no origin serves model {name!r}, which {whose} may name, and it is no alias "
                f"of tenant {tenant.name!r}: requests for it get 404 until one does"
            )
    return (*refused, *unserved)


def clamped_defaults(tenant: Tenant) -> tuple[str, ...]:
    """A warning for each of tenant's token-count defaults (max_tokens,
    max_completion_tokens, max_output_tokens) above its max_tokens ceiling;
    pure. Such a default is accepted, but never sent as given: the proxies
    add defaults, then clamp those fields to the ceiling (dataplane.assemble),
    so a request without the field gets the ceiling (trial 52: `--max-tokens
    100 --default max_tokens=5000` was saved without a word)."""
    ceiling = tenant.prompt.max_tokens_ceiling
    if not ceiling:
        return ()
    warnings = []
    for name, text in tenant.prompt.defaults:
        if name not in (*TOKEN_FIELDS, *RESPONSES_TOKEN_FIELDS):
            continue
        value = orjson.loads(text)
        if isinstance(value, int) and not isinstance(value, bool) and value > ceiling:
            warnings.append(
                f"default {name} {value} of tenant {tenant.name!r} is above its max_tokens "
                f"ceiling {ceiling}: the proxies clamp it, so requests without {name} "
                f"get {ceiling}"
            )
    return tuple(warnings)


# A tenant's per-model settings, by what they are called in its warnings:
# (the setting, what requests are by it, what to set instead of an alias's).
PerModelSetting = Literal["routing", "hedging"]
_PER_MODEL: dict[PerModelSetting, tuple[str, str, str]] = {
    "routing": ("routing policy", "routed", "policy"),
    "hedging": ("hedge delay", "hedged", "delay"),
}


def unserved_settings(
    tenant: Tenant, origins: Iterable[Origin], setting: PerModelSetting, *, unserved: bool = True
) -> tuple[str, ...]:
    """A warning for each model of tenant's per-model `setting` (routing:
    `--model-routing`; hedging: `--model-hedge-ms`) that applies to nothing
    (without `unserved`, only those that are aliases: what a change of the
    aliases alone can cause); pure.

    A model no origin lists is accepted (it may be added later), but a
    misspelt one would do nothing unnoticed. As for aliases, a model only
    drained or unhealthy origins list counts as served. Proxies pick both
    settings by the model a request names after the tenant's aliases, so the
    setting of one of its aliases never applies, served or not: the warning
    names the model to set instead.
    """
    what, by, value = _PER_MODEL[setting]
    pairs = tenant.routing.models if setting == "routing" else tenant.streams.hedge_models
    served = served_models(origins)
    aliases = dict(tenant.prompt.aliases)
    warnings = []
    for model, _ in pairs:
        if model in aliases:
            warnings.append(
                f"model {model!r} is an alias of tenant {tenant.name!r}, to "
                f"{aliases[model]!r}: its {what} never applies, as requests are {by} "
                f"by the model an alias names (set the {value} of {aliases[model]!r})"
            )
        elif unserved and model not in served:
            warnings.append(
                f"no origin serves model {model!r}; its {what} (tenant "
                f"{tenant.name!r}) applies once one does"
            )
    return tuple(warnings)


def routed_models(regions: Iterable[Region], origins: Iterable[Origin]) -> frozenset[str]:
    """The models proxies route requests for: those an origin lists that is not
    drained, in a region that exists and is not drained. Pure.

    An origin of a region that does not exist (deleted between a write's
    check and the compile) routes nothing, drained or not: compile_table
    leaves it out of the table, so proxies do not even know its models.
    Health does not count: proxies send a model none of whose origins is
    healthy to its unhealthy ones (dataplane.routes, panic routing), so only
    drains leave a model they know answered 503 no_healthy_origin.
    """
    serving = {r.name for r in regions if not r.drained}
    return frozenset(
        model for o in origins if not o.drained and o.region in serving for model in o.models
    )


DrainKind = Literal["region", "origin"]
# Models named in one warning; the rest are counted (a warning must stay short).
MAX_NAMED_MODELS = 10


def _some(names: Sequence[str]) -> str:
    """names, the first MAX_NAMED_MODELS of them and a count of the rest."""
    shown = ", ".join(names[:MAX_NAMED_MODELS])
    if len(names) > MAX_NAMED_MODELS:
        shown += f" and {len(names) - MAX_NAMED_MODELS} more"
    return shown


def stranded_by_drain(
    kind: DrainKind, name: str, regions: Sequence[Region], origins: Sequence[Origin]
) -> tuple[str, ...]:
    """A warning naming the models that region or origin `name` (kind "region"
    or "origin"), drained in this state, was the last to route (routed_models
    were it not drained); () when it is not drained or none. Pure.

    Such a drain is allowed (it may be the point: a model withdrawn), but
    proxies answer requests for those models 503 no_healthy_origin until an
    origin serving them is undrained.
    """
    if kind == "region":
        undrained = [replace(r, drained=False) if r.name == name else r for r in regions]
        lost = routed_models(undrained, origins) - routed_models(regions, origins)
    else:
        undrained_o = [replace(o, drained=False) if o.name == name else o for o in origins]
        lost = routed_models(regions, undrained_o) - routed_models(regions, origins)
    if not lost:
        return ()
    named = sorted(lost)
    shown = _some([repr(m) for m in named])
    models, them = (f"models {shown}", "them") if len(named) > 1 else (f"model {shown}", "it")
    return (
        f"no undrained origin serves {models} now ({kind} {name!r} was the last): proxies "
        f"answer requests for {them} 503 no_healthy_origin until one is undrained",
    )


def unrouted_by_region(
    name: str, regions: Sequence[Region], origins: Sequence[Origin]
) -> tuple[str, ...]:
    """A warning when origin `name`, not drained in this state, is in a
    drained region; () otherwise (an unknown origin too). Pure.

    Such an undrain is allowed (the region may be undrained next), but
    proxies send the origin nothing while its region is drained: they leave
    out a drained region's origins whatever their own flag (dataplane.routes,
    as routed_models does).
    """
    origin = next((o for o in origins if o.name == name), None)
    if origin is None or origin.drained:
        return ()
    region = origin.region
    if not any(r.name == region and r.drained for r in regions):
        return ()
    return (
        f"origin {name} is undrained, but its region {region} is drained: it gets no traffic "
        f"until `pontoctl undrain region {region}`",
    )


def unrouted_by_origins(
    name: str, regions: Sequence[Region], origins: Sequence[Origin]
) -> tuple[str, ...]:
    """A warning when region `name`, not drained in this state, has origins
    and all of them are drained; () otherwise (a region without origins or
    an unknown one too). Pure.

    Such an undrain is allowed (its origins may be undrained next), but the
    region serves nothing until one of them is: proxies leave drained origins
    out (routed_models).
    """
    if not any(r.name == name and not r.drained for r in regions):
        return ()
    own = sorted(o.name for o in origins if o.region == name)
    if not own or any(not o.drained for o in origins if o.region == name):
        return ()
    return (
        f"region {name} is undrained, but all its origins are drained ({_some(own)}): it gets "
        f"no traffic until one is undrained (`pontoctl undrain origin {own[0]}`)",
    )


def drain_warnings(
    kind: DrainKind,
    name: str,
    drained: bool,
    regions: Sequence[Region],
    origins: Sequence[Origin],
) -> tuple[str, ...]:
    """What a drain (`drained`) or undrain of region or origin `name` (kind),
    done in this state, warns of: the models a drain leaves no undrained
    origin (stranded_by_drain); an undrained origin its drained region still
    keeps from traffic (unrouted_by_region); an undrained region whose
    origins are all drained (unrouted_by_origins). Pure; the Admin API's
    drains and the status page's buttons both answer with it."""
    if drained:
        return stranded_by_drain(kind, name, regions, origins)
    if kind == "origin":
        return unrouted_by_region(name, regions, origins)
    return unrouted_by_origins(name, regions, origins)


def rtt_warnings(rtts: Mapping[str, Collection[str]]) -> tuple[str, ...]:
    """What the RTT matrix of the fleet's regions (region name -> the regions
    its RTTs name; every region, drained or not) warns of. Pure; every region
    write (PutRegion, DeleteRegion, DrainRegion, an apply that changes
    regions) answers with it, and `pontoctl get regions` notes it.

    - RTTs naming a region that does not exist (a misspelling, a region not
      added yet, or one deleted since): proxies ignore such entries. A
      warning, not a refusal, unlike an origin's region or an apply's RTT
      peer: a single region write cannot add the peer it names in the same
      write (RTTs go both ways, so one of the two regions always comes
      first), and deleting a region leaves the entries naming it.
    - Some regions with RTTs but not all: proxies order regions by
      great-circle distance, for the whole fleet, until every region has
      RTTs (dataplane/routes.py build_routes), so the RTTs given do nothing.
    - Every region with RTTs, some without one to another region: from such
      a region, proxies order the regions it has no RTT to after all the
      others.

    No region with RTTs at all is no mistake (distance is the default), nor
    is a fleet of one region.
    """
    names = set(rtts)
    out = [
        f"region {name}'s RTTs name regions that do not exist: {_some(unknown)} "
        "(misspelt, or not added yet): proxies ignore those entries"
        for name, peers in sorted(rtts.items())
        if (unknown := sorted(set(peers) - names))
    ]
    if len(names) < 2:
        return tuple(out)
    without = sorted(name for name, peers in rtts.items() if not peers)
    if without and len(without) < len(names):
        out.append(
            f"RTT ordering is off: proxies order every region by great-circle distance until "
            f"every region has RTTs; none on region(s) {_some(without)}"
        )
    elif not without:
        gaps = [
            f"{name} to {_some(missing)}"
            for name, peers in sorted(rtts.items())
            if (missing := sorted(names - set(peers) - {name}))
        ]
        if gaps:
            out.append(
                "the RTT matrix is incomplete, so RTT ordering is partial: from a region, "
                "proxies order the regions it has no RTT to after all the others; no RTT from "
                + "; ".join(gaps)
            )
    return tuple(out)


def unserved_purge(
    model: str, tenant: str, origins: Iterable[Origin], tenants: Iterable[Tenant]
) -> tuple[str, ...]:
    """A warning when a purge of `model` (of `tenant`, "" for all) names a model
    no origin lists; () for any other purge. Pure.

    Such a purge is allowed: entries cached while an origin served the model
    may still be there. But it may be a misspelling, or an alias: answers are
    cached under the model an alias names, so a purge of the alias removes
    none of them, and the warning names the model to purge instead.
    """
    if not model or any(model in o.models for o in origins):
        return ()
    named = sorted(
        {
            (t.name, target)
            for t in tenants
            if tenant in ("", t.name)
            for alias, target in t.prompt.aliases
            if alias == model
        }
    )
    warning = f"no origin serves model {model!r}; purge sent anyway"
    if named:
        of = ", ".join(f"tenant {t!r} to {target!r}" for t, target in named)
        warning += (
            f" (it is an alias: {of}; answers are cached under the model an alias names, "
            "so purge that model for them)"
        )
    return (warning,)


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """A key as stored: its hash, never the key."""

    id: str
    hash: str
    tenant: str
    description: str = ""
    limits: Limits = Limits()
    created_at: float = 0.0
    revoked: bool = False
    revoked_at: float = 0.0
    # Unix seconds from which proxies refuse the key; 0: never (ponto.apikeys.key_expired).
    expires_at: float = 0.0
    # The models its callers may name, within its tenant's (sorted); (): the tenant's.
    models: tuple[str, ...] = ()
    # Its callers are refused (403 api_key_suspended) until it is resumed.
    suspended: bool = False
    # While suspended: the operator's reason and since when (Unix seconds).
    suspended_reason: str = ""
    suspended_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Purge:
    revision: int
    tenant: str = ""
    model: str = ""


def _limits(raw: Any) -> Limits:
    return Limits(**{k: int(v) for k, v in (raw or {}).items() if k in Limits.__dataclass_fields__})


def decode_tenant(raw: bytes) -> Tenant:
    fields = _fields(Tenant, raw)
    prompt = {
        k: v
        for k, v in (fields.get("prompt") or {}).items()
        if k in PromptPolicy.__dataclass_fields__
    }
    prompt["defaults"] = tuple((str(a), str(b)) for a, b in prompt.get("defaults", ()))
    prompt["aliases"] = tuple((str(a), str(b)) for a, b in prompt.get("aliases", ()))
    cache = {
        k: v
        for k, v in (fields.get("cache") or {}).items()
        if k in CachePolicy.__dataclass_fields__
    }
    routing = {
        k: v
        for k, v in (fields.get("routing") or {}).items()
        if k in RoutingPolicy.__dataclass_fields__
    }
    routing["models"] = tuple((str(a), str(b)) for a, b in routing.get("models", ()))
    streams = {
        k: v
        for k, v in (fields.get("streams") or {}).items()
        if k in StreamPolicy.__dataclass_fields__
    }
    streams["hedge_models"] = tuple((str(a), str(b)) for a, b in streams.get("hedge_models", ()))
    jwt_raw = fields.get("jwt")
    jwt = None
    if jwt_raw:
        jwt_fields = {k: v for k, v in jwt_raw.items() if k in JwtIssuer.__dataclass_fields__}
        jwt_fields["audiences"] = tuple(jwt_fields.get("audiences", ()))
        jwt_fields["algorithms"] = tuple(jwt_fields.get("algorithms", ()))
        jwt = JwtIssuer(**jwt_fields)
    suspended = fields.get("suspended") is True  # absent in records from before suspension
    return Tenant(
        name=fields["name"],
        limits=_limits(fields.get("limits")),
        prompt=PromptPolicy(**prompt),
        cache=CachePolicy(**cache),
        jwt=jwt,
        routing=RoutingPolicy(**routing),
        streams=StreamPolicy(**streams),
        models=ModelAccess(tuple(str(m) for m in (fields.get("models") or {}).get("names", ()))),
        suspended=suspended,
        # Read by precedence, never refused (encode_over): a replica older
        # than reasons lifts a suspension and keeps the reason it cannot see;
        # one no write takes (a later version's longer bound, a hand edit) is
        # read as one that is (a refused tenant would leave the table).
        suspended_reason=readable_reason(str(fields.get("suspended_reason") or ""))
        if suspended
        else "",
        suspended_at=float(fields.get("suspended_at") or 0.0) if suspended else 0.0,
    )


def suspension_stamped(new: Tenant, old: Tenant | None, clock: Callable[[], float]) -> Tenant:
    """`new`, to be written over `old` (None: a new record), with the time of
    its suspension as the store keeps it: `old`'s when it was suspended
    already (none, not known, for one suspended before the time was kept:
    not this write's), `clock()` (read only then) when this write suspends
    it, none when it serves. What a caller or a file says of the time is
    not taken."""
    if not new.suspended:
        at = 0.0
    elif old is not None and old.suspended:
        at = old.suspended_at
    else:
        at = clock()
    return new if at == new.suspended_at else replace(new, suspended_at=at)


def decode_key(raw: bytes) -> ApiKeyRecord:
    fields = _fields(ApiKeyRecord, raw)
    fields["limits"] = _limits(fields.get("limits"))
    fields["models"] = tuple(str(m) for m in fields.get("models", ()))
    fields["suspended"] = fields.get("suspended") is True  # absent before suspension
    # Only of a suspended key: a replica older than reasons resumes one and
    # keeps what it cannot see.
    on = fields["suspended"]
    fields["suspended_reason"] = str(fields.get("suspended_reason") or "") if on else ""
    fields["suspended_at"] = float(fields.get("suspended_at") or 0.0) if on else 0.0
    return ApiKeyRecord(**fields)


def decode_id_keys(raw: bytes) -> tuple[bytes, ...]:
    """The Responses id keys as stored: {"keys": [hex, ...]}, the signing
    one first, each of at least 16 bytes (a proxy refuses a table with a
    shorter one). An operator rotates by putting a new key first and keeping
    the old one after it while its ids should last."""
    data = orjson.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ValueError('the response id keys are not {"keys": [hex, ...]}')
    keys = tuple(bytes.fromhex(k) for k in data["keys"])
    if not keys or any(len(k) < 16 for k in keys):
        raise ValueError("a response id key is shorter than 16 bytes, or there is none")
    return keys


# What a fleet id may be: made as 16 hex digits (catalog.ensure_fleet_id);
# an operator's `fleet adopt` takes what a proxy names, within these bounds.
FLEET_ID_RE = re.compile(r"[0-9a-f-]{16,64}")


def check_fleet_id(fleet_id: str) -> str:
    """fleet_id if it is one a proxy may name (FLEET_ID_RE), else InvalidArgument."""
    if not FLEET_ID_RE.fullmatch(fleet_id):
        raise InvalidArgument(
            f"{fleet_id!r} is not a fleet id (16 to 64 characters of 0-9, a-f and '-'): "
            "take it from a proxy's refusal (`pontoctl get proxies -o json`), its "
            "ponto_fleet_info metric, or its log"
        )
    return fleet_id


def decode_fleet_id(raw: bytes) -> str:
    """The fleet id as stored: {"id": "..."}."""
    data = orjson.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        raise ValueError('the fleet id is not {"id": "..."}')
    return check_fleet_id(data["id"])


def decode_purge(raw: bytes, revision: int) -> Purge:
    fields = _fields(Purge, raw)
    return Purge(revision, str(fields.get("tenant", "")), str(fields.get("model", "")))
