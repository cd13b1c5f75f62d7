"""What to fix when a call to the control plane fails on the way there: the
advice pontoctl prints and the proxy logs, from gRPC's status and words.

Shared so that an operator reading a proxy's log gets the advice pontoctl
gives for the same mistake (a wrong CA, no client certificate, a name the
certificate does not list, a wrong token). Pure: the caller passes gRPC's
status code and detail, the address it tried and the credentials it used.

The words matched are gRPC core's (BoringSSL's reasons inside them), as gRPC
1.85 says them; a wording they miss still gets gRPC's detail and the general
advice.
"""

from __future__ import annotations

from dataclasses import dataclass

from ponto.grpcconn import ClientOptions


@dataclass(frozen=True)
class Flags:
    """How the caller names its TLS settings: pontoctl takes each also from an
    environment variable; the proxy takes flags only."""

    env: bool = True

    def address(self) -> str:
        """Where the caller takes the control plane's address from."""
        return "--control-plane (or PONTO_CONTROL_PLANE)" if self.env else "--control-plane"

    def tls(self, *which: str) -> str:
        """`--tls-ca, --tls-cert and --tls-key (or PONTO_TLS_CA, ...)` for `which`
        among "ca", "cert", "key"."""
        flags = _and([f"--tls-{w}" for w in which])
        if not self.env:
            return flags
        return f"{flags} (or {_and([f'PONTO_TLS_{w.upper()}' for w in which])})"


PONTOCTL = Flags(env=True)
PROXY = Flags(env=False)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def unreachable(detail: str, address: str, options: ClientOptions, flags: Flags = PONTOCTL) -> str:
    """The message of a call that never reached the control plane (UNAVAILABLE
    with gRPC's `detail`): what gRPC said, and the TLS setting to look at when
    its words show which one failed."""
    said = detail.lower()
    where = f"control plane at {address}"
    if "connection refused" in said:
        # Nothing listens there, TLS or not: no TLS setting would help, and a
        # newcomer without the address set got only TLS advice (trial 35).
        return (
            f"{where} is unreachable: nothing listens at {address} ({detail}); check the "
            f"address ({flags.address()}) and that the control plane runs"
        )
    if not options.secure:
        return (
            f"{where} is unreachable ({detail}); if it requires TLS, give "
            f"{flags.tls('ca', 'cert', 'key')}"
        )
    if "wrong_version_number" in said:  # the answer to our ClientHello was no TLS
        leave_out = flags.tls("ca", "cert", "key").replace("(or ", "(and ")
        return (
            f"{where} does not answer TLS ({detail}); if it runs without TLS, leave out "
            f"{leave_out}, else check that {address} is its gRPC address (its --listen, not "
            "its status page's or etcd's)"
        )
    if "hostname verification" in said:
        return (
            f"TLS handshake with the {where} failed: its certificate does not list the "
            f"name or address used to reach it ({detail}); give --control-plane one it lists"
        )
    # Checked before the CA: BoringSSL says CERTIFICATE_VERIFY_FAILED of these
    # too, and no CA would help.
    if "certificate has expired" in said:
        return (
            f"TLS handshake with the {where} failed: its certificate has expired ({detail}); "
            "the control plane needs a new certificate (ponto-control --tls-cert and --tls-key)"
        )
    if "certificate is not yet valid" in said:
        return (
            f"TLS handshake with the {where} failed: its certificate is not yet valid "
            f"({detail}); check the clocks of this machine and of the control plane, or "
            "wait until the certificate's start"
        )
    if "handshake failed" in said and "certificate" in said:  # e.g. CERTIFICATE_VERIFY_FAILED
        return (
            f"TLS handshake with the {where} failed: its certificate is not trusted by the "
            f"CA in {options.tls_ca} ({detail}); give the CA that signed the control plane's "
            f"certificate with {flags.tls('ca')}"
        )
    if "handshake failed" in said:
        return f"TLS handshake with the {where} failed ({detail})"
    if "security handshaker" in said:
        # The client's own TLS files are unusable: gRPC says the same of a CA,
        # a certificate or a key it cannot read, or a key not the certificate's.
        check = (
            f"that the CA {options.tls_ca}, the client certificate {options.tls_cert} and "
            f"key {options.tls_key} are PEM files and that the key is the certificate's"
            if options.tls_cert
            else f"that the CA {options.tls_ca} is a PEM file"
        )
        return (
            f"{where} is unreachable: the TLS files given cannot be used ({detail}); check {check}"
        )
    message = f"{where} is unreachable ({detail})"
    if "socket closed" not in said or "stream removed" in said:
        # Nothing was reached (connection refused, a name that does not
        # resolve, no route), or a session under way was cut (gRPC's "Stream
        # removed": the control plane stopped or its node was lost): no TLS
        # setting would help.
        return message
    if not options.tls_cert:
        # Under mutual TLS the control plane ends the handshake of a client
        # without a certificate, which gRPC reports as "Socket closed".
        return (
            f"{message}; no client certificate was given and a control plane with mutual "
            f"TLS requires one: give {flags.tls('cert', 'key')}"
        )
    return (
        f"{message}; a control plane with mutual TLS closes the connection when it does "
        f"not trust the client certificate: check that {options.tls_cert} is signed by "
        "its client CA (ponto-control --tls-client-ca) and has not expired, and that "
        f"{address} is its gRPC address (its --listen: a server that is no control plane, "
        "such as etcd, closes it too)"
    )


def stopping(replica_id: str) -> str:
    """The detail a replica ends its proxies' streams with (UNAVAILABLE) as
    it stops (controlplane.api.routing); `replica_stopping` knows it."""
    return f"control plane {replica_id} is shutting down"


def replica_stopping(code: str, detail: str) -> bool:
    """Whether a session ended as its control-plane replica stopped, in the
    replica's own words (`stopping`): a step of a rolling restart, which no
    setting of the caller's caused."""
    return (
        code == "UNAVAILABLE"
        and detail.startswith("control plane ")
        and detail.endswith(" is shutting down")
    )


def proxy_refused(code: str, detail: str, address: str, options: ClientOptions) -> str:
    """The proxy's log line for a failed session with the control plane at
    `address`: gRPC's status name `code` and `detail`, and what to fix, naming
    the proxy's flags. Never the token."""
    if code == "UNAVAILABLE" and "state store" not in detail:
        return f"{unreachable(detail, address, options, PROXY)} [UNAVAILABLE]"
    advice = ""
    if code == "UNAUTHENTICATED":
        if "client certificate expired" in detail:  # a stream ended as its certificate did
            advice = " (--tls-cert and --tls-key)"
        elif "not this control plane's" in detail:
            advice = f"; check the bootstrap token in {options.token_source or 'use'}"
        else:
            advice = "; give the bootstrap token with --bootstrap-token-file"
    elif code == "PERMISSION_DENIED":
        advice = "; give this proxy a certificate of role proxy with --tls-cert and --tls-key"
    return f"control plane at {address}: {detail}{advice} [{code}]"
