"""OpenTelemetry traces of proxied requests (off unless the OTEL_* variables ask).

Off by default and then free: this package's modules that the proxy imports
(`config`, this one) import no OpenTelemetry code; `dataplane.telemetry.tracing`
does, and is imported only when tracing is on. The request path holds a
`RequestTrace | None` and pays one `is None` check per traced step when off.
"""

from __future__ import annotations

from contextlib import nullcontext

__all__ = ["NO_STEP"]

# What a step runs under when the request is not traced: one shared no-op
# context manager (nullcontext is reentrant and reusable).
NO_STEP: nullcontext[None] = nullcontext()
