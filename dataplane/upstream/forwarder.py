"""Calling origins: ordered failover until one commits to an answer.

Contract: an attempt may be retried on the next candidate only while nothing can
have reached the client: connect error, 5xx, timeout, or a cut before the whole
body (non-streaming) or the first chunk (streaming) arrived. `forward` returns
the committed answer without writing anything; the caller relays it
(`dataplane.streaming.relay`) and releases it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict

from dataplane import jsonio
from dataplane.http.errors import upstream_error
from dataplane.metrics import Metrics
from dataplane.placement.load import LoadBoard
from dataplane.routes import Target
from dataplane.upstream.credentials import CredentialError
from dataplane.upstream.outlier import OutlierDetector, RetryBudget

log = logging.getLogger(__name__)

# Never copied from an origin's response: hop-by-hop headers and those the
# proxy recomputes for the body it sends.
DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
        "set-cookie",
    }
)
# The only request headers sent on to an origin. The client's Authorization is
# never among them: client keys stay at the edge.
FORWARD_REQUEST_HEADERS = ("content-type", "accept", "user-agent")
RETRY_STATUS_MIN = 500


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    connect_timeout: float = 2.0
    # Longest wait for response headers and, on streams, between chunks. A
    # non-streaming origin sends headers only when it has generated everything.
    read_timeout: float = 300.0
    max_attempts: int = 3
    # Whole-request budget across all attempts before the response starts.
    deadline: float = 600.0
    # Client headers sent on to origins besides FORWARD_REQUEST_HEADERS.
    forward_headers: tuple[str, ...] = ()


class _Retryable(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


def sse_error_event(message: str) -> bytes:
    event = {"error": {"message": message, "type": "upstream_error", "code": "stream_interrupted"}}
    return b"data: " + jsonio.dumps(event) + b"\n\ndata: [DONE]\n\n"


@dataclass(slots=True, eq=False)
class OriginAnswer:
    """An origin that has committed to answer: its status and headers, and either
    its whole body (`body`) or, for a stream, its first chunk (`first`) with the
    rest still to read from `content`.

    The caller relays it and then calls `release()`, which returns the
    connection to the pool when the body was read to the end and closes it
    otherwise (which also cancels generation on the origin when the client
    has gone), and ends the request in the origin's outstanding count.
    """

    target: Target
    attempt: int
    status: int
    headers: CIMultiDict[str]
    body: bytes | None
    first: bytes
    _resp: aiohttp.ClientResponse
    _loads: LoadBoard | None = None

    @property
    def streamed(self) -> bool:
        return self.body is None

    @property
    def content(self) -> aiohttp.StreamReader:
        return self._resp.content

    def release(self) -> None:
        self._resp.release()
        loads, self._loads = self._loads, None
        if loads is not None:
            loads.finished(self.target.name)


class Forwarder:
    """Sends a request to origins in order. One per app; safe for concurrent use."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        settings: UpstreamSettings,
        *,
        outliers: OutlierDetector | None = None,
        budget: RetryBudget | None = None,
        loads: LoadBoard | None = None,
    ) -> None:
        self._session = session
        # Counts this proxy's requests in flight per origin, for the picker.
        self.loads = loads or LoadBoard()
        self._metrics = metrics
        self._settings = settings
        self.outliers = outliers or OutlierDetector()
        self.budget = budget or RetryBudget()
        self._forward = FORWARD_REQUEST_HEADERS + tuple(h.lower() for h in settings.forward_headers)
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout, sock_read=settings.read_timeout
        )

    def candidate_limit(self) -> int:
        """Candidates worth ordering: the attempts, plus room for ejected origins."""
        return self._settings.max_attempts + self.outliers.ejected_now()

    def request_headers(self, incoming: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
        """The headers an origin gets: the allowed client headers and the request id."""
        headers: CIMultiDict[str] = CIMultiDict()
        for name in self._forward:
            value = incoming.get(name)
            if value is not None:
                headers[name] = value
        headers["x-request-id"] = request_id
        return headers

    async def forward(
        self, path: str, body: bytes, headers: CIMultiDict[str], candidates: Sequence[Target]
    ) -> OriginAnswer:
        """The first origin (in `candidates`' order, ejected ones last) that
        commits to an answer: a status under 500 and, for a stream, a first
        chunk. Raises ApiError (502, or 504 past the deadline) when none does."""
        loop = asyncio.get_running_loop()
        settings = self._settings
        deadline = loop.time() + settings.deadline
        failures: list[str] = []
        self.budget.deposit()
        ordered = self.outliers.order(candidates)
        for attempt, target in enumerate(ordered[: settings.max_attempts], start=1):
            remaining = deadline - loop.time()
            if remaining <= 0:
                failures.append("request deadline exceeded")
                break
            if attempt > 1 and not self.budget.try_retry():
                failures.append("retry budget exhausted")
                self._metrics.retries_refused.inc()
                break
            try:
                # A timer the socket timeouts cannot replace: an origin that
                # trickles a body never trips the read timeout.
                async with asyncio.timeout(remaining):
                    answer = await self._attempt(target, path, body, headers, attempt)
                self.outliers.success(target.name)
                return answer
            except _Retryable as exc:
                self._metrics.attempt(target.name, exc.outcome).inc()
                failures.append(f"{target.name}: {exc}")
                if self.outliers.failure(target.name):
                    self._metrics.child(self._metrics.ejections, target.name).inc()
                    log.warning("origin %s ejected after repeated failures", target.name)
                log.warning("origin %s failed (%s); %s", target.name, exc, headers["x-request-id"])
            except TimeoutError:
                self._metrics.attempt(target.name, "deadline").inc()
                failures.append(f"{target.name}: request deadline exceeded")
                self.outliers.failure(target.name)
                break
        raise upstream_error(
            f"no origin could serve the request after {len(failures)} attempt(s): "
            + "; ".join(failures),
            504 if failures and failures[-1].endswith("deadline exceeded") else 502,
        )

    async def _attempt(
        self,
        target: Target,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        attempt: int,
    ) -> OriginAnswer:
        if target.credential is not None:
            try:
                authorization = target.credential.authorization()
            except CredentialError as exc:
                raise _Retryable("credential_error", exc.client_message) from exc
            if authorization is not None:
                headers = headers.copy()
                headers["authorization"] = authorization
        loads = self.loads
        loads.started(target.name)
        try:
            resp = await self._session.post(
                target.url(path), data=body, headers=headers, timeout=self._timeout
            )
        except TimeoutError as exc:
            loads.finished(target.name)
            raise _Retryable("timeout", "timed out before the response started") from exc
        except aiohttp.ClientError as exc:
            loads.finished(target.name)
            raise _Retryable("connect_error", f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            loads.finished(target.name)
            raise
        try:
            if resp.status >= RETRY_STATUS_MIN:
                raise _Retryable("http_5xx", f"answered {resp.status}")
            streamed = resp.content_type == "text/event-stream"
            body_read: bytes | None = None
            first = b""
            try:
                if streamed:
                    # Until the client has seen a byte, a failing origin can
                    # still be replaced by the next one: wait for the first chunk.
                    first = await resp.content.readany()
                else:
                    body_read = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _Retryable("cut", f"response cut before it was complete: {exc}") from exc
            if streamed and not first:
                raise _Retryable("cut", "stream ended before its first chunk")
            if not streamed:
                self._metrics.attempt(target.name, "ok").inc()
            return OriginAnswer(
                target, attempt, resp.status, _copy(resp), body_read, first, resp, loads
            )
        except BaseException:
            resp.release()
            loads.finished(target.name)
            raise


def _copy(resp: aiohttp.ClientResponse) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in resp.headers.items():
        if name.lower() not in DROP_RESPONSE_HEADERS:
            out.add(name, value)
    return out
