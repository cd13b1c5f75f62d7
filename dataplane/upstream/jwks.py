"""The proxy's fetch of issuers' JWKS URLs (for dataplane.auth.remote), on aiohttp.

A GET of the URL, with the trust the proxy has for origins (the system's CAs
and --origin-ca), answered 200 within FETCH_TIMEOUT_S, in at most
MAX_JWKS_BYTES (after any content coding: a set is some kilobytes, and a
large answer is not one). Redirects are not followed: a JWKS URL is the
address an identity provider publishes, and a redirect could take an https
URL to http. The proxy's environment's HTTP proxies are not used, as for
origins.
"""

from __future__ import annotations

import ssl

import aiohttp

from dataplane.auth.remote import Fetched, JwksFetchError

FETCH_TIMEOUT_S = 10.0
MAX_JWKS_BYTES = 1 << 20
_ACCEPT = "application/jwk-set+json, application/json"


class HttpFetch:
    """Fetches JWKS URLs over one aiohttp session, made at the first fetch
    (on the event loop) and closed by `close`."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None,
        user_agent: str,
        *,
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._timeout_s = timeout_s
        self._headers = {"accept": _ACCEPT, "user-agent": user_agent}
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, url: str) -> Fetched:
        session = self._session
        if session is None:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=8),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                headers=self._headers,
            )
        try:
            async with session.get(url, allow_redirects=False) as response:
                status = response.status
                if status != 200:
                    raise JwksFetchError(
                        f"answered HTTP {status}"
                        + (
                            " (a redirect, which is not followed: give the URL it names)"
                            if 300 <= status < 400
                            else ""
                        )
                    )
                declared = response.content_length
                if declared is not None and declared > MAX_JWKS_BYTES:
                    raise JwksFetchError(_too_large())
                body = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > MAX_JWKS_BYTES:
                        raise JwksFetchError(_too_large())
                cache_control = ", ".join(response.headers.getall("cache-control", ()))
                return Fetched(bytes(body), cache_control)
        except TimeoutError:
            raise JwksFetchError(f"no answer within {self._timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise JwksFetchError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _too_large() -> str:
    return f"answered more than {MAX_JWKS_BYTES >> 10} KB, which is no key set"
