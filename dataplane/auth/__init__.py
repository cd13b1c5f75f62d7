"""Authentication at the proxy: who is calling (`Authenticator`), and what the
proxy presents upstream on an origin's behalf (`OriginCredentials`).

Self-contained like `dataplane.geo`: nothing here imports aiohttp or the rest
of the proxy. The request path maps `AuthError` to a 401 and
`CredentialError` to a 502, both in the OpenAI error shape.
"""

from dataplane.auth.authenticator import (
    DEFAULT_TENANT,
    OPEN_PRINCIPAL,
    SUPPORTED_JWT_ALGORITHMS,
    AuthConfigError,
    Authenticator,
    AuthError,
    JwtConfig,
    KeyRecord,
    Principal,
)
from dataplane.auth.credentials import CredentialError, OriginCredentials

__all__ = [
    "DEFAULT_TENANT",
    "OPEN_PRINCIPAL",
    "SUPPORTED_JWT_ALGORITHMS",
    "AuthConfigError",
    "AuthError",
    "Authenticator",
    "CredentialError",
    "JwtConfig",
    "KeyRecord",
    "OriginCredentials",
    "Principal",
]
