"""Steady client load from a thread, for tests that break things underneath it."""

from __future__ import annotations

import threading
import time

import httpx

BODY = {"model": "sim-small", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


class SteadyLoad:
    """Sequential non-streaming requests until stopped (at most 5000).

    Records (monotonic time, status code or exception name, x-ponto-region).
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers or {}
        self.results: list[tuple[float, int | str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def codes(self) -> list[int | str]:
        return [code for _, code, _ in self.results]

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set() and len(self.results) < 5000:
                try:
                    r = client.post(self.url, json=BODY, headers=self.headers)
                    outcome: tuple[int | str, str] = (
                        r.status_code,
                        r.headers.get("x-ponto-region", ""),
                    )
                except httpx.HTTPError as exc:
                    outcome = (type(exc).__name__, "")
                self.results.append((time.monotonic(), *outcome))
                time.sleep(0.005)

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
