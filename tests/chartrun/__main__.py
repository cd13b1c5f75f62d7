"""`make chart-run`: run what `charts/ponto` renders, on this machine, as Kubernetes would.

Renders the chart with the three-region CI values, starts every container of every
Deployment, StatefulSet and Job as a local process in its own network namespace
(cluster.py), runs the post-install hook, then checks the product through the
rendered Services the way a user would: the official openai client against each
region's proxy, a question answered by one proxy pod of a region asked again of
another (a hit from the region's Redis), a drain and undrain with the rendered
admin credential, the commands NOTES.txt prints (through a kubectl shim), a `helm
upgrade` with one more region and more proxy replicas under client traffic, and
finally etcd killed while the proxies keep serving. Each step is reported; any
failure exits non-zero.

Needs root (network and mount namespaces, veth, bind mounts). Without root it says
so and exits 0, except in CI (CI=true), where it fails. docs/helm.md says what this
proves and what it does not.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.chartrun.cluster import Cluster, ClusterError, ImageMap, Obj, Pod, Probe, tail

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ponto"
CI_VALUES = CHART / "ci" / "three-regions-values.yaml"
RELEASE = "ponto"
NAMESPACE = "ponto"
KUBE_VERSION = "1.30.0"
MODEL = "llama-3-8b"
# Requests each region's Service must answer during the upgrade for it to count.
MIN_REQUESTS = 10
TRAFFIC_PAUSE_S = 0.2
# The budget for the whole run on 2 cores.
TIME_LIMIT_S = 300.0
# How long etcd stays down before the checks: more than readiness period x threshold.
ETCD_DOWN_WAIT_S = 11.0
log = logging.getLogger("chart-run")

# Rendered with the chart so that NOTES.txt is rendered from exactly the same values.
NOTES_TEMPLATE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: chartrun-notes
data:
  NOTES.txt: {{ include "chartrun.notes" . | toJson }}
"""


@dataclass
class Render:
    objects: list[Obj]
    hooks: list[Obj]
    notes: str


def render(helm: str, values: list[Path], *, upgrade: bool) -> Render:
    with tempfile.TemporaryDirectory(prefix="chartrun-render-") as tmp:
        chart = Path(tmp) / "ponto"
        shutil.copytree(CHART, chart)
        notes = (chart / "templates" / "NOTES.txt").read_text()
        (chart / "templates" / "_chartrun_notes.tpl").write_text(
            '{{- define "chartrun.notes" -}}\n' + notes + "\n{{- end -}}\n"
        )
        (chart / "templates" / "zz-chartrun-notes.yaml").write_text(NOTES_TEMPLATE)
        argv = [helm, "template", RELEASE, str(chart), "-n", NAMESPACE]
        argv += ["--kube-version", KUBE_VERSION]
        if upgrade:
            argv.append("--is-upgrade")
        for v in values:
            argv += ["-f", str(v)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    objects, hooks, notes_text = [], [], ""
    for doc in yaml.safe_load_all(out):
        if not doc:
            continue
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "chartrun-notes":
            notes_text = doc["data"]["NOTES.txt"]
            continue
        if "helm.sh/hook" in doc["metadata"].get("annotations", {}):
            hooks.append(doc)
        else:
            objects.append(doc)
    return Render(objects, hooks, notes_text)


def proxy_names(pod: Pod) -> list[str]:
    """The names a proxy pod registers: the pod's, or POD-wI for each of its
    --workers when it runs more than one (dataplane/workers.py)."""
    workers = 1
    for arg in pod.spec["containers"][0].get("args", []):
        if arg.startswith("--workers="):
            workers = int(arg.partition("=")[2])
    return [pod.name] if workers == 1 else [f"{pod.name}-w{i}" for i in range(workers)]


# --------------------------------------------------------------------------- report


@dataclass
class Report:
    steps: list[tuple[str, bool, float, str]] = field(default_factory=list)

    async def step(self, name: str, fn: Callable[[], Awaitable[str | None]]) -> None:
        start = time.monotonic()
        print(f"--- {name}", flush=True)
        try:
            detail = await fn() or ""
        except Exception as exc:
            elapsed = time.monotonic() - start
            self.steps.append((name, False, elapsed, f"{type(exc).__name__}: {exc}"))
            print(f"FAIL {name} ({elapsed:.1f} s): {exc}", flush=True)
            traceback.print_exc()
            raise
        elapsed = time.monotonic() - start
        self.steps.append((name, True, elapsed, detail))
        print(f"ok   {name} ({elapsed:.1f} s){': ' + detail if detail else ''}", flush=True)


# --------------------------------------------------------------------------- the run


class Run:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        venv_bin = Path(sys.executable).parent
        from ponto.devenv import find_etcd, find_redis  # noqa: PLC0415

        # Debian's redis-server stands in for the Valkey (or Redis) image's server.
        redis = str(find_redis())
        images = ImageMap(
            commands={
                "/usr/local/bin/etcd": str(find_etcd()),
                "etcd": str(find_etcd()),
                "valkey-server": redis,
                "redis-server": redis,
                "ponto-control": str(venv_bin / "ponto-control"),
                "ponto-proxy": str(venv_bin / "ponto-proxy"),
                "pontoctl": str(venv_bin / "pontoctl"),
                "ponto-origin-sim": str(venv_bin / "ponto-origin-sim"),
            },
            default_path=f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        )
        self.cluster = Cluster(root, images, namespace=NAMESPACE, repo=REPO)
        self.report = Report()
        self.release: Render | None = None
        self.admin_dir = root / "admin"
        self.api_key = ""
        self.unlimited_key = ""
        self.limited_refusals: list[str] = []
        self.control_plane = ""
        self.traffic_ok: dict[str, int] = {}
        self.traffic_failed: list[str] = []

    # ------------------------------------------------------------------ helpers

    @property
    def drained_in_values(self) -> set[str]:
        values = yaml.safe_load(CI_VALUES.read_text())
        return {r["name"] for r in values["proxy"]["regions"] if r.get("drained")}

    def region_services(self) -> dict[str, str]:
        """Region name -> the proxy Service's in-cluster DNS name (the public one,
        not the region's metrics Service)."""
        out = {}
        for (kind, name), obj in self.cluster.objects.items():
            labels = obj["metadata"].get("labels", {})
            if (
                kind == "Service"
                and labels.get("app.kubernetes.io/component") == "proxy"
                and "ponto.io/metrics" not in labels
            ):
                out[labels["ponto.io/region"]] = f"{name}.{NAMESPACE}.svc"
        return out

    def service_port(self, dns: str) -> int:
        svc = self.cluster.get("Service", dns.split(".", maxsplit=1)[0])
        return int(svc["spec"]["ports"][0]["port"])

    def write_admin_credentials(self) -> None:
        """The admin token and client certificate, read from the rendered Secrets."""
        self.admin_dir.mkdir(mode=0o700, exist_ok=True)
        job = next(h for h in self.release.hooks if h["kind"] == "Job")  # type: ignore[union-attr]
        volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
        tokens = volumes["tokens"]["secret"]["secretName"]
        (self.admin_dir / "admin-token").write_bytes(
            self.cluster.secret_value(tokens, "admin-token")
        )
        if "tls" in volumes:
            tls = volumes["tls"]["secret"]["secretName"]
            for key in ("ca.crt", "tls.crt", "tls.key"):
                (self.admin_dir / key).write_bytes(self.cluster.secret_value(tls, key))
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        self.control_plane = next(
            a.split("=", 1)[1] for a in args if a.startswith("--control-plane=")
        )

    async def pontoctl(self, *argv: str, check: bool = True) -> str:
        cmd = [
            str(Path(sys.executable).parent / "pontoctl"),
            f"--control-plane={self.control_plane}",
        ]
        cmd += [f"--admin-token-file={self.admin_dir / 'admin-token'}"]
        if (self.admin_dir / "ca.crt").exists():
            cmd += [
                f"--tls-ca={self.admin_dir / 'ca.crt'}",
                f"--tls-cert={self.admin_dir / 'tls.crt'}",
                f"--tls-key={self.admin_dir / 'tls.key'}",
            ]
        proc = await asyncio.create_subprocess_exec(
            *cmd, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await proc.communicate()
        text = out.decode()
        if check and proc.returncode != 0:
            raise ClusterError(f"pontoctl {' '.join(argv)} exited {proc.returncode}: {text}")
        return text

    def client(self, region: str, *, retries: int = 2, key: str = "") -> Any:
        import openai  # noqa: PLC0415

        dns = self.region_services()[region]
        return openai.AsyncOpenAI(
            base_url=f"http://{dns}:{self.service_port(dns)}/v1",
            api_key=key or self.api_key or "chart-run",
            timeout=20,
            max_retries=retries,
        )

    async def chat(
        self,
        region: str,
        *,
        stream: bool,
        text: str = "hello",
        client: Any = None,
        key: str = "",
    ) -> tuple[str, str]:
        """One chat call through the region's Service: (answer, origin region);
        without `client`, on a client of its own, with `key` (default: acme's)."""
        own = client is None
        if own:
            client = self.client(region, key=key)
        try:
            messages = [{"role": "user", "content": text}]
            if stream:
                answer = ""
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, stream=True, max_tokens=8
                )
                origin_region = raw.headers.get("x-ponto-region", "")
                async for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].delta.content:
                        answer += chunk.choices[0].delta.content
                return answer, origin_region
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=8
            )
            resp = raw.parse()
            return resp.choices[0].message.content or "", raw.headers.get("x-ponto-region", "")
        finally:
            if own:
                await client.close()

    # ------------------------------------------------------------------ steps

    async def install(self) -> str:
        self.release = render(self.args.helm, [CI_VALUES], upgrade=False)
        await self.provide_outside_world(self.release)
        await self.cluster.apply(self.release.objects, prune=False)
        kinds: dict[str, int] = {}
        for o in self.release.objects + self.release.hooks:
            kinds[o["kind"]] = kinds.get(o["kind"], 0) + 1
        return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))

    async def provide_outside_world(self, rel: Render) -> None:
        """What a user provides outside the chart: origins, their keys, the GeoIP volume."""
        values = yaml.safe_load(CI_VALUES.read_text())
        from ponto.geodb import write_flat_db  # noqa: PLC0415
        from tests.geodb import DOC_RANGES  # noqa: PLC0415

        if values.get("geoip", {}).get("enabled"):
            claim = values["geoip"]["volume"]["persistentVolumeClaim"]["claimName"]
            pv = self.root / "pv" / claim
            pv.mkdir(parents=True, exist_ok=True)
            write_flat_db(pv / values["geoip"]["fileName"], DOC_RANGES)
        secrets: dict[str, dict[str, str]] = {}
        for cred in values.get("proxy", {}).get("originCredentials", []):
            data = secrets.setdefault(cred["secretName"], {})
            data[cred["secretKey"]] = base64.b64encode(f"key-{cred['secretKey']}".encode()).decode()
        await self.cluster.apply(
            [
                {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": n}, "data": d}
                for n, d in secrets.items()
            ],
            prune=False,
        )
        for origin in values.get("topology", {}).get("origins", []):
            url = origin["url"]
            if not url.startswith("http://"):
                self.cluster.not_exercised[f"origin {origin['name']}"] = (
                    f"{url}: an HTTPS origin outside the cluster is not simulated; its probes fail"
                )
                continue
            hostport = url.removeprefix("http://").split("/", 1)[0]
            host, _, port = hostport.partition(":")
            template = {
                "metadata": {"labels": {"chartrun/origin": origin["name"]}},
                "spec": {
                    "containers": [
                        {
                            "name": "origin",
                            "command": ["ponto-origin-sim"],
                            "args": [
                                f"--listen=0.0.0.0:{port or 80}",
                                f"--region={origin['region']}",
                                f"--name={origin['name']}",
                                f"--models={','.join(origin.get('models', [MODEL]))}",
                                "--ttft-ms=5",
                            ],
                            "readinessProbe": {
                                "tcpSocket": {"port": int(port or 80)},
                                "periodSeconds": 1,
                            },
                        }
                    ]
                },
            }
            pod = await self.cluster.create_pod(
                f"origin-{origin['name']}", template, f"External/{origin['name']}", "ext"
            )
            self.cluster.external_hosts[host] = pod.ip
        self.cluster.write_hosts()

    async def wait_ready(self, timeout: float) -> str:
        workloads = [k for k in self.cluster.objects if k[0] in ("Deployment", "StatefulSet")]
        start = time.monotonic()
        order: list[str] = []
        pending = set(workloads)
        while pending:
            for k in sorted(pending):
                if self.cluster.workload_ready(*k):
                    pending.discard(k)
                    order.append(f"{k[1]} {time.monotonic() - start:.1f}s")
            if time.monotonic() - start > timeout:
                raise ClusterError(
                    "not ready: "
                    + ", ".join(f"{k}/{n}" for k, n in sorted(pending))
                    + "\n"
                    + self.pod_summary()
                )
            waited = time.monotonic() - start
            if waited > 15 and int(waited * 5) % 50 == 0:  # every 10 s: what is not ready
                for pod in self.cluster.pods.values():
                    if not pod.ready and pod.last_probe_error:
                        self.cluster.event(f"{pod.name} not ready: {pod.last_probe_error}")
            await asyncio.sleep(0.2)
        return "; ".join(order)

    def pod_summary(self) -> str:
        lines = []
        for pod in self.cluster.pods.values():
            for c in pod.containers:
                lines.append(
                    f"  {pod.name}/{c.name} ready={c.ready} restarts={c.restarts} "
                    f"exit={c.exit_code} probe={pod.last_probe_error!r}: {tail(c.log_file, 2)}"
                )
        return "\n".join(lines)

    async def run_hooks(self, phase: str) -> str:
        assert self.release is not None
        done = []
        for hook in self.release.hooks:
            phases = hook["metadata"]["annotations"]["helm.sh/hook"].split(",")
            if phase not in phases:
                continue
            if hook["kind"] != "Job":
                raise ClusterError(f"hook kind {hook['kind']} is not run by chart-run")
            await self.cluster.delete("Job", hook["metadata"]["name"])  # before-hook-creation
            pod = await self.cluster.run_job(hook, deadline=120)
            done.append(f"Job/{hook['metadata']['name']} ({pod.name})")
            policy = hook["metadata"]["annotations"].get("helm.sh/hook-delete-policy", "")
            if "hook-succeeded" in policy.split(","):
                await self.cluster.delete("Job", hook["metadata"]["name"])
        if not done:
            raise ClusterError(f"no {phase} hook rendered")
        return ", ".join(done)

    async def create_key(self) -> str:
        self.write_admin_credentials()
        out = await self.pontoctl("key", "create", "--tenant", "acme")
        self.api_key = out.strip().splitlines()[-1].strip()
        # A tenant without limits for the availability traffic of the upgrade.
        await self.pontoctl("tenant", "add", "chart-run")
        out = await self.pontoctl("key", "create", "--tenant", "chart-run")
        self.unlimited_key = out.strip().splitlines()[-1].strip()
        # Every proxy must know the key before clients use it.
        regions = list(self.region_services())

        async def all_accept() -> bool:
            for region in regions:
                try:
                    await self.chat(region, stream=False)
                except Exception:
                    return False
            return True

        end = time.monotonic() + 30
        while not await all_accept():
            if time.monotonic() > end:
                raise ClusterError("the new key was not accepted by every region in 30 s")
            await asyncio.sleep(0.3)
        return f"key for tenant acme accepted in {', '.join(regions)}"

    async def client_checks(self) -> str:
        out = []
        for region in sorted(self.region_services()):
            for stream in (False, True):
                answer, origin = await self.chat(region, stream=stream)
                if not answer:
                    raise ClusterError(f"{region}: empty answer (stream={stream})")
                note = " (drained in the CI values)" if region in self.drained_in_values else ""
                out.append(f"{region}{' stream' if stream else ''} -> {origin}{note}")
        return "; ".join(out)

    async def regional_cache(self) -> str:
        """Two proxy pods of one region share the region's Redis: a question one pod
        answered from the origin is a hit on the other, from the region's store.

        The pods are called at their own addresses, not through the Service, so that
        the second request surely reaches another pod (whose workers have not seen
        the question). The first pod writes the entry to Redis after it answers, so
        each attempt waits a little longer before asking the second pod; each
        attempt asks a new question, so a miss on the second pod spoils nothing.
        """
        import httpx  # noqa: PLC0415
        import redis.asyncio as aioredis  # noqa: PLC0415

        region = "us-east"
        owner = f"{RELEASE}-proxy-{region}"
        pods = [p for p in self.cluster.owned("Deployment", owner) if p.ready]
        if len(pods) < 2:
            raise ClusterError(f"{region} has {len(pods)} ready proxy pods; the check needs 2")
        first, second = pods[:2]
        port = self.cluster.named_ports(first)["http"]
        headers = {"authorization": f"Bearer {self.api_key}"}
        seen = []
        async with httpx.AsyncClient(timeout=20, headers=headers) as http:
            # Each worker of both pods has Redis up (ponto_cache_region_up):
            # a Redis that became ready late (its probes timing out on a
            # loaded machine) leaves a worker's breaker waiting up to 5 s
            # before it tries again (CI of 7fa773a: one worker of two up on
            # the second pod; CI of 48e35e6: on the first, whose answers were
            # then not stored in the region, and the second missed 8 of 8).
            deadline = asyncio.get_running_loop().time() + 30
            for pod in (first, second):
                metrics_url = f"http://{pod.ip}:{self.cluster.named_ports(pod)['metrics']}/metrics"
                while True:
                    ups = [
                        line
                        for line in (await http.get(metrics_url)).text.splitlines()
                        if line.startswith("ponto_cache_region_up")
                    ]
                    if ups and all(line.endswith(" 1.0") for line in ups):
                        break
                    if asyncio.get_running_loop().time() > deadline:
                        raise ClusterError(f"{pod.name}'s workers never all had Redis up: {ups}")
                    await asyncio.sleep(0.5)
            for attempt in range(1, 9):
                # No max_tokens: the simulated origins would stop at it, and an answer
                # cut by max_tokens is not cached.
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"regional cache {attempt}"}],
                    "temperature": 0,
                }
                miss = await http.post(f"http://{first.ip}:{port}/v1/chat/completions", json=body)
                await asyncio.sleep(0.1 * attempt)
                hit = await http.post(f"http://{second.ip}:{port}/v1/chat/completions", json=body)
                for pod, reply in ((first, miss), (second, hit)):
                    if reply.status_code != 200:
                        raise ClusterError(f"{pod.name}: {reply.status_code} {reply.text}")
                tier = (hit.headers.get("x-ponto-cache", ""), hit.headers.get("x-ponto-cache-tier"))
                seen.append(f"{miss.headers.get('x-ponto-cache')}/{tier}")
                if miss.headers.get("x-ponto-cache") == "hit":
                    raise ClusterError(f"{first.name} had a new question cached: {seen}")
                if tier == ("hit", "region"):
                    if hit.json()["choices"] != miss.json()["choices"]:
                        raise ClusterError("the region hit's answer differs from the origin's")
                    break
            else:
                shown = []
                for pod in (first, second):
                    port = self.cluster.named_ports(pod)["metrics"]
                    metrics = (await http.get(f"http://{pod.ip}:{port}/metrics")).text
                    shown += [
                        f"{pod.name} {m}"
                        for m in metrics.splitlines()
                        if m.startswith("ponto_cache_region")
                    ]
                raise ClusterError(
                    f"{second.name} never answered from the region: {seen}; the pods' "
                    "metrics: " + "; ".join(shown)
                )
        store = f"{RELEASE}-redis-{region}.{NAMESPACE}.svc"
        client = aioredis.Redis(host=store, port=6379)
        try:
            keys = await client.dbsize()
        finally:
            await client.aclose()
        if not keys:
            raise ClusterError(f"{store} holds no keys")
        return (
            f"{first.name} answered from the origin, {second.name} from the region "
            f"(attempt {attempt}); {store} holds {keys} keys"
        )

    async def metrics_checks(self) -> str:
        """Each region's metrics Service serves the group's /metrics; its public
        Service answers /metrics with an OpenAI-style 404 (tenant names stay inside)."""
        import httpx  # noqa: PLC0415

        out = []
        public = self.region_services()
        async with httpx.AsyncClient(timeout=20) as http:
            for region, dns in sorted(public.items()):
                name = dns.split(".", maxsplit=1)[0]
                scraped = f"{name}-metrics.{NAMESPACE}.svc"
                port = self.service_port(scraped)
                reply = await http.get(f"http://{scraped}:{port}/metrics")
                if reply.status_code != 200 or "ponto_worker_up" not in reply.text:
                    raise ClusterError(f"{region}: {scraped} /metrics gave {reply.status_code}")
                hidden = await http.get(f"http://{dns}:{self.service_port(dns)}/metrics")
                if hidden.status_code != 404 or "error" not in hidden.json():
                    raise ClusterError(f"{region}: the public Service served /metrics")
                out.append(f"{region}: {scraped}:{port}")
        return "; ".join(out)

    async def drain_cycle(self) -> str:
        region = "us-east"
        _, before = await self.chat(
            region, stream=False, text="before drain", key=self.unlimited_key
        )
        if before != region:
            raise ClusterError(f"{region} proxy answered from {before!r} before the drain")
        await self.pontoctl("drain", "region", region)
        moved = await self._until_origin_region(region, lambda r: r != region)
        await self.pontoctl("undrain", "region", region)
        back = await self._until_origin_region(region, lambda r: r == region)
        return f"{region}: drained -> served from {moved}; undrained -> {back}"

    async def _until_origin_region(self, region: str, ok: Callable[[str], bool]) -> str:
        end = time.monotonic() + 20
        n = 0
        while True:
            n += 1
            # As the tenant without limits: acme's concurrency limit (20) is
            # shared out by each proxy's peak use (controlplane/quota.py), and
            # a pod the Service has sent little may hold no slot and answer 429
            # until the leader's next two rebalances move one to it (about
            # 2 s, which the openai client's two retries do not always cover).
            # This step is about where a drained region's requests go.
            _, origin = await self.chat(
                region, stream=False, text=f"drain probe {n}", key=self.unlimited_key
            )
            if ok(origin):
                return origin
            if time.monotonic() > end:
                raise ClusterError(f"{region}: still served from {origin} after 20 s")
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ NOTES.txt

    async def notes_commands(self) -> str:
        assert self.release is not None
        script = notes_script(self.release.notes)
        home = self.root / "home"
        home.mkdir(exist_ok=True)
        shim = self.root / "bin"
        shim.mkdir(exist_ok=True)
        (shim / "kubectl").write_text(
            f'#!/bin/sh\nexec {sys.executable} -m tests.chartrun.kubectl "$@"\n'
        )
        (shim / "kubectl").chmod(0o755)
        sock = self.root / "kubectl.sock"
        server = await asyncio.start_unix_server(self._kubectl, path=str(sock))
        (self.root / "notes.sh").write_text(script)
        env = {
            "PATH": f"{shim}:{Path(sys.executable).parent}:/usr/bin:/bin",
            "HOME": str(home),
            "PONTO_API_KEY": self.api_key,
            "CHARTRUN_API": str(sock),
            "PYTHONPATH": str(REPO),
        }
        out_file = self.root / "notes.out"
        try:
            with open(out_file, "wb") as out:
                proc = await asyncio.create_subprocess_exec(
                    "bash",
                    str(self.root / "notes.sh"),
                    env=env,
                    cwd=str(home),
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                )
                await asyncio.wait_for(proc.wait(), 120)
        finally:
            server.close()
        text = out_file.read_text()
        print(text, flush=True)
        if proc.returncode != 0:
            raise ClusterError(f"NOTES.txt commands exited {proc.returncode}")
        for expected in ('"choices"', "us-east", "current"):
            if expected not in text:
                raise ClusterError(f"NOTES.txt commands printed no {expected!r}")
        return f"{script.count(chr(10))} lines of NOTES.txt commands ran"

    async def _kubectl(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = json.loads(await reader.readline())
        argv: list[str] = request["argv"]
        code = 0

        def out(data: bytes) -> None:
            writer.write(json.dumps({"out": base64.b64encode(data).decode()}).encode() + b"\n")

        try:
            code = await self._kubectl_verb(argv, reader, out)
        except Exception as exc:
            out(f"chart-run kubectl: {exc}\n".encode())
            code = 1
        with contextlib.suppress(OSError):
            writer.write(json.dumps({"exit": code}).encode() + b"\n")
            await writer.drain()
            writer.close()

    async def _kubectl_verb(
        self, argv: list[str], reader: asyncio.StreamReader, out: Callable[[bytes], None]
    ) -> int:
        args = list(argv)
        for flag in ("-n", "--namespace"):
            while flag in args:
                i = args.index(flag)
                if args[i + 1] != NAMESPACE:
                    raise ClusterError(f"namespace {args[i + 1]} does not exist")
                del args[i : i + 2]
        verb = args[0]
        c = self.cluster
        if verb == "get" and args[1] in ("svc", "service", "services"):
            selector = (
                dict(kv.split("=", 1) for kv in args[args.index("-l") + 1].split(","))
                if "-l" in args
                else {}
            )
            rows = ["NAME TYPE CLUSTER-IP PORT(S)"]
            for (kind, name), obj in sorted(c.objects.items()):
                labels = obj["metadata"].get("labels", {})
                if kind == "Service" and all(labels.get(k) == v for k, v in selector.items()):
                    ports = ",".join(f"{p['port']}/TCP" for p in obj["spec"]["ports"])
                    rows.append(
                        f"{name} {obj['spec'].get('type', 'ClusterIP')} "
                        f"{c.service_ips.get(name, 'None')} {ports}"
                    )
            out(("\n".join(rows) + "\n").encode())
            return 0
        if verb == "get" and args[1] == "secret":
            name = args[2]
            spec = args[args.index("-o") + 1]
            if not spec.startswith("jsonpath={.data.") or not spec.endswith("}"):
                raise ClusterError(f"output {spec} is not supported")
            key = spec[len("jsonpath={.data.") : -1].replace("\\.", ".")
            secret = c.get("Secret", name)
            out(secret["data"][key].encode())
            return 0
        if verb == "port-forward":
            target, ports = args[1], args[2]
            kind, _, name = target.partition("/")
            if kind not in ("svc", "service"):
                raise ClusterError("only port-forward svc/NAME is supported")
            local, _, remote = ports.partition(":")
            server = await c.port_forward(name, int(remote or local), int(local))
            out(f"Forwarding from 127.0.0.1:{local} -> {remote or local}\n".encode())
            try:
                await reader.read()  # until the kubectl process ends
            finally:
                server.close()
            return 0
        if verb == "exec":
            target = args[1]
            cmd = args[args.index("--") + 1 :]
            kind, _, name = target.partition("/")
            owner = {"deploy": "Deployment", "deployment": "Deployment", "sts": "StatefulSet"}[kind]
            pods = [p for p in c.owned(owner, name) if p.ready]
            if not pods:
                raise ClusterError(f"{target} has no ready pod")
            code, output = await c.exec_in(pods[0], cmd)
            out(output)
            return code
        if verb == "logs":
            name = args[1].partition("/")[2]
            pods = [p for p in c.pods.values() if p.owner == f"Job/{name}"]
            for pod in pods:
                out(pod.containers[0].log_file.read_bytes())
            return 0
        raise ClusterError(f"kubectl {' '.join(argv)} is not supported by chart-run")

    # ------------------------------------------------------------------ upgrade

    def upgrade_values(self) -> Path:
        """One more region and more proxy replicas; the release's material handed back.

        `helm upgrade` keeps generated tokens and certificates through `lookup`, which
        needs an API server. chart-run has none, so it hands the live material back as
        values (auth tokens, and the certificates as tls.existingSecrets copies), as a
        GitOps user does; the changed checksum then rolls every pod.
        """
        values = yaml.safe_load(CI_VALUES.read_text())
        regions = values["proxy"]["regions"]
        for r in regions:
            if r["name"] == "us-east":
                r["autoscaling"]["minReplicas"] += 1
        regions.append(
            {
                "name": "sa-east",
                "lat": -23.5,
                "lon": -46.6,
                "rttMs": {"us-east": 115, "eu-west": 180},
                "autoscaling": {"minReplicas": 2, "maxReplicas": 4},
            }
        )
        assert self.release is not None
        tokens = next(
            o
            for o in self.release.objects
            if o["kind"] == "Secret" and "admin-token" in o.get("data", {})
        )
        values.setdefault("auth", {})
        values["auth"]["adminToken"] = base64.b64decode(tokens["data"]["admin-token"]).decode()
        values["auth"]["bootstrapToken"] = base64.b64decode(
            tokens["data"]["bootstrap-token"]
        ).decode()
        given = {}
        for role, part in (("controlPlane", "control"), ("proxy", "proxy"), ("admin", "admin")):
            name = f"{RELEASE}-{part}-tls"
            src = self.cluster.get("Secret", name)
            copy_name = f"chartrun-{part}-tls"
            self.cluster.objects[("Secret", copy_name)] = {
                **copy.deepcopy(src),
                "metadata": {"name": copy_name},
            }
            given[role] = copy_name
        values.setdefault("tls", {})["existingSecrets"] = given
        path = self.root / "upgrade-values.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    async def traffic(self, stop: asyncio.Event, region: str, *, limited: bool) -> None:
        """Requests to one region's Service until stopped, streams and not, in turn.

        One client per region, so kept-alive connections meet pods that go away,
        and no SDK retries: every error the client sees counts. The availability
        loop uses a tenant without limits and any error fails the run; the limited
        loop (acme: 600 requests a minute for the fleet, sent at about 1 a second)
        records its 429s, which tell how fast new proxies get their share.
        """
        dns = self.region_services()[region]
        svc, port = dns.split(".")[0], self.service_port(dns)
        while not self.cluster.endpoints(svc, port):  # a new region: not yet up
            if stop.is_set():
                return
            await asyncio.sleep(0.1)
        key = self.api_key if limited else self.unlimited_key
        client = self.client(region, retries=0, key=key)
        n = 0
        try:
            while not stop.is_set():
                n += 1
                try:
                    answer, _ = await self.chat(
                        region, stream=n % 2 == 0, text=f"{region} {n}", client=client
                    )
                    if not answer:
                        raise ClusterError("empty answer")
                    if not limited:
                        self.traffic_ok[region] = self.traffic_ok.get(region, 0) + 1
                except Exception as exc:
                    status = getattr(exc, "status_code", None)
                    if limited and status == 429:
                        self.limited_refusals.append(region)
                    else:
                        self.traffic_failed.append(f"{region}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0 if limited else TRAFFIC_PAUSE_S)
        finally:
            await client.close()

    async def traffic_all(self, stop: asyncio.Event) -> None:
        """Client loops per region, regions that appear joining as they do."""
        loops: dict[str, list[asyncio.Task[None]]] = {}
        while not stop.is_set():
            for region in self.region_services():
                if region not in loops:
                    loops[region] = [
                        asyncio.create_task(self.traffic(stop, region, limited=False)),
                        asyncio.create_task(self.traffic(stop, region, limited=True)),
                    ]
            await asyncio.sleep(0.2)
        await asyncio.gather(*(t for ts in loops.values() for t in ts))

    async def upgrade(self) -> str:
        values = self.upgrade_values()
        self.cluster.event(
            "no API server for helm's lookup: the generated tokens and certificates go "
            "back as values (auth.*Token, tls.existingSecrets = chartrun-*-tls copies), "
            "so the chart's own token and TLS Secrets leave the release and every pod rolls"
        )
        new = render(self.args.helm, [values], upgrade=True)
        stop = asyncio.Event()
        self.traffic_ok, self.traffic_failed, self.limited_refusals = {}, [], []
        traffic = asyncio.create_task(self.traffic_all(stop))
        try:
            # Secrets first (kept), then the rest; pruned objects go.
            user = [
                o
                for k, o in self.cluster.objects.items()
                if k[0] == "Secret" and (k[1].startswith("chartrun-") or k[1] == "origin-keys")
            ]
            self.release = new
            await self.cluster.apply(new.objects + user, prune=True)
            await self.wait_ready(timeout=180)
            hooks = await self.run_hooks("post-upgrade")
            await self.converged()
            await asyncio.sleep(2)
        finally:
            stop.set()
            await traffic
        total = sum(self.traffic_ok.values())
        if self.traffic_failed:
            raise ClusterError(
                f"{len(self.traffic_failed)} of {total + len(self.traffic_failed)} "
                f"client requests failed during the upgrade: {self.traffic_failed[:3]}"
            )
        regions = sorted(self.region_services())
        thin = [r for r in regions if self.traffic_ok.get(r, 0) < MIN_REQUESTS]
        if thin:
            raise ClusterError(f"too few requests to judge the upgrade in {thin}")
        per = ", ".join(f"{r} {self.traffic_ok[r]}" for r in regions)
        refused = {r: self.limited_refusals.count(r) for r in sorted(set(self.limited_refusals))}
        return (
            f"{total} client requests ({per}), 0 failed, no retries; "
            f"limited tenant's 429s by region: {refused or 'none'}; {hooks}"
        )

    async def converged(self) -> None:
        """Every running proxy pod registered and at the latest version of its replica.

        Replicas number the same content by the etcd revision each read it at, so
        each proxy is compared with the version of the replica it is connected to
        (`replica_version`, which `pontoctl get proxies` uses for its STATE too).
        """
        end = time.monotonic() + 60
        while True:
            out = json.loads(await self.pontoctl("get", "proxies", "-o", "json"))
            proxies = {
                p["info"]["name"]: (
                    int(p.get("acked_version") or 0),
                    int(p.get("replica_version") or 0),
                    str(p.get("unknown") or ""),  # its replica's word not believed
                )
                for p in out.get("proxies", [])
            }
            pods = {
                name
                for p in self.cluster.pods.values()
                if p.owner.startswith("Deployment/") and "proxy" in p.owner and not p.terminating
                for name in proxy_names(p)
            }
            behind = [
                n
                for n in pods
                if n not in proxies
                or not proxies[n][1]
                or proxies[n][0] != proxies[n][1]
                or proxies[n][2]
            ]
            if not behind:
                return
            if time.monotonic() > end:
                raise ClusterError(
                    "proxies behind their replicas (acked, replica's version, unknown): "
                    + ", ".join(f"{n} {proxies.get(n)}" for n in sorted(behind))
                )
            await asyncio.sleep(0.5)

    async def kill_etcd(self) -> str:
        # A few rebalances after the upgrade, so that shares reflect the new fleet.
        await asyncio.sleep(3.0)
        sts = [n for k, n in self.cluster.objects if k == "StatefulSet"]
        for name in sts:
            # The controller goes first so that nothing restarts the members.
            self.cluster.stop_controller("StatefulSet", name)
            for pod in self.cluster.owned("StatefulSet", name):
                await self.cluster.kill_container(pod)
                pod.terminating = True
        # Longer than any readiness probe's period x failureThreshold, so that a
        # pod that would go unready with etcd gone has done so.
        await asyncio.sleep(ETCD_DOWN_WAIT_S)
        unready = [
            p.name
            for p in self.cluster.pods.values()
            if p.owner.startswith("Deployment/") and not p.ready
        ]
        if unready:
            raise ClusterError(f"not ready with etcd down: {unready}")
        ok = 0
        limited: dict[str, int] = {}
        for n in range(3):
            for region in sorted(self.region_services()):
                # The tenant without limits: availability with etcd down.
                client = self.client(region, retries=0, key=self.unlimited_key)
                try:
                    answer, _ = await self.chat(
                        region, stream=n % 2 == 1, text=f"etcd down {n}", client=client
                    )
                finally:
                    await client.close()
                if not answer:
                    raise ClusterError(f"{region}: empty answer with etcd down")
                ok += 1
                # The limited tenant keeps the shares it had when etcd went: a
                # proxy that joined just before may hold none (reported, see the
                # closing note of issue 18).
                try:
                    await self.chat(region, stream=False, text=f"limited {n}")
                except Exception as exc:
                    if getattr(exc, "status_code", None) != 429:
                        raise
                    limited[region] = limited.get(region, 0) + 1
        cp_ready = [
            p.name
            for p in self.cluster.pods.values()
            if p.owner.startswith("Deployment/") and "control" in p.owner and p.ready
        ]
        if not cp_ready:
            raise ClusterError("no control-plane replica stays ready with etcd down")
        # Readiness ("") stays SERVING on a replica with a table; its store health
        # says etcd is gone.

        store_down = []
        for name in cp_ready:
            pod = self.cluster.pods[name]
            port = self.cluster.named_ports(pod)["health"]
            store = Probe("grpc", port, service="ponto.store", timeout=3)
            ready = Probe("grpc", port, service="", timeout=3)
            end = time.monotonic() + 15
            while await self.cluster.probe(pod, store):
                if time.monotonic() > end:
                    raise ClusterError(f"{name}: ponto.store still SERVING with etcd down")
                await asyncio.sleep(0.2)
            if not await self.cluster.probe(pod, ready):
                raise ClusterError(f"{name}: readiness went NOT_SERVING with etcd down")
            store_down.append(name)
        return (
            f"{ok} requests answered with etcd down (limited tenant's 429s: "
            f"{limited or 'none'}); control planes ready with "
            f"ponto.store NOT_SERVING: {store_down}"
        )

    # ------------------------------------------------------------------ main

    async def main(self) -> int:
        await self.cluster.start()
        r = self.report
        try:
            await r.step("render the chart (three-region CI values) and apply it", self.install)
            await r.step(
                "pods ready (probes as the kubelet runs them)", lambda: self.wait_ready(150)
            )
            await r.step(
                "post-install hook: pontoctl apply", lambda: self.run_hooks("post-install")
            )
            await r.step("API key created and accepted by every region", self.create_key)
            await r.step("openai client through each region's Service", self.client_checks)
            await r.step(
                "regional cache: a repeat on another us-east pod is a region hit",
                self.regional_cache,
            )
            await r.step("/metrics on the metrics Service only", self.metrics_checks)
            await r.step("drain and undrain a region (rendered admin token)", self.drain_cycle)
            await r.step("NOTES.txt commands, as printed", self.notes_commands)
            await r.step(
                "helm upgrade: one more region, more replicas, under traffic", self.upgrade
            )
            await r.step("etcd killed: proxies keep serving", self.kill_etcd)
        except Exception:
            print(self.pod_summary(), flush=True)
            return 1
        finally:
            self.summary()
            await self.cluster.stop()
        return 0

    async def main_within(self, limit: float) -> int:
        try:
            return await asyncio.wait_for(self.main(), limit)
        except TimeoutError:
            print(f"chart-run: over its time limit of {limit:.0f} s", flush=True)
            return 1
        finally:
            # Connections that were still being forwarded when their pods went away.
            leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in leftover:
                task.cancel()
            await asyncio.gather(*leftover, return_exceptions=True)

    def summary(self) -> None:
        total = sum(s[2] for s in self.report.steps)
        print(f"\nchart-run: {len(self.report.steps)} steps in {total:.0f} s", flush=True)
        for name, ok, elapsed, _ in self.report.steps:
            print(f"  {'ok  ' if ok else 'FAIL'} {elapsed:6.1f}s {name}")
        kinds: dict[str, list[str]] = {}
        for kind, name in self.cluster.objects:
            kinds.setdefault(kind, []).append(name)
        print("objects in the release:")
        for kind, names in sorted(kinds.items()):
            print(f"  {kind}: {', '.join(sorted(names))}")
        if self.cluster.probe_timeouts:
            print(f"tcp probe timeouts: {self.cluster.probe_timeouts[:20]}")
        print(
            "  not acted on (docs/helm.md): node placement (nodeSelector, affinity, "
            "tolerations), PodDisruptionBudgets, the NetworkPolicy, resource limits, seccomp, "
            "HPA scaling beyond minReplicas, the ServiceMonitor, the image (make kind-e2e)"
        )
        for what, why in sorted(self.cluster.not_exercised.items()):
            print(f"  not exercised: {what}: {why}")


def notes_script(notes: str) -> str:
    """The commands in NOTES.txt: lines indented five spaces or more, as printed.

    Each command is echoed once before it runs (a `for … do … done` loop as a
    whole). A `kubectl port-forward` a user runs in a second terminal runs in the
    background here, and the script waits for its port before going on.
    """
    commands: list[str] = []
    pending = ""
    loop: list[str] = []
    for raw in notes.splitlines():
        if not raw.startswith("     ") and not pending:
            continue
        line = raw.strip()
        if pending:
            line = pending + " " + line
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if loop or (line.startswith(("for ", "while ")) and line.endswith("do")):
            loop.append(line)
            if line == "done" or line.endswith("; done"):
                commands.append("\n".join(loop))
                loop = []
            continue
        commands.append(line)
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for command in commands:
        quoted = command.replace("'", "'\\''")
        lines.append(f"echo; echo '$ {quoted}'")
        if command.startswith("kubectl") and " port-forward " in command:
            port = command.rstrip("&").split()[-1].split(":")[0]
            lines.append(command if command.endswith("&") else command + " &")
            lines.append(
                f"for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null "
                "&& break; sleep 0.1; done"
            )
            continue
        lines.append(command)
    return "\n".join(lines) + "\n"


def outside(argv: list[str]) -> int:
    """Re-run this module inside fresh network and mount namespaces."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        msg = "chart-run needs root, unshare and ip (network namespaces and veth pairs)"
        if os.environ.get("CI") == "true":
            print(f"chart-run: {msg}", file=sys.stderr)
            return 1
        print(f"chart-run: skipped: {msg}", file=sys.stderr)
        return 0
    env = {**os.environ, "CHARTRUN_INSIDE": "1"}
    # A PID namespace of its own: every pod process dies with the harness, however
    # the harness ends.
    cmd = ["unshare", "--net", "--mount", "--propagation", "private"]
    cmd += ["--pid", "--fork", "--kill-child", "--mount-proc", "--"]
    cmd += [sys.executable, "-m", "tests.chartrun", *argv]
    return subprocess.run(cmd, env=env, cwd=REPO, check=False).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="chart-run", description=__doc__.splitlines()[0])
    parser.add_argument("--helm", default=str(REPO / ".cache" / "helm" / "helm"))
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args(argv)
    if os.environ.get("CHARTRUN_INSIDE") != "1":
        return outside(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    # httpx logs a line per request at INFO; the steps report their counts instead.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: not record.name.startswith("httpx"))
    root = Path(tempfile.mkdtemp(prefix="ponto-chartrun-"))
    root.chmod(0o711)  # pods (user 10001) traverse it; only root lists it
    start = time.monotonic()
    try:
        run = Run(args, root)
        run.cluster.write_hosts()
        # The harness and the client checks resolve cluster names too.
        subprocess.run(["mount", "--bind", str(run.cluster.hosts_file), "/etc/hosts"], check=True)
        code = asyncio.run(run.main_within(TIME_LIMIT_S))
    finally:
        if args.keep:
            print(f"run directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"chart-run {'passed' if code == 0 else 'FAILED'} in {time.monotonic() - start:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
