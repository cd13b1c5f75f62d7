"""Control plane settings: parsed once, frozen, validated."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from controlplane import audit
from controlplane.compaction import DEFAULT_INTERVAL_S as DEFAULT_COMPACTION_S
from controlplane.health import ProbeSettings
from controlplane.store.etcd import CALL_TIMEOUT_S, EtcdTls, split_endpoint
from ponto import tlsfiles
from ponto.cliargs import OneLineParser, finite_float, hostport, listen_address, path
from ponto.grpcconn import CredentialError, ServerSecurity, read_bytes, read_secrets
from ponto.originca import origin_ca_flag
from ponto.version import add_version_flag


@dataclass(frozen=True, slots=True)
class Settings:
    etcd: tuple[str, ...]
    listen: str
    replica_id: str
    debounce_quiet: float
    debounce_max: float
    lease_ttl: int
    ready_file: Path | None
    log_level: str
    leader_ttl: int = 5
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    security: ServerSecurity = field(default_factory=ServerSecurity)
    health_listen: str = ""
    quota_interval: float = 1.0
    # How often a replica writes its proxies' traffic reports to etcd (when
    # they changed): the status page's rates' window is three of these.
    traffic_interval: float = 5.0
    etcd_tls: EtcdTls | None = None  # None: plaintext to etcd
    # EtcdStore's call timeout (the hidden --etcd-timeout-ms: tests only).
    etcd_timeout: float = CALL_TIMEOUT_S
    # How often the leader compacts etcd's history (controlplane.compaction); 0: never.
    etcd_compaction_interval: float = DEFAULT_COMPACTION_S
    audit_retention_days: float = audit.RETENTION_DAYS
    audit_max_entries: int = audit.MAX_ENTRIES
    http_listen: str = ""  # the status page and its API; "" for none
    http_writes: bool = True  # drain and undrain from the page


def parser() -> argparse.ArgumentParser:
    """ponto-control's command line. Each flag with a default says it in
    --help, as ponto-proxy's do (`%(default)s`); one whose default is "" or
    unset says what that means instead, where it is not plain."""
    p = OneLineParser(prog="ponto-control", description="Ponto control plane")
    add_version_flag(p)
    p.add_argument(
        "--etcd",
        default="http://127.0.0.1:2379",
        help="etcd endpoints, comma-separated (http://host:port or https://host:port; "
        "host may be an IP address, IPv6 in brackets as in http://[fd00::1]:2379, or a DNS "
        "name, best one name that resolves to every member; default: %(default)s)",
    )
    p.add_argument(
        "--etcd-ca",
        default="",
        help="CA that signed etcd's server certificates (PEM); enables TLS to etcd, "
        "and https:// endpoints require it (system roots are not used)",
    )
    p.add_argument(
        "--etcd-cert", default="", help="client certificate for etcd (PEM), if etcd asks for one"
    )
    p.add_argument("--etcd-key", default="", help="private key of --etcd-cert (PEM)")
    p.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:7070",
        help="gRPC listen HOST:PORT (port 0: any; default: %(default)s)",
    )
    p.add_argument(
        "--id",
        dest="replica_id",
        default=f"{socket.gethostname()}-{os.getpid()}",
        help="replica id shown to operators (default: this host's name and the process id)",
    )
    p.add_argument(
        "--debounce-quiet-ms",
        type=int,
        default=50,
        help="push after this long without further changes (default: %(default)s)",
    )
    p.add_argument(
        "--debounce-max-ms",
        type=int,
        default=500,
        help="push at the latest this long after the first change (default: %(default)s)",
    )
    p.add_argument(
        "--lease-ttl",
        type=int,
        default=10,
        help="seconds before a dead replica's proxy registrations vanish; keep it above 7 "
        "(a hung replica's proxies leave it within 7 s, and until they do, their "
        "registrations should stand; default: %(default)s)",
    )
    p.add_argument(
        "--leader-ttl",
        type=int,
        default=5,
        help="seconds before a dead leader is replaced (default: %(default)s)",
    )
    p.add_argument(
        "--probe-interval-ms",
        type=int,
        default=1000,
        help="origin probe period in ms (default: %(default)s)",
    )
    p.add_argument(
        "--probe-timeout-ms",
        type=int,
        default=1000,
        help="origin probe timeout in ms (default: %(default)s)",
    )
    p.add_argument(
        "--probe-path",
        default="/health",
        help="health path, resolved against each origin's scheme://host:port "
        "(e.g. /health for vLLM, /v1/models), for the origins without one of their own "
        "(pontoctl origin add --probe-path; default: %(default)s)",
    )
    p.add_argument(
        "--origin-ca",
        default="",
        metavar="FILE",
        help="CA bundle (PEM) trusted for https origins' probes and load scrapes, besides "
        "the system's trust store (give ponto-proxy the same)",
    )
    p.add_argument(
        "--metrics-path",
        default="/metrics",
        help="Prometheus path with vLLM load gauges ('' to skip; default: %(default)s)",
    )
    p.add_argument(
        "--load-interval-ms",
        type=int,
        default=500,
        help="how often the leader scrapes every origin's vLLM load gauges from "
        "--metrics-path and pushes them to the proxies (no route table is rebuilt; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--load-refresh-ms",
        type=int,
        default=2000,
        help="write origin loads at least this often even when they did not change, "
        "so proxies can tell figures that are current from figures no leader updates"
        " (default: %(default)s)",
    )
    p.add_argument(
        "--rise",
        type=int,
        default=2,
        help="successes before an origin is healthy (default: %(default)s)",
    )
    p.add_argument(
        "--fall",
        type=int,
        default=2,
        help="failures before an origin is unhealthy (default: %(default)s)",
    )
    p.add_argument(
        "--quota-interval-ms",
        type=int,
        default=1000,
        help="how often the leader rebalances rate-limit shares from proxies' demand"
        " (default: %(default)s)",
    )
    p.add_argument(
        "--traffic-interval-ms",
        type=int,
        default=5000,
        help="how often this replica writes its proxies' traffic reports to etcd, when they"
        " changed; the status page's rates are over three of these, and a proxy not heard"
        " for as long is shown stale; the same on every replica, at least 1000"
        " (default: %(default)s)",
    )
    p.add_argument(
        "--etcd-compaction-interval-s",
        type=finite_float,
        default=DEFAULT_COMPACTION_S,
        help="how often the leader compacts etcd's history, to what it was one interval"
        " before (etcd keeps every revision until compacted, and refuses writes once its"
        " quota is full); 0: never, for an etcd that compacts itself"
        " (default: %(default)s)",
    )
    # The store's call timeout (CALL_TIMEOUT_S): hidden, for tests that would
    # otherwise wait out 3 s for each call to an etcd that is away.
    p.add_argument(
        "--etcd-timeout-ms", type=int, default=int(CALL_TIMEOUT_S * 1000), help=argparse.SUPPRESS
    )
    p.add_argument(
        "--health-listen",
        type=listen_address,
        help="also serve gRPC health checking alone, in plaintext, on HOST:PORT "
        "(for kubelet grpc probes, which cannot present a client certificate)",
    )
    p.add_argument(
        "--http-listen",
        type=listen_address,
        help="serve the status page (/), its API and Prometheus /metrics on HOST:PORT, in "
        "plain HTTP (default: no HTTP port); see --http-writes for changes from the page",
    )
    p.add_argument(
        "--http-writes",
        choices=["on", "off"],
        help="drain and undrain from the status page (default: on, but off under mutual "
        "TLS: the page cannot check an admin certificate, and the admin token crosses "
        "plain HTTP in the clear)",
    )
    p.add_argument("--tls-cert", default="", help="server certificate (PEM); enables TLS")
    p.add_argument("--tls-key", default="", help="server private key (PEM)")
    p.add_argument(
        "--tls-client-ca",
        default="",
        help="CA that client certificates must chain to; enables mutual TLS",
    )
    p.add_argument(
        "--bootstrap-token-file",
        default="",
        help="file with the token proxies must present to register",
    )
    p.add_argument(
        "--admin-token-file", default="", help="file with the token Admin API callers must present"
    )
    p.add_argument(
        "--audit-retention-days",
        type=finite_float,
        default=audit.RETENTION_DAYS,
        help="the leader removes audit entries older than this (default: %(default)s)",
    )
    p.add_argument(
        "--audit-max-entries",
        type=int,
        default=audit.MAX_ENTRIES,
        help="the leader removes the oldest audit entries beyond this many (default: %(default)s)",
    )
    p.add_argument("--ready-file", type=path, help="write the bound HOST:PORT here when serving")
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (default: %(default)s)",
    )
    return p


def parse(argv: list[str]) -> Settings:
    p = parser()
    a = p.parse_args(argv)
    if a.debounce_quiet_ms < 0 or a.debounce_max_ms < a.debounce_quiet_ms:
        p.error("need 0 <= --debounce-quiet-ms <= --debounce-max-ms")
    if a.lease_ttl < 2:
        p.error("--lease-ttl must be at least 2 seconds")
    if a.leader_ttl < 2:
        p.error("--leader-ttl must be at least 2 seconds")
    if min(a.probe_interval_ms, a.probe_timeout_ms, a.rise, a.fall) < 1:
        p.error("probe interval, timeout, rise and fall must be positive")
    if a.load_interval_ms < 50:
        p.error("--load-interval-ms must be at least 50")
    if a.load_refresh_ms < a.load_interval_ms:
        p.error("--load-refresh-ms must be at least --load-interval-ms")
    http_writes = a.http_writes == "on" if a.http_writes else not a.tls_client_ca
    if http_writes and a.tls_client_ca and not a.admin_token_file:
        p.error("--http-writes on under mutual TLS needs --admin-token-file")
    if not a.probe_path.startswith("/"):
        p.error("--probe-path must start with /")
    etcd = tuple(e.strip() for e in a.etcd.split(",") if e.strip())
    if not etcd:
        p.error("--etcd needs at least one endpoint")
    for endpoint in etcd:
        try:
            split_endpoint(endpoint.partition("://")[2 if "://" in endpoint else 0])
        except ValueError as exc:
            p.error(f"--etcd endpoint {endpoint!r} {exc}")
    try:
        etcd_tls = _etcd_tls(etcd, a.etcd_ca, a.etcd_cert, a.etcd_key)
    except CredentialError as exc:
        p.error(str(exc))
    if not a.audit_retention_days > 0:
        p.error("--audit-retention-days must be more than 0")
    if a.audit_max_entries < 1:
        p.error("--audit-max-entries must be at least 1")
    if a.quota_interval_ms < 50:
        p.error("--quota-interval-ms must be at least 50")
    if a.traffic_interval_ms < 1000:
        # Proxies report about once a second (their --report-interval-ms):
        # a window of three shorter writes would show busy proxies stale.
        p.error("--traffic-interval-ms must be at least 1000")
    if a.etcd_compaction_interval_s != 0 and a.etcd_compaction_interval_s < 1:
        p.error("--etcd-compaction-interval-s must be 0 (never) or at least 1")
    if a.etcd_timeout_ms < 100:
        p.error("--etcd-timeout-ms must be at least 100")
    try:
        # A file may hold several tokens, one a line, all accepted: a token
        # is rotated without a flag day (read_secrets).
        bootstraps = (
            read_secrets(a.bootstrap_token_file, "bootstrap token")
            if a.bootstrap_token_file
            else ()
        )
        admins = read_secrets(a.admin_token_file, "admin token") if a.admin_token_file else ()
        security = ServerSecurity(
            tls_cert=a.tls_cert,
            tls_key=a.tls_key,
            tls_client_ca=a.tls_client_ca,
            bootstrap_token=bootstraps[0] if bootstraps else "",
            other_bootstrap_tokens=bootstraps[1:],
            admin_token=admins[0] if admins else "",
            other_admin_tokens=admins[1:],
        )
        # Fail at start, in one line, not on binding or the first call.
        now = datetime.datetime.now(datetime.UTC)
        security.check_files(now)
        security.server_credentials()
        _check_etcd_files(a.etcd_ca, a.etcd_cert, a.etcd_key, now)
    except CredentialError as exc:
        # One line: the arguments parsed, the files they name are at fault
        # (argparse's error() would put the whole usage before it).
        p.exit(2, f"{p.prog}: error: {exc}\n")
    origin_ssl = origin_ca_flag(p, a.origin_ca)
    return Settings(
        etcd=etcd,
        listen=hostport(*a.listen),
        replica_id=a.replica_id,
        debounce_quiet=a.debounce_quiet_ms / 1000,
        debounce_max=a.debounce_max_ms / 1000,
        lease_ttl=a.lease_ttl,
        ready_file=a.ready_file,
        log_level=a.log_level,
        leader_ttl=a.leader_ttl,
        probe=ProbeSettings(
            interval=a.probe_interval_ms / 1000,
            timeout=a.probe_timeout_ms / 1000,
            path=a.probe_path,
            metrics_path=a.metrics_path,
            rise=a.rise,
            fall=a.fall,
            load_interval=a.load_interval_ms / 1000,
            load_refresh=a.load_refresh_ms / 1000,
            origin_ca=a.origin_ca,
            origin_ssl=origin_ssl,
        ),
        security=security,
        health_listen=hostport(*a.health_listen) if a.health_listen else "",
        quota_interval=a.quota_interval_ms / 1000,
        traffic_interval=a.traffic_interval_ms / 1000,
        etcd_tls=etcd_tls,
        etcd_timeout=a.etcd_timeout_ms / 1000,
        etcd_compaction_interval=a.etcd_compaction_interval_s,
        audit_retention_days=a.audit_retention_days,
        audit_max_entries=a.audit_max_entries,
        http_listen=hostport(*a.http_listen) if a.http_listen else "",
        http_writes=http_writes,
    )


def _check_etcd_files(ca: str, cert: str, key: str, now: datetime.datetime) -> None:
    """CredentialError naming the file unless the etcd CA holds certificates,
    the client key is its certificate's and that certificate is valid at
    `now` for a TLS client, as for the replica's own TLS files: the replica
    otherwise started, said it served, and retried etcd for good with gRPC's
    handshake errors (trial 23)."""
    try:
        if ca:
            tlsfiles.certificates(read_bytes(ca, "etcd CA certificate"), ca, "etcd CA")
        if cert and key:
            pair = tlsfiles.check_pair(
                read_bytes(cert, "etcd client certificate"),
                cert,
                read_bytes(key, "etcd client key"),
                key,
            )
            tlsfiles.check_validity(pair, cert, "etcd client certificate", now)
            tlsfiles.check_purpose(
                pair, cert, "etcd client certificate", tlsfiles.CLIENT_AUTH, any_usage=True
            )
    except tlsfiles.TlsFileError as exc:
        raise CredentialError(str(exc)) from None


def _etcd_tls(endpoints: tuple[str, ...], ca: str, cert: str, key: str) -> EtcdTls | None:
    """TLS to etcd from the flags, checked against the endpoints' schemes.

    The scheme and --etcd-ca must agree: https:// without a CA is refused
    rather than trusting system roots (etcd is signed by its own CA), and a CA
    with http:// is refused rather than guessing which one was meant. Bare
    host:port endpoints follow --etcd-ca.
    """
    schemes = {e.partition("://")[0] if "://" in e else "" for e in endpoints}
    if schemes - {"http", "https", ""}:
        raise CredentialError("--etcd endpoints must be http://, https:// or bare host:port")
    if {"http", "https"} <= schemes:
        raise CredentialError("--etcd mixes http:// and https:// endpoints")
    if "https" in schemes and not ca:
        raise CredentialError(
            "https:// etcd endpoints need --etcd-ca (the CA that signed etcd's certificates)"
        )
    if ca and "http" in schemes:
        raise CredentialError("--etcd-ca is given but --etcd says http://; write https://")
    if bool(cert) != bool(key):
        raise CredentialError("give both --etcd-cert and --etcd-key, or neither")
    if cert and not ca:
        raise CredentialError("--etcd-cert needs --etcd-ca to verify etcd")
    if not ca:
        return None
    return EtcdTls(
        ca_cert=read_bytes(ca, "etcd CA certificate"),
        cert_chain=read_bytes(cert, "etcd client certificate") if cert else None,
        cert_key=read_bytes(key, "etcd client key") if key else None,
    )
