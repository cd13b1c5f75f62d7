"""Authentication at the proxy: who is calling (`Authenticator`).

Self-contained like `dataplane.geo`: nothing here imports aiohttp or the rest
of the proxy. The request path maps `AuthError` to a 401 and `AuthUnavailable`
to a 503 in the OpenAI error shape. What the proxy presents to origins is
`dataplane.upstream.credentials`.
"""

from dataplane.auth.authenticator import (
    DEFAULT_TENANT,
    OPEN_PRINCIPAL,
    SUPPORTED_JWT_ALGORITHMS,
    AuthConfigError,
    Authenticator,
    AuthError,
    AuthUnavailable,
    JwtConfig,
    KeyRecord,
    Principal,
)

__all__ = [
    "DEFAULT_TENANT",
    "OPEN_PRINCIPAL",
    "SUPPORTED_JWT_ALGORITHMS",
    "AuthConfigError",
    "AuthError",
    "AuthUnavailable",
    "Authenticator",
    "JwtConfig",
    "KeyRecord",
    "Principal",
]
