"""The roles a client certificate can state, shared by the PKI that issues
certificates (ponto.pki, the Helm chart) and the control plane that checks them
(controlplane.api.guard).

A certificate states its role as a URI subject alternative name
`spiffe://ponto/role/<role>`, SPIFFE's form for a workload identity. Certificates
made by tools that cannot write URI names (Helm's certificate functions) state it
by their subject's common name, `ponto-<role>`. The Helm chart's control-plane
certificate (`ponto-control-plane`, which has the client usage for the liveness
probe) counts as admin: `kubectl exec deploy/ponto-control -- pontoctl ...`, as
the chart's NOTES print it, runs with it, and that pod holds the admin token
anyway.
"""

from __future__ import annotations

from typing import Final

PROXY: Final = "proxy"  # calls the Routing API
ADMIN: Final = "admin"  # calls the Admin API
ROLES: Final = (PROXY, ADMIN)

URI_PREFIX: Final = "spiffe://ponto/role/"
COMMON_NAMES: Final = {**{f"ponto-{role}": role for role in ROLES}, "ponto-control-plane": ADMIN}


def role_uri(role: str) -> str:
    """The URI subject alternative name that gives a certificate `role`."""
    return URI_PREFIX + role
