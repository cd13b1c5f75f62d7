"""What each mutating Admin call writes to the audit trail (controlplane/audit.py).

`audited(describe)` wraps a servicer method inside `grpc_errors`: once the call
has ended, ok or refused by the core, it records the caller, the call's name
(or what `action(request)` names it: an undrain is UndrainRegion, not a
DrainRegion with drained=false, so the trail can be filtered by it), and what
`describe(request, response)` says it acted on (response is None when the
call failed). Calls refused before they reach the servicer (no admin token,
a certificate of the wrong role) are logged by the guard, not recorded: an
unauthenticated client must not be able to write to etcd. A refusal recorded
is logged by its entry's line (controlplane.audit) alone; the Admin service
logs the others (reads, dry runs) as the guard logs its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from controlplane.api.guard import peer_text
from controlplane.apply import change_text
from controlplane.audit import MAX_DETAIL_KEYS, AuditLog
from controlplane.errors import ControlPlaneError, OutcomeUnknown
from controlplane.model import ApiKeyRecord, redact_urls
from ponto import roles
from ponto.times import utc
from ponto.v1 import admin_pb2 as apb

Req = TypeVar("Req")
Resp = TypeVar("Resp")
# (target, detail) of a call, or None: not audited (a dry run).
Description = tuple[str, dict[str, str]] | None


# What the call under way found out for its entry beyond its request (`note`).
_NOTES: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "audit_notes", default=None
)


def note(**detail: str) -> None:
    """Add `detail` to the audit entry of the call under way (an audited
    servicer method's, on its task): what only the call learns, such as the
    values it replaced. Nothing outside an audited call."""
    notes = _NOTES.get()
    if notes is not None:
        notes.update(detail)


class Audited(Protocol):
    """A servicer whose calls are audited."""

    audit: AuditLog
    token_required: bool


def actor_of(auth_context: Mapping[str, Iterable[bytes]], *, token_required: bool) -> str:
    """Who made a call that the guard let through.

    Under mutual TLS, the client certificate's identity: a SPIFFE ID URI name
    that is not one of Ponto's role names (an operator's own PKI names people
    or workloads so), else the subject's common name, else the role URI. Else
    "admin-token" when the admin token was required (so it was presented),
    else "anonymous".
    """
    uris = sorted(
        u.decode(errors="replace")
        for key in ("peer_uri", "x509_subject_alternative_name")
        for u in auth_context.get(key, ())
    )
    spiffe = [u for u in uris if u.startswith("spiffe://")]
    own = [u for u in spiffe if not u.startswith(roles.URI_PREFIX)]
    names = [cn.decode(errors="replace") for cn in auth_context.get("x509_common_name", ())]
    for found in (own, names, spiffe):
        if found:
            return found[0]
    return "admin-token" if token_required else "anonymous"


# The audit result of a change whose write the state store did not confirm:
# not refused (a status code), as it may have been made (SRE trial: an
# undrain recorded as UNAVAILABLE took effect when etcd ran again).
OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"


def outcome_of(exc: BaseException) -> tuple[str, str]:
    """The audit result and message of an admin change that raised `exc`: the
    gRPC status of a refusal, OUTCOME_UNKNOWN for a write the state store did
    not confirm, CANCELLED for a caller gone (the change may have been made),
    INTERNAL for a bug (its text stays in the log)."""
    if isinstance(exc, OutcomeUnknown):
        return OUTCOME_UNKNOWN, str(exc)
    if isinstance(exc, ControlPlaneError):
        return exc.status.name, str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED", "the caller went away; the change may be made"
    return "INTERNAL", "internal error"


def audited(
    describe: Callable[[Any, Any], Description],
    action: Callable[[Any], str] | None = None,
) -> Callable[[Callable[..., Awaitable[Resp]]], Callable[..., Awaitable[Resp]]]:
    def wrap(fn: Callable[..., Awaitable[Resp]]) -> Callable[..., Awaitable[Resp]]:
        @functools.wraps(fn)
        async def call(
            self: Audited, request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> Resp:
            result, message, response = "ok", "", None
            refusal: ControlPlaneError | None = None
            notes: dict[str, str] = {}
            noting = _NOTES.set(notes)
            try:
                response = await fn(self, request, context)
            except BaseException as exc:
                result, message = outcome_of(exc)
                if isinstance(exc, ControlPlaneError):
                    refusal = exc
                raise
            finally:
                _NOTES.reset(noting)
                described = describe(request, response)
                if described is not None:
                    target, detail = described
                    # Notes first: an entry over its bound keeps its first
                    # keys (audit._bounded), and what a call noted (what it
                    # changed) says more than the request's echo (review 287).
                    detail = {**notes, **{k: v for k, v in detail.items() if k not in notes}}
                    # A URL anywhere in a value (a tenant's JWKS URL, a block
                    # shown whole, a change's before and after) is redacted:
                    # the trail is also the control plane's log (ponto.audit).
                    detail = {k: redact_urls(v) for k, v in detail.items()}
                    await self.audit.record(
                        actor=actor_of(context.auth_context(), token_required=self.token_required),
                        action=action(request) if action else fn.__name__,
                        target=target,
                        detail=detail,
                        source=peer_text(context.peer()),
                        result=result,
                        message=message,
                    )
                    if refusal is not None:
                        # The entry's ponto.audit line says it: grpc_errors
                        # logs it no more.
                        refusal.logged = True
            return response

        return call

    return wrap


def fields(message: Message, *, leave: Iterable[str] = ("name",)) -> dict[str, str]:
    """The fields a message sets, each as compact JSON (strings bare), minus `leave`.

    Numbers are JSON numbers at every depth, 64-bit ones too: `{"concurrency": 5,
    "rpm": 120}`, not the proto3 JSON mapping's `"rpm": "120"` (a string, for
    JavaScript's sake), so one reader compares them all alike."""
    out = {}
    plain = _numbers(message, MessageToDict(message, preserving_proto_field_name=True))
    for name, value in plain.items():
        if name not in leave:
            out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return out


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _numbers(message: Message, value: dict[str, Any]) -> dict[str, Any]:
    """value, MessageToDict's of message, with its 64-bit integers as ints (in place)."""
    for fd in message.DESCRIPTOR.fields:
        if fd.name not in value:
            continue
        got = getattr(message, fd.name)
        if fd.type in _INT64:
            repeated = fd.is_repeated
            value[fd.name] = [int(v) for v in value[fd.name]] if repeated else int(value[fd.name])
        elif fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
            if fd.is_repeated:
                for item, shown in zip(got, value[fd.name], strict=True):
                    _numbers(item, shown)
            else:
                _numbers(got, value[fd.name])
    return value


def _flag(value: bool) -> str:
    return "true" if value else "false"


# ---------------------------------------------------------------- describers


def put_region(req: apb.PutRegionRequest, _: object) -> Description:
    return f"region/{req.region.name}", {
        **fields(req.region),
        "allow_update": _flag(req.allow_update),
    }


def put_origin(req: apb.PutOriginRequest, _: object) -> Description:
    # Its base URL is redacted with every URL of an entry (audited): one is
    # refused when it carries userinfo, but refusals are recorded too.
    detail = fields(req.origin)
    return f"origin/{req.origin.name}", {**detail, "allow_update": _flag(req.allow_update)}


def put_tenant(req: apb.PutTenantRequest, _: object) -> Description:
    return f"tenant/{req.tenant.name}", {
        **fields(req.tenant),
        "allow_update": _flag(req.allow_update),
    }


def update_tenant(req: apb.UpdateTenantRequest, _: object) -> Description:
    # Not `expected`: the whole tenant as the caller read it (review 200).
    return f"tenant/{req.name}", fields(req, leave=("name", "expected"))


def named(kind: str) -> Callable[[apb.DeleteRequest, object], Description]:
    """The description of a call on one named object (a delete)."""

    def describe(req: apb.DeleteRequest, _: object) -> Description:
        return f"{kind}/{req.name}", {}

    return describe


def drain(kind: str) -> Callable[[apb.DrainRequest, object], Description]:
    def describe(req: apb.DrainRequest, _: object) -> Description:
        if req.dry_run:  # changed nothing: a read of the warnings
            return None
        return f"{kind}/{req.name}", {"drained": _flag(req.drained)}

    return describe


def drain_changes(drained: bool, changed: bool) -> str:
    """What a drain (drained) or undrain did, as an entry's `changes` says it
    (trial 27: a drain clicked twice on a stale page read as two drains)."""
    if not changed:
        return "nothing"
    return f"drained {_flag(not drained)} -> {_flag(drained)}"


def drain_action(kind: str) -> Callable[[apb.DrainRequest], str]:
    """The action of a DrainRegion/DrainOrigin call: Drain<Kind> or Undrain<Kind>."""
    return lambda req: f"{'Drain' if req.drained else 'Undrain'}{kind}"


def create_key(req: apb.CreateKeyRequest, resp: apb.CreateKeyResponse | None) -> Description:
    # The secret is in the response only; it is never read here.
    target = f"key/{resp.key.id}" if resp is not None else f"tenant/{req.tenant}"
    detail = fields(req, leave=("expires_at", "expires_in_s"))
    if resp is not None and resp.key.expires_at:
        detail["expires_at"] = utc(resp.key.expires_at)
    elif resp is None:
        detail.update(_asked_expiry(req.expires_at, req.expires_in_s))
    return target, detail


def revoke_key(req: apb.KeyRequest, _: object) -> Description:
    return f"key/{req.id}", {}


def set_key_limits(req: apb.SetKeyLimitsRequest, _: object) -> Description:
    return f"key/{req.id}", fields(req, leave=("id", "expected"))


def set_key_models(req: apb.SetKeyModelsRequest, _: object) -> Description:
    # As CreateKey's entry has them (fields): a JSON list, [] for the tenant's.
    return f"key/{req.id}", fields(req, leave=("id",)) or {"models": "[]"}


def set_key_suspended(req: apb.SetKeySuspendedRequest, _: object) -> Description:
    reason = req.reason.strip()  # as stored
    return f"key/{req.id}", {"reason": reason} if reason else {}


def key_suspension_action(req: apb.SetKeySuspendedRequest) -> str:
    """SuspendKey or ResumeKey, as drains are Drain<Kind> or Undrain<Kind>."""
    return "SuspendKey" if req.suspended else "ResumeKey"


def suspension_changes(before: ApiKeyRecord | None, after: ApiKeyRecord) -> str:
    """What a key's suspension or resumption did, as an entry's `changes`
    says it (and `get audit`'s CHANGES column), in the words a tenant's
    update uses (`suspended false -> true; suspended_reason unset ->
    "leaked"`): "nothing" for a key that already was (before None)."""
    if before is None:
        return "nothing"
    changes = []
    if before.suspended != after.suspended:
        changes.append(("suspended", _flag(before.suspended), _flag(after.suspended)))
    old, new = before.suspended_reason, after.suspended_reason
    if old != new:
        changes.append(("suspended_reason", _quoted(old), _quoted(new)))
    return change_text(changes)


def _quoted(text: str) -> str:
    """A reason as an update's changes quote a string ("" for none: unset, removed)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def set_key_expiry(req: apb.SetKeyExpiryRequest, resp: apb.ApiKeyInfo | None) -> Description:
    if resp is not None:
        return f"key/{req.id}", {"expires_at": utc(resp.expires_at) if resp.expires_at else "never"}
    return f"key/{req.id}", _asked_expiry(req.expires_at, req.expires_in_s) or {
        "expires_at": "never"
    }


def _asked_expiry(at: float, in_s: float) -> dict[str, str]:
    """A refused call's expiry, as asked (it may be no time at all)."""
    asked = {}
    if at:
        asked["expires_at"] = utc(at)
    if in_s:
        asked["expires_in_s"] = repr(in_s)
    return asked


def purge_cache(req: apb.PurgeCacheRequest, _: object) -> Description:
    """Target `cache/TENANT/MODEL` (`*`: all): a purge of one model and one
    of everything differ in `get audit`'s table, not only in its yaml."""
    tenant, model = req.tenant or "*", req.model or "*"
    return f"cache/{tenant}/{model}", {"model": model}


def adopt_fleet(req: apb.AdoptFleetRequest, _: object) -> Description:
    """Target `fleet/ID` (the id adopted); the one it replaced is noted by
    the call (`previous`), as only the store knows it."""
    return f"fleet/{req.fleet_id[:64]}", {}


# What the per-object changes of an Apply entry may take, and each of them:
# with the entry's other fields at their bounds (controlplane.audit), the
# entry stays within MAX_ENTRY_BYTES, so the trail keeps every key written and
# `more` counts exactly what it left out.
APPLY_CHANGES_BYTES = 1200
APPLY_CHANGE_CHARS = 120


def apply(req: apb.ApplyRequest, resp: apb.ApplyResponse | None) -> Description:
    """prune; the objects created, updated and deleted (each a list of kind/name);
    then, for each updated object, `kind/name`: what it changed, as pontoctl's
    report says it (`limits {...} -> removed`). The trail keeps MAX_DETAIL_KEYS
    keys of an entry: past them, `more` counts the objects left out."""
    if req.dry_run:
        return None
    detail = {"prune": _flag(req.prune)}
    if resp is not None:
        changed = [c for c in resp.changes if c.action != "unchanged"]
        for action in ("created", "updated", "deleted"):
            detail[action] = ", ".join(f"{c.kind}/{c.name}" for c in changed if c.action == action)
        detail = {k: v for k, v in detail.items() if v}
        told = [c for c in changed if c.changes]
        room = MAX_DETAIL_KEYS - len(detail)
        if len(told) > room:
            room -= 1  # for `more`
        budget, shown = APPLY_CHANGES_BYTES, {}
        for c in told[:room]:
            key = f"{c.kind}/{c.name}"
            text = change_text((f.path, f.before, f.after) for f in c.changes)
            if len(text) > APPLY_CHANGE_CHARS:
                text = text[: APPLY_CHANGE_CHARS - 3] + "..."
            size = len(json.dumps([key, text], ensure_ascii=False).encode())
            if size > budget:
                break
            shown[key], budget = text, budget - size
        if len(shown) < len(told):
            detail["more"] = f"{len(told) - len(shown)} more objects' changes not shown"
        detail.update(shown)
    return "topology", detail
