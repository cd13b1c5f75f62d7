"""A canned-answer origin on Debian's nginx: the same chat completion for every request.

    with CannedOrigin(workdir, cpus={1}) as origin:
        ...  # POST origin.url + "/chat/completions"

Why: bench/compare.py measures each server's CPU per request with wrk's closed
loop, and only at saturation is that figure the server's own cost (below it,
every request also pays the epoll wake-ups of an idle loop). The origin
simulator (ponto.originsim) is Python and costs about as much per request as
the proxy in front of it, so on a two-CPU machine the origin's CPU saturates
first and the server under test never does. nginx answering from its config
costs some 13 us per request: whatever the load, the server under test is the
bottleneck.

What it answers: every request, whatever its method, path and body, gets
``200`` with ANSWER, an OpenAI ``chat.completion`` for CANNED_MODEL with
``finish_reason: "length"`` and ``usage``, so that Ponto counts its tokens and
its exact cache stores it (store_truncated) exactly as it does the simulator's
answers. The body is fixed, so a request that asks for a stream still gets
this JSON (the wrk phases send non-streaming bodies).

Streams, for bench/instructions.py's stream mode: with ``streams=(16, 64)``
the paths under ``/s16/`` and ``/s64/`` answer every request with
``stream_answer(16)`` and ``stream_answer(64)`` as ``text/event-stream``: an
OpenAI/vLLM chat stream of that many content events (a role event first, a
finishing event, a usage event and ``data: [DONE]`` after them), for the
model ``stream_model(n)`` (register ``STREAM_URL`` of each as an origin of
its own). nginx cannot read the body to tell a streamed request from another,
so a stream is told by its path; and it sends the answer as one body with a
Content-Length, written at once, so a proxy reads all its events in one or a
few reads, where an origin that generates sends about one event a read: what
such a stream measures is the work per event, not per read.

nginx runs as one master and one worker (``worker_processes 1``), in the
foreground, with every file it writes (pid, error log, temporary bodies)
inside the work dir; keep-alive connections are neither closed after a number
of requests nor after a short idle time, so a closed loop never reconnects.
Measure its CPU as the tree of ``pid`` (the master's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from bench.procs import affinity, process_tree
from ponto.devenv import free_port

CANNED_MODEL = "canned"
ANSWER = json.dumps(
    {
        "id": "chatcmpl-canned",
        "object": "chat.completion",
        "created": 1,
        "model": CANNED_MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "pong pong pong pong"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17},
    },
    separators=(",", ":"),
)


def stream_model(tokens: int) -> str:
    """The model whose streams have `tokens` content events (see the module)."""
    return f"{CANNED_MODEL}-s{tokens}"


def stream_path(tokens: int) -> str:
    """The path prefix that answers streams of `tokens` content events; the
    origin's base URL is this and ``v1``."""
    return f"/s{tokens}/"


def stream_answer(tokens: int) -> str:
    """A chat completion stream as vLLM sends it when asked for usage
    (`stream_options.include_usage`): a role event, `tokens` events of one
    token of content each, a finishing event (`finish_reason: "length"`, so
    that a cache that stores truncated answers records it), a usage event with
    no choices, and `data: [DONE]`; LF line endings, each event its own."""
    head = {"id": "chatcmpl-canned", "object": "chat.completion.chunk", "created": 1,
            "model": stream_model(tokens)}  # fmt: skip

    def event(choices: list[dict[str, object]], **extra: object) -> str:
        return "data: " + json.dumps({**head, "choices": choices, **extra},
                                     separators=(",", ":")) + "\n\n"  # fmt: skip

    def choice(delta: dict[str, str], finish: str | None = None) -> dict[str, object]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    events = [event([choice({"role": "assistant", "content": ""})])]
    events += [event([choice({"content": " pong"})]) for _ in range(tokens)]
    events.append(event([choice({}, "length")]))
    usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens}
    events.append(event([], usage=usage))
    events.append("data: [DONE]\n\n")
    return "".join(events)


INSTALL_HINT = "apt-get install -y nginx-light (as root; `make bench` does it)"
# Debian installs nginx in /usr/sbin, which a user's PATH often lacks.
SBIN_NGINX = Path("/usr/sbin/nginx")
HOST = "127.0.0.1"


class NginxMissing(RuntimeError):
    """nginx is not installed; the message says how to install it."""


def find_nginx() -> str:
    """The nginx binary's path (PATH, then /usr/sbin); raises NginxMissing if there is none."""
    found = shutil.which("nginx")
    if found is not None:
        return found
    if os.access(SBIN_NGINX, os.X_OK):
        return str(SBIN_NGINX)
    raise NginxMissing(f"nginx is not installed (the canned origin needs it): {INSTALL_HINT}")


def nginx_string(text: str) -> str:
    """`text` as an nginx single-quoted string that nginx reads back as exactly `text`.

    nginx unescapes ``\\\\`` and ``\\'`` inside quotes (and leaves other
    backslashes alone, so every backslash is escaped). ``$`` cannot be escaped
    in a ``return`` text (it starts a variable): a text holding one is refused
    with ValueError, as is a NUL.
    """
    if "$" in text or "\0" in text:
        raise ValueError("an nginx return text cannot hold '$' or NUL")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def config(workdir: Path, port: int, answer: str = ANSWER, streams: tuple[int, ...] = ()) -> str:
    """nginx.conf for a canned origin on HOST:`port`, its files inside `workdir`
    (an absolute path), with a location for each of `streams`; see the module
    docstring."""
    d = workdir
    locations = "".join(_stream_location(n) for n in streams)
    return f"""\
worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    keepalive_requests 1000000000;
    keepalive_timeout 3600s;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    server {{
        listen {HOST}:{port};
        location / {{
            default_type application/json;
            return 200 {nginx_string(answer)};
        }}{locations}
    }}
}}
"""


# nginx reads a config token of at most about 4 KB: a longer answer is set in
# pieces of this many characters, and returned as their concatenation.
PIECE_CHARS = 3000


def _stream_location(tokens: int) -> str:
    answer = stream_answer(tokens)
    pieces = [answer[at : at + PIECE_CHARS] for at in range(0, len(answer), PIECE_CHARS)]
    sets = "".join(
        f"\n            set $s{tokens}_{i} {nginx_string(piece)};" for i, piece in enumerate(pieces)
    )
    joined = "".join(f"$s{tokens}_{i}" for i in range(len(pieces)))
    return f"""
        location {stream_path(tokens)} {{
            default_type text/event-stream;{sets}
            return 200 "{joined}";
        }}"""


class CannedOrigin:
    """nginx answering `answer` on a free loopback port, pinned to `cpus`.

    Entering starts it and returns once it answers a POST (raises RuntimeError
    with its error log if it exits or stays silent for `timeout` seconds, and
    NginxMissing if there is no nginx); leaving stops it. The caller owns
    `workdir` (created if missing; nginx's files go there and are left for the
    caller to remove). Not thread-safe; one start per instance.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        cpus: set[int] | None = None,
        answer: str = ANSWER,
        streams: tuple[int, ...] = (),
        timeout: float = 10.0,
    ) -> None:
        self.workdir = workdir.resolve()
        self.cpus = cpus
        self.answer = answer
        self.streams = streams
        self.timeout = timeout
        self.address = ""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The master's pid (its worker is its child); 0 before start."""
        return self._proc.pid if self._proc is not None else 0

    @property
    def url(self) -> str:
        """The OpenAI-style base URL, ``http://HOST:PORT/v1``."""
        return f"http://{self.address}/v1"

    def __enter__(self) -> CannedOrigin:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Write the config, start nginx and wait until it answers (see the class)."""
        binary = find_nginx()
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = free_port(HOST)
        conf = self.workdir / "nginx.conf"
        conf.write_text(config(self.workdir, port, self.answer, self.streams))
        self.address = f"{HOST}:{port}"
        # -e: the error log before the config is read (else nginx tries /var/log/nginx).
        argv = [binary, "-c", str(conf), "-p", f"{self.workdir}/",
                "-e", str(self.workdir / "error.log")]  # fmt: skip
        with affinity(self.cpus):
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        try:
            self._wait_answering()
        except BaseException:
            self.stop()
            raise

    def _wait_answering(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.timeout
        request = urllib.request.Request(self.url + "/chat/completions", data=b"{}", method="POST")
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self._proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=1) as resp:
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nginx not answering on {self.address} after {self.timeout:.0f} s: "
                    f"{self.log_tail()}"
                )
            time.sleep(0.02)

    def log_tail(self, chars: int = 1000) -> str:
        """The end of nginx's error log ('' if there is none)."""
        try:
            return (self.workdir / "error.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (nginx's fast shutdown), then SIGKILL to master and worker after
        `timeout` seconds; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        tree = process_tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in tree:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
