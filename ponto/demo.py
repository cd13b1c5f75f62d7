"""`ponto-demo`: the whole system on one machine, with one command.

Without flags it starts etcd, a control plane, a simulated origin in each of
three regions and proxies in two of them (with redis-server: a second us-east
proxy and a Redis per region with proxies, each region's shared cache), prints
how to use them, and stays up until Ctrl-C, starting again any of its processes
that dies (kill an origin to watch failover). With --check it starts the same
topology, proves the product's promises with the official openai client
(streaming, the regional cache, failover of the control plane, restart from the
saved table) and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ponto import devenv
from ponto.fleet import (
    DEMO_PROXIES,
    DEMO_REGIONS,
    DEMO_SECOND_PROXY,
    DEMO_USERS,
    DemoUser,
    Fleet,
    start_demo_fleet,
)
from ponto.supervise import Supervisor
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def port_free(port: int) -> bool:
    """Whether `port` can be listened on at 127.0.0.1, as the demo's servers
    bind (SO_REUSEADDR: a port whose last connections are in TIME_WAIT is
    free to them; without it, a demo started again right after one stopped
    with clients connected was refused its --port-base for a minute)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _preferred(port: int) -> int:
    return port if port_free(port) else 0


FixedPorts = tuple[tuple[int, int, int], int, int]


def fixed_ports(base: int | None) -> FixedPorts | str:
    """The proxies', the control plane's and the status page's ports: from
    `base` on (--port-base: those five and the banner's own proxy's next to
    them must be free), else the usual ones where free (0 where taken: any
    free port). A str says why `base` cannot be used."""
    if base is None:
        proxies = (_preferred(8080), _preferred(8081), _preferred(8082))
        return proxies, _preferred(7070), _preferred(7080)
    if not 1024 <= base <= 65535 - 5:
        return f"--port-base must be from 1024 to 65530, not {base}"
    taken = [port for port in range(base, base + 6) if not port_free(port)]
    if taken:
        return f"--port-base {base}: port {', '.join(map(str, taken))} taken (6 from it are used)"
    return (base, base + 1, base + 2), base + 3, base + 4


GEO_BODY = '{"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}'


@dataclass(frozen=True)
class GeoCall:
    """A chat call through a proxy as `user`: X-Forwarded-For carries the user's
    address, which the proxy believes from loopback and locates with the demo's
    GeoIP database; no-cache, so that the region nearest the user answers."""

    user: DemoUser
    proxy_url: str

    def headers(self) -> dict[str, str]:
        return {
            "X-Forwarded-For": self.user.address,
            "cache-control": "no-cache",
            "content-type": "application/json",
        }

    def curl(self) -> str:
        """A shell line that prints the answer's x-ponto-region header."""
        headers = " ".join(f"-H '{k}: {v}'" for k, v in self.headers().items())
        return (
            f"curl -s -D - -o /dev/null {headers} -d '{GEO_BODY}' "
            # The status line too when it is no 2xx: a refusal (a key made
            # since closed the demo) printed nothing at all (trial 35).
            f"{self.proxy_url}/chat/completions | grep -iE '^x-ponto-region|^HTTP/[0-9.]+ [^2]'"
        )

    def region(self) -> str:
        """The x-ponto-region of the answer: from the curl line itself where curl
        is installed, else from the same request made here."""
        if shutil.which("curl"):
            out = subprocess.run(
                ["bash", "-c", f"set -o pipefail; {self.curl()}"],  # noqa: S607
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            return out.partition(":")[2].strip()
        req = urllib.request.Request(  # noqa: S310 - loopback http only
            f"{self.proxy_url}/chat/completions", data=GEO_BODY.encode(), headers=self.headers()
        )
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
            return str(resp.headers["x-ponto-region"])


def geo_calls(proxy_url: str) -> list[GeoCall]:
    return [GeoCall(user, proxy_url) for user in DEMO_USERS]


CACHE_QUESTION = "what does a region share"


def cache_curl(proxy_url: str, question: str = CACHE_QUESTION) -> str:
    """A shell line that asks a cacheable question and prints the answer's
    x-ponto-cache headers (x-ponto-cache, and x-ponto-cache-tier on a hit)."""
    body = json.dumps(
        {
            "model": "sim-small",
            "temperature": 0,
            "messages": [{"role": "user", "content": question}],
        }
    )
    return (
        f"curl -s -D - -o /dev/null -H 'content-type: application/json' -d '{body}' "
        f"{proxy_url}/chat/completions | grep -iE '^x-ponto-cache|^HTTP/[0-9.]+ [^2]'"
    )


def regional_cache_hint(fleet: Fleet) -> list[str]:
    """How to see two proxies of a region share its cache, or why there is none."""
    first, second = DEMO_PROXIES[0][0], DEMO_SECOND_PROXY[0]
    if second not in fleet.proxies:
        return [NO_REDIS]
    return [
        f"{first} and {second} share the us-east cache (a redis-server): ask one a",
        "question, then the other, and the second answer comes from the region's cache",
        "(x-ponto-cache-tier: region; asked again of the same proxy: local):",
        f"  # ask {first}: x-ponto-cache: miss (the origin answers)",
        f"  {cache_curl(fleet.proxy_url(first))}",
        f"  # then {second}: x-ponto-cache: hit, x-ponto-cache-tier: region",
        f"  {cache_curl(fleet.proxy_url(second))}",
    ]


OWN_PROXY = "proxy-mine"


def own_proxy_command(fleet: Fleet, port: int) -> list[str]:
    """A proxy of the first proxy's region on `port`, named OWN_PROXY: the
    first proxy's own command line (the control planes, certificates and
    bootstrap token, the GeoIP database, the region's Redis), with its name,
    address and state directory changed, and no ready file or metrics port
    (the first proxy's is taken; without one /metrics is on `port`)."""
    first = fleet.proxies[next(iter(fleet.proxies))]
    argv = first.argv[3:]  # after `python -m dataplane`
    changed = {"--listen": f"127.0.0.1:{port}", "--name": OWN_PROXY,
               "--state-dir": str(fleet.workdir / f"{OWN_PROXY}-state")}  # fmt: skip
    script = Path(sys.executable).with_name("ponto-proxy")  # the venv's entry point
    own = [str(script)] if script.exists() else [sys.executable, "-m", "dataplane"]
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        if flag not in ("--ready-file", "--metrics-listen", "--metrics-key-labels"):
            own += [flag, changed.get(flag, value)]
    return own


def own_proxy_hint(fleet: Fleet, port: int = 0) -> list[str]:
    """`port`: the one --port-base gives it (0: 8099, or a free one where taken)."""
    port = port or _preferred(8099) or devenv.free_port()
    return [
        "Add a proxy of your own, in another terminal (Ctrl-C stops it; it registers",
        "with the control plane and serves its region's table like the demo's own;",
        "its state is in the demo's directory: stop it before the demo):",
        f"  {shlex.join(own_proxy_command(fleet, port))}",
    ]


NO_REDIS = (
    "redis-server not found: each proxy keeps a cache of its own (install it with "
    "`sudo apt-get install redis-server` for a cache shared by a region's proxies)."
)


def redis_available() -> bool:
    try:
        devenv.find_redis()
    except devenv.DevEnvError:
        return False
    return True


def banner(fleet: Fleet, *, logs_removed: bool, own_port: int = 0) -> str:
    control_name, control = next(iter(fleet.controls.items()))
    assert fleet.etcd is not None
    rows = [
        *[
            row
            for n, m in fleet.proxies.items()
            for row in [
                (f"proxy  {n}", f"http://{m.address}/v1", m.pid),
                # Its metrics port: the public port's /healthz says only "ok"
                # and it has no /metrics.
                ("  its /healthz and /metrics", f"http://{fleet.metrics_addresses[n]}", m.pid),
            ]
        ],
        *[(f"origin {n}", f"http://{m.address}/v1", m.pid) for n, m in fleet.origins.items()],
        (f"control plane {control_name}", f"{control.address} (gRPC)", control.pid),
        ("  status page and /metrics", fleet.status_url + "/", control.pid),
        ("etcd", fleet.etcd.url, fleet.etcd.managed.pid),
        *[(f"redis  {r} (cache)", c.url, c.managed.pid) for r, c in fleet.caches.items()],
    ]
    lines = ["", "Ponto is running.", ""]
    lines += [f"  {what:<29} {where:<30} pid {pid}" for what, where, pid in rows]
    first = fleet.proxy_url(next(iter(fleet.proxies)))
    lines += [
        "",
        "Try it with curl:",
        f"  curl -s {first}/chat/completions -H 'content-type: application/json' \\",
        '    -d \'{"model": "sim-small", "temperature": 0,',
        '         "messages": [{"role": "user", "content": "hi"}]}\'',
        "",
        "Or with the openai client (only the base URL changes):",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{first}", api_key="unused")',
        '  r = client.chat.completions.create(model="sim-small", temperature=0,',
        '      messages=[{"role": "user", "content": "hi"}])',
        "  print(r.choices[0].message.content)",
        "Asked again, either request is answered from the exact cache (header",
        "x-ponto-cache: hit). By default only deterministic requests (temperature 0,",
        "or a seed) are cached; x-ponto-cache-reason says why another one was not.",
        "The simulated origins answer with made-up text and ignore n, stop, tools,",
        "logprobs and response_format; the proxy passes all of them on (a real",
        "vLLM or OpenAI origin honours them).",
        "",
        "Call as a user in "
        + ", ".join(u.place for u in DEMO_USERS[:-1])
        + f" or {DEMO_USERS[-1].place}: the demo's GeoIP database places these",
        "documentation addresses there and the proxies believe X-Forwarded-For from",
        "loopback, so each answer comes from the region nearest its user (x-ponto-region):",
        *[
            line
            for call in geo_calls(first)
            for line in (
                f"  # a user in {call.user.place} ({call.user.address}), "
                f"nearest {call.user.region}",
                f"  {call.curl()}",
            )
        ],
        "",
        *regional_cache_hint(fleet),
        "",
        f"Watch the fleet at {fleet.status_url}/ (regions on a map, origins, proxies,",
        "live rates; its Drain buttons ask for the admin token: "
        + (f"cat {fleet.security.admin_token_file})." if fleet.security else "none is needed)."),
        "",
        "Operate the fleet (mutual TLS and an admin token, from a throwaway CA):",
        *[
            f"  export {k}={v}"
            for k, v in (fleet.security.admin_env() if fleet.security else {}).items()
        ],
        f"  export PONTO_CONTROL_PLANE={control.address}",
        "  .venv/bin/pontoctl get proxies",
        "  .venv/bin/pontoctl drain region us-east",
        "  .venv/bin/pontoctl tenant add acme && .venv/bin/pontoctl key create --tenant acme",
        "  .venv/bin/pontoctl get audit      # who changed what, when, from where",
        "  (the first key closes the fleet for good, revoked or not: every request then",
        "  needs 'Authorization: Bearer <key>' (curl -H, the openai client's api_key),",
        "  every curl line and the openai snippet here included)",
        *failover_hint(fleet, first),
        "",
        *own_proxy_hint(fleet, own_port),
        "",
        f"Logs are in {fleet.workdir}"
        + (" (removed on exit; --workdir DIR keeps them)." if logs_removed else "."),
        "One NAME.log per process; a proxy's also holds its access log (one JSON",
        "object per request: the lines that start with '{').",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def failover_hint(fleet: Fleet, first_proxy_url: str) -> list[str]:
    """How to watch a failover: kill the origin the first proxy answers from."""
    proxy = next(iter(fleet.proxies))
    region = proxy.removeprefix("proxy-")
    origin = fleet.origins[f"origin-{region}"]
    return [
        "",
        "Every process is supervised: kill one and the demo reports it and starts it",
        "again on the same address. To watch failover, kill the "
        f"{region} origin (kill {origin.pid});",
        f"{proxy} then answers from the next region (header x-ponto-region) until it is back:",
        f"  curl -si {first_proxy_url}/chat/completions -H 'cache-control: no-cache' \\",
        "    -H 'content-type: application/json' \\",
        '    -d \'{"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}\'',
    ]


def supervise(fleet: Fleet) -> Supervisor:
    """A supervisor for every process of the fleet, reporting on the console."""

    def report(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    supervisor = Supervisor(time.monotonic, report)
    for name, managed in fleet.members().items():
        supervisor.watch(name, managed, functools.partial(fleet.restart, name))
    return supervisor


# ---------------------------------------------------------------- checks


class Report:
    def __init__(self) -> None:
        self.results: list[tuple[str, bool, str]] = []

    def check(self, name: str, fn: Callable[[], str]) -> bool:
        try:
            detail = fn()
            ok = True
        except Exception as exc:  # a failed check is reported, not raised
            detail, ok = f"{type(exc).__name__}: {exc}", False
        self.results.append((name, ok, detail))
        mark = "ok  " if ok else "FAIL"
        print(f"  [{mark}] {name}: {detail}", flush=True)
        return ok

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.results)


def _chat(
    base_url: str, stream: bool = False, question: str = "what is a point of presence"
) -> tuple[str, dict[str, str], int]:
    """One chat call with the official openai client: (text, headers, chunks)."""
    from openai import OpenAI  # noqa: PLC0415 - dev dependency, only for checks
    from openai.types.chat import ChatCompletionUserMessageParam  # noqa: PLC0415

    client = OpenAI(base_url=base_url, api_key="demo", max_retries=0, timeout=30)
    messages = [ChatCompletionUserMessageParam(role="user", content=question)]
    if not stream:
        raw = client.chat.completions.with_raw_response.create(
            model="sim-small", messages=messages, temperature=0
        )
        completion = raw.parse()
        return completion.choices[0].message.content or "", dict(raw.headers), 1
    chunks_iter = client.chat.completions.create(
        model="sim-small", messages=messages, temperature=0, stream=True
    )
    text, chunks = [], 0
    for chunk in chunks_iter:
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return "".join(text), dict(chunks_iter.response.headers), chunks


def _post_raw(url: str, body: bytes, content_type: str) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(  # noqa: S310 - loopback http only
        url, data=body, headers={"content-type": content_type}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _timed_calls(url: str, n: int) -> list[float]:
    body = json.dumps(
        {"model": "sim-bare", "max_tokens": 8, "messages": [{"role": "user", "content": "ping"}]}
    ).encode()
    out = []
    for _ in range(n):
        req = urllib.request.Request(  # noqa: S310 - loopback http only
            url, data=body, headers={"content-type": "application/json"}
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback
            resp.read()
        out.append(time.perf_counter() - t0)
    return out


def overhead(fleet: Fleet, n: int = 400) -> str:
    """Direct vs through the proxy, interleaved in one run, same unpaced origin."""
    fleet.start_origin("origin-bare", "us-east", models=("sim-bare",))
    fleet.add_origin("origin-bare", "us-east", fleet.origin_url("origin-bare"), ("sim-bare",))
    fleet.wait_proxies_at(fleet.table_version(origins=len(fleet.origins)))
    origin = fleet.origin_url("origin-bare") + "/chat/completions"
    proxy = fleet.proxy_url("proxy-us-east") + "/chat/completions"
    _timed_calls(origin, 20)
    _timed_calls(proxy, 20)
    direct, via = [], []
    for _ in range(n // 20):
        direct += _timed_calls(origin, 20)
        via += _timed_calls(proxy, 20)
    d50, p50 = statistics.median(direct), statistics.median(via)
    return (
        f"p50 direct {d50 * 1000:.2f} ms, via proxy {p50 * 1000:.2f} ms "
        f"(+{(p50 - d50) * 1000:.2f} ms, ratio {p50 / d50:.2f}) over {n} sequential calls each"
    )


def run_checks(fleet: Fleet) -> Report:
    report = Report()
    us = fleet.proxy_url("proxy-us-east")
    eu = fleet.proxy_url("proxy-eu-west")

    def models() -> str:
        from openai import OpenAI  # noqa: PLC0415

        ids = sorted(m.id for m in OpenAI(base_url=us, api_key="demo").models.list())
        assert ids == ["sim-large", "sim-small"], ids
        return f"models {ids}"

    def non_streaming() -> str:
        text, headers, _ = _chat(us)
        assert text, "empty answer"
        assert headers.get("x-ponto-region") == "us-east", headers.get("x-ponto-region")
        return f"{len(text.split())} words from {headers['x-ponto-origin']}"

    def streaming() -> str:
        text, headers, chunks = _chat(eu, stream=True)
        plain, _, _ = _chat(eu)
        assert chunks > 2, f"only {chunks} chunks"
        assert text == plain, "streamed text differs from the non-streamed answer"
        return f"{chunks} SSE chunks from {headers.get('x-ponto-origin')}, text matches"

    def status() -> dict[str, dict[str, Any]]:
        api = fleet.status_url + "/api/status"
        with urllib.request.urlopen(api, timeout=5) as resp:  # noqa: S310 - loopback
            return {r["name"]: r for r in json.loads(resp.read())["regions"]}

    def geo() -> str:
        # The page open before the calls, as a viewer's would be: the rates
        # of what each region served are measured from this sample.
        status()
        calls = geo_calls(us)
        answered = {call.user.place: call.region() for call in calls}
        expected = {call.user.place: call.user.region for call in calls}
        assert answered == expected, answered
        assert len(set(answered.values())) == len(calls), answered
        how = "the printed curl lines" if shutil.which("curl") else "their requests"
        return f"{how}: " + ", ".join(f"{p} -> {r}" for p, r in answered.items())

    def status_page() -> str:
        # The geo calls above all arrived at proxy-us-east and were served in
        # three regions: us-east shows them arrived, each region what it
        # served, once the proxy's reports have reached the page.
        page = fleet.status_url + "/"
        with urllib.request.urlopen(page, timeout=5) as resp:  # noqa: S310 - loopback
            assert b"<html" in resp.read().lower()
        places = {user.region for user in DEMO_USERS}
        deadline = time.monotonic() + 15
        arrived, served = None, {}
        while time.monotonic() < deadline:
            regions = status()
            arrived = regions["us-east"]["requests_per_s"]
            served = {name: regions[name]["served_per_s"] for name in places}
            if arrived and all(served.values()):
                shown = ", ".join(f"{name} {rate:.1f}" for name, rate in sorted(served.items()))
                return (
                    f"{fleet.status_url}/ shows {len(regions)} regions, {arrived:.1f} req/s "
                    f"arrived at us-east, served req/s: {shown}"
                )
            time.sleep(0.5)
        raise AssertionError(f"status page: arrived at us-east {arrived}, served {served}")

    def regional_cache() -> str:
        # The first proxy writes the entry to Redis once it has answered: each
        # attempt asks a new question and waits a little longer before asking
        # the second proxy.
        second = fleet.proxy_url(DEMO_SECOND_PROXY[0])
        seen = []
        for attempt in range(1, 9):
            question = f"{CACHE_QUESTION} {attempt}"
            text, first_headers, _ = _chat(us, question=question)
            time.sleep(0.05 * attempt)
            again, headers, _ = _chat(second, question=question)
            answer = (headers.get("x-ponto-cache"), headers.get("x-ponto-cache-tier"))
            seen.append(f"{first_headers.get('x-ponto-cache')} then {answer}")
            if answer == ("hit", "region"):
                assert again == text, "the region's answer differs from the origin's"
                return (
                    f"answered by proxy-us-east, then by {DEMO_SECOND_PROXY[0]} from the "
                    f"us-east cache (x-ponto-cache-tier: region, attempt {attempt})"
                )
        raise AssertionError(f"no region hit: {seen}")

    def bad_input() -> str:
        status, body = _post_raw(us + "/chat/completions", b"{not json", "application/json")
        assert status == 400 and "error" in body, (status, body)
        status, body = _post_raw(us + "/chat/completions", b"{}", "text/plain")
        assert status == 415 and "error" in body, (status, body)
        return "malformed JSON -> 400, wrong content type -> 415, OpenAI error shape"

    def control_plane_down() -> str:
        for control in fleet.controls.values():
            control.kill()
        time.sleep(0.5)
        text, _, _ = _chat(us)
        streamed, _, _ = _chat(eu, stream=True)
        assert text and streamed
        return "control plane killed; both proxies still answer"

    def restart_from_disk() -> str:
        proxy = fleet.proxies["proxy-us-east"]
        proxy.stop()
        fleet.start_proxy("proxy-us-east", "us-east")
        status = fleet.proxy_status("proxy-us-east")
        assert status["route_table_source"] == "disk", status
        text, _, _ = _chat(fleet.proxy_url("proxy-us-east"))
        assert text
        return "proxy restarted with no control plane; served from its saved table"

    def control_plane_back() -> str:
        fleet.start_control()
        fleet.proxies["proxy-us-east"].stop()
        fleet.start_proxy("proxy-us-east", "us-east")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            states = [fleet.proxy_status(n)["control_plane_connected"] for n in fleet.proxies]
            if all(states):
                return "control plane restarted; every proxy reconnected"
            time.sleep(0.1)
        raise AssertionError(f"proxies not reconnected: {states}")

    def cache_hit() -> str:
        us = fleet.proxy_url("proxy-us-east")  # restarted by the checks before
        _chat(us)  # the same question as the checks before: already answered
        _, headers, _ = _chat(us)
        assert headers.get("x-ponto-cache") == "hit", headers.get("x-ponto-cache")
        _, streamed, chunks = _chat(us, stream=True)
        assert streamed.get("x-ponto-cache") == "hit" and chunks > 2, (streamed, chunks)
        return f"repeat answered at the edge (x-ponto-cache: hit), replayed as {chunks} chunks"

    def keys_and_limits() -> str:
        from openai import AuthenticationError, OpenAI, RateLimitError  # noqa: PLC0415

        us = fleet.proxy_url("proxy-us-east")
        admin = fleet.admin()
        limits = pb.Limits(rpm=5)
        admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="demo", limits=limits)))
        key = admin.CreateKey(apb.CreateKeyRequest(tenant="demo"), timeout=10).secret
        fleet.wait_proxies_at(fleet.wait_table(lambda t: len(t.keys) == 1))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the proxy holds its share
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(
                    f"http://{fleet.proxies['proxy-us-east'].address}/readyz", timeout=2
                ),
            ):
                break
            time.sleep(0.1)
        try:
            OpenAI(base_url=us, api_key="sk-wrong", max_retries=0).models.list()
            raise AssertionError("a wrong key was accepted")
        except AuthenticationError:
            pass
        client = OpenAI(base_url=us, api_key=key, max_retries=0)
        admitted = 0
        try:
            for i in range(20):
                client.chat.completions.create(
                    model="sim-small",
                    messages=[{"role": "user", "content": f"limit {i}"}],
                    temperature=0.5,
                )
                admitted += 1
        except RateLimitError as exc:
            headers = exc.response.headers
            return (
                f"wrong key -> 401; {admitted} admitted then 429 with Retry-After "
                f"{headers.get('retry-after')} and x-ratelimit-limit-requests "
                f"{headers.get('x-ratelimit-limit-requests')}"
            )
        raise AssertionError("20 requests passed a limit of 5 a minute")

    print("Checks:", flush=True)
    report.check("models", models)
    report.check("chat, non-streaming", non_streaming)
    report.check("chat, streaming", streaming)
    if DEMO_SECOND_PROXY[0] in fleet.proxies:
        report.check("regional cache", regional_cache)
    else:
        print(f"  {NO_REDIS}", flush=True)
    report.check("users in three places, three regions", geo)
    report.check("status page shows the traffic", status_page)
    report.check("bad input", bad_input)
    report.check("overhead", lambda: overhead(fleet))
    report.check("control plane down", control_plane_down)
    report.check("restart without control plane", restart_from_disk)
    report.check("control plane back", control_plane_back)
    report.check("cache", cache_hit)
    report.check("keys and rate limits", keys_and_limits)
    return report


def run_supervised(fleet: Fleet) -> None:
    """Start again whatever dies, until SIGINT or SIGTERM.

    A signal during a restart takes effect once that process is up (a second
    or two): it is then in the fleet, which stops it with the rest.
    """
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, devenv.children.guard(_stop))
    supervisor = supervise(fleet)
    while not stop:
        supervisor.poll()
        time.sleep(0.2)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ponto-demo", description=__doc__)
    p.add_argument("--check", action="store_true", help="run the checks, report, exit")
    p.add_argument("--workdir", type=Path, help="where logs and state go (default: a temp dir)")
    p.add_argument(
        "--port-base",
        type=int,
        metavar="PORT",
        help="the proxies listen on PORT, PORT+1 and PORT+2, the control plane on PORT+3 "
        "(gRPC) and its status page on PORT+4, and the banner's proxy of your own on "
        "PORT+5 (default: 8080 to 8082, 7070, 7080 and 8099, each or a free port if "
        "taken); etcd, Redis, the origins and each proxy's metrics port take free "
        "ports from 20000 up, below the kernel's ephemeral range (the banner lists "
        "them)",
    )
    args = p.parse_args(argv)
    fixed = fixed_ports(args.port_base)
    if isinstance(fixed, str):
        p.error(fixed)
    proxy_ports, control_port, status_port = fixed
    own_port = args.port_base + 5 if args.port_base is not None else 0
    # etcd and Redis pick free ports of their own while these wait their turn.
    devenv.reserve_ports((*proxy_ports, control_port, status_port, own_port))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ponto-demo-"))
    # Until run_supervised owns the signals, SIGTERM stops the demo as Ctrl-C
    # does: through the clean-up below, leaving no process behind.
    # Guarded: a signal while a child starts waits until the child is registered.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, devenv.children.guard(_interrupt))
    # A temp dir goes once the demo ends as it should; after a failed check
    # or an error its logs stay for the user to read.
    remove = False
    fleet: Fleet | None = None
    try:
        regional = redis_available()
        proxies = len(DEMO_PROXIES) + (1 if regional else 0)
        caches = ", a redis-server per region with proxies" if regional else ""
        print(
            f"Starting etcd, control plane, {len(DEMO_REGIONS)} origins{caches} and "
            f"{proxies} proxies…",
            flush=True,
        )
        if args.check:
            # Free ports of any number, unless --port-base says which.
            chosen = args.port_base is not None
            fleet = start_demo_fleet(
                workdir,
                proxy_ports=proxy_ports if chosen else (0, 0, 0),
                control_port=control_port if chosen else 0,
                status_port=status_port if chosen else 0,
                regional_cache=regional,
            )
            report = run_checks(fleet)
            passed = sum(ok for _, ok, _ in report.results)
            print(f"{passed} passed, {len(report.results) - passed} failed", flush=True)
            remove = report.ok and args.workdir is None
            return 0 if report.ok else 1
        fleet = start_demo_fleet(
            workdir,
            proxy_ports=proxy_ports,
            control_port=control_port,
            status_port=status_port,
            regional_cache=regional,
        )
        print(banner(fleet, logs_removed=args.workdir is None, own_port=own_port), flush=True)
        run_supervised(fleet)
        print("\nstopping…", flush=True)
        remove = args.workdir is None
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping…", flush=True)
        remove = args.workdir is None
        return 130
    finally:
        if fleet is not None:  # start_demo_fleet stops what it started if it fails
            fleet.stop()
        # A child whose handle never reached the fleet (a signal during start-up).
        devenv.children.stop()
        if remove:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            # Kept to be read: say where (trial 22 had to guess, and each
            # failed check left another directory behind).
            print(f"logs kept in {workdir}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
