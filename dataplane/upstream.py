"""Calling origins: ordered failover before the first byte, then a committed relay.

Contract: an attempt may be retried on the next candidate only while nothing has
been sent to the client (connect error, 5xx, timeout or a cut before the first
body chunk). Once the response has started, a failure ends it: a non-streaming
response cannot be started (its body is read whole first), and a stream is
closed with a well-formed SSE error event and `data: [DONE]`, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from dataplane import jsonio
from dataplane.auth.credentials import CredentialError
from dataplane.errors import upstream_error
from dataplane.metrics import Metrics
from dataplane.outlier import OutlierDetector, RetryBudget
from dataplane.routes import Target

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


class StreamTap(Protocol):
    """Sees every chunk relayed to the client, then how the stream ended."""

    def feed(self, chunk: bytes) -> None: ...

    def end(self, complete: bool) -> None:
        """complete: the origin ended the stream and the client got all of it."""
        ...


class _Retryable(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


def sse_error_event(message: str) -> bytes:
    event = {"error": {"message": message, "type": "upstream_error", "code": "stream_interrupted"}}
    return b"data: " + jsonio.dumps(event) + b"\n\ndata: [DONE]\n\n"


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
    ) -> None:
        self._session = session
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

    def _headers(self, request: web.Request, request_id: str) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict()
        for name in self._forward:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        headers["x-request-id"] = request_id
        return headers

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        candidates: list[Target],
        request_id: str,
        *,
        extra_headers: Sequence[tuple[str, str]] = (),
        tap: StreamTap | None = None,
    ) -> web.StreamResponse:
        """Answer from the first origin that responds; extra_headers go on the
        response; tap sees a streamed response's chunks."""
        headers = self._headers(request, request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.deadline
        failures: list[str] = []
        self.budget.deposit()
        ordered = self.outliers.order(candidates)
        for attempt, target in enumerate(ordered[: self._settings.max_attempts], start=1):
            remaining = deadline - loop.time()
            if remaining <= 0:
                failures.append("request deadline exceeded")
                break
            if attempt > 1 and not self.budget.try_retry():
                failures.append("retry budget exhausted")
                self._metrics.retries_refused.inc()
                break
            try:
                async with asyncio.timeout(remaining):
                    response = await self._attempt(
                        request, target, path, body, headers, attempt, extra_headers, tap
                    )
                self.outliers.success(target.name)
                return response
            except _Retryable as exc:
                self._metrics.attempt(target.name, exc.outcome).inc()
                failures.append(f"{target.name}: {exc}")
                if self.outliers.failure(target.name):
                    self._metrics.child(self._metrics.ejections, target.name).inc()
                    log.warning("origin %s ejected after repeated failures", target.name)
                log.warning("origin %s failed (%s); %s", target.name, exc, request_id)
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
        request: web.Request,
        target: Target,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        attempt: int,
        extra_headers: Sequence[tuple[str, str]],
        tap: StreamTap | None,
    ) -> web.StreamResponse:
        if target.credential is not None:
            try:
                authorization = target.credential.authorization()
            except CredentialError as exc:
                raise _Retryable("credential_error", exc.client_message) from exc
            if authorization is not None:
                headers = headers.copy()
                headers["authorization"] = authorization
        try:
            resp = await self._session.post(
                target.url(path), data=body, headers=headers, timeout=self._timeout
            )
        except TimeoutError as exc:
            raise _Retryable("timeout", "timed out before the response started") from exc
        except aiohttp.ClientError as exc:
            raise _Retryable("connect_error", f"{type(exc).__name__}: {exc}") from exc
        try:
            if resp.status >= RETRY_STATUS_MIN:
                raise _Retryable("http_5xx", f"answered {resp.status}")
            extra = {
                "x-ponto-origin": target.name,
                "x-ponto-region": target.region,
                "x-ponto-attempts": str(attempt),
                "x-request-id": headers["x-request-id"],
            }
            extra.update(extra_headers)
            if resp.content_type == "text/event-stream":
                return await self._relay_stream(request, resp, target, extra, tap)
            try:
                data = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _Retryable("cut", f"response cut before it was complete: {exc}") from exc
            self._metrics.attempt(target.name, "ok").inc()
            out = web.Response(status=resp.status, body=data, headers=self._copy(resp, extra))
            return out
        finally:
            # Closes the connection unless the body was read to the end, which
            # also cancels generation on the origin when the client has gone.
            resp.release()

    def _copy(self, resp: aiohttp.ClientResponse, extra: dict[str, str]) -> CIMultiDict[str]:
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in resp.headers.items():
            if name.lower() not in DROP_RESPONSE_HEADERS:
                out.add(name, value)
        out.update(extra)
        return out

    async def _relay_stream(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        target: Target,
        extra: dict[str, str],
        tap: StreamTap | None,
    ) -> web.StreamResponse:
        # Wait for the first chunk before answering: until the client has seen a
        # byte, a failing origin can still be replaced by the next one.
        try:
            first = await resp.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Retryable("cut", f"stream failed before its first chunk: {exc}") from exc
        if not first:
            raise _Retryable("cut", "stream ended before its first chunk")
        out = web.StreamResponse(status=resp.status, headers=self._copy(resp, extra))
        out.headers["cache-control"] = "no-cache"
        await out.prepare(request)
        complete = False
        try:
            if tap is not None:
                tap.feed(first)
            await out.write(first)
            while True:
                try:
                    chunk = await resp.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self._metrics.child(self._metrics.stream_cuts, target.name).inc()
                    self._metrics.attempt(target.name, "cut_after_start").inc()
                    log.warning("origin %s cut a stream: %s", target.name, exc)
                    await out.write(sse_error_event(f"origin {target.name} failed mid-stream"))
                    break
                if not chunk:
                    if not resp.content.is_eof():  # pragma: no cover - defensive
                        continue
                    self._metrics.attempt(target.name, "ok").inc()
                    complete = True
                    break
                if tap is not None:
                    tap.feed(chunk)
                # write() waits for the client's socket to drain: backpressure
                # reaches the origin through the unread upstream socket.
                await out.write(chunk)
            await out.write_eof()
        except ConnectionResetError:
            # The client went away; leaving returns through release(), which
            # closes the origin connection and so cancels its generation.
            complete = False
            self._metrics.client_disconnects.inc()
        finally:
            # Also on cancellation (the client vanished mid-write): a tap must
            # learn the stream did not end properly.
            if tap is not None:
                tap.end(complete)
        return out
