"""Global rate limiting at the proxy: shares of fleet-wide limits, enforced locally.

`RateLimiter` admits requests against this proxy's shares; `tokens` estimates
what a request will cost before the origin says. docs/rate-limits.md describes
the scheme; `controlplane.quota` computes the shares.
"""

from dataplane.ratelimit.bucket import TokenBucket
from dataplane.ratelimit.limiter import UNLIMITED, Admission, Limit, RateLimiter, format_duration
from dataplane.ratelimit.tokens import (
    estimate_prompt_tokens,
    estimate_stream_tokens,
    estimate_text_tokens,
)
from ponto.quota_types import Demand, ScopeLimits, Share

__all__ = [
    "UNLIMITED",
    "Admission",
    "Demand",
    "Limit",
    "RateLimiter",
    "ScopeLimits",
    "Share",
    "TokenBucket",
    "estimate_prompt_tokens",
    "estimate_stream_tokens",
    "estimate_text_tokens",
    "format_duration",
]
