"""A one-node Kubernetes made of local processes, enough to run what a chart renders.

What it does as Kubernetes would:

- **Pods**: a sandbox process holds the pod's network namespace (net.py); each
  container is a process in it with a private mount namespace (podinit.py), the
  rendered ``command``/``args`` (``$(VAR)`` expanded), ``env`` (values, Secret and
  ConfigMap keys, ``fieldRef: metadata.name``), volumes (Secret, ConfigMap,
  emptyDir, persistentVolumeClaim, volumeClaimTemplates), user and fsGroup, a
  read-only root file system.
- **Probes** as the kubelet runs them: startup, then readiness and liveness;
  ``httpGet`` and ``grpc`` (grpc.health.v1) on the pod's address, named ports
  resolved; a failed liveness probe restarts the container.
- **Services**: an address each; names resolve through /etc/hosts in every pod
  (``svc``, ``svc.ns``, ``svc.ns.svc``, ``svc.ns.svc.<domain>``); ports forwarded
  to ready endpoints only (headless Services: every pod's own name, ready or not
  with ``publishNotReadyAddresses``).
- **Workloads**: Deployments (replicas, or the HPA's minReplicas; rolling updates
  with maxSurge/maxUnavailable; a pod leaves its endpoints before its preStop hook
  and SIGTERM, killed after terminationGracePeriodSeconds), StatefulSets (stable
  names and volumes, parallel pods), Jobs (restartPolicy Never, backoffLimit).

What it does not: schedule over nodes (nodeSelector, affinity, tolerations and
PodDisruptionBudgets have one node and no evictions to act on), enforce
NetworkPolicies, resource limits or seccomp, pull images (an image map names the
local program for each image's entry point), autoscale beyond minReplicas, or
serve the Kubernetes API (the kubectl shim answers what NOTES.txt asks).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.chartrun import net

log = logging.getLogger("chart-run")
Obj = dict[str, Any]

# How long a terminating pod stays in its Services' endpoints (kube-proxy and
# load balancers learn of the removal a moment later, not at once).
ENDPOINT_DELAY_S = 1.0

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names replaced, unknown ones kept."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def key_of(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def template_hash(template: Obj) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass
class Probe:
    kind: str  # http | grpc | tcp | exec
    port: int
    path: str = "/"
    service: str = ""
    period: float = 10.0
    timeout: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1
    initial_delay: float = 0.0


def parse_probe(spec: Obj | None, ports: dict[str, int]) -> Probe | None:
    if not spec:
        return None

    def port_of(p: Any) -> int:
        return ports[p] if isinstance(p, str) else int(p)

    common = {
        "period": float(spec.get("periodSeconds", 10)),
        "timeout": float(spec.get("timeoutSeconds", 1)),
        "failure_threshold": int(spec.get("failureThreshold", 3)),
        "success_threshold": int(spec.get("successThreshold", 1)),
        "initial_delay": float(spec.get("initialDelaySeconds", 0)),
    }
    if "httpGet" in spec:
        h = spec["httpGet"]
        return Probe("http", port_of(h["port"]), path=h.get("path", "/"), **common)  # type: ignore[arg-type]
    if "grpc" in spec:
        g = spec["grpc"]
        return Probe("grpc", int(g["port"]), service=g.get("service", ""), **common)  # type: ignore[arg-type]
    if "tcpSocket" in spec:
        return Probe("tcp", port_of(spec["tcpSocket"]["port"]), **common)  # type: ignore[arg-type]
    raise ValueError(f"probe kind not supported by chart-run: {sorted(spec)}")


class ClusterError(RuntimeError):
    """Something the rendered objects ask for cannot be run."""


@dataclass
class Container:
    name: str
    spec: Obj
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    exit_code: int | None = None
    ready: bool = False
    log_file: Path = Path()
    env: dict[str, str] = field(default_factory=dict)
    user: list[str] = field(default_factory=list)  # nsenter's -S/-G for exec and hooks

    def nsenter(self, argv: list[str]) -> list[str]:
        """argv run in this container's namespaces, as its user (exec, hooks)."""
        assert self.proc is not None
        return ["nsenter", "-t", str(self.proc.pid), "-n", "-m", *self.user, "--", *argv]


@dataclass
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    spec: Obj
    owner: str  # "Deployment/x", "StatefulSet/y", "Job/z", "External/o"
    template_hash: str
    ip: str
    index: int
    dir: Path
    hostname: str = ""
    subdomain: str = ""
    sandbox: asyncio.subprocess.Process | None = None
    containers: list[Container] = field(default_factory=list)
    terminating: bool = False
    terminating_since: float = 0.0
    last_probe_error: str = ""
    deleted: bool = False
    restart_policy: str = "Always"
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return (
            not self.terminating and bool(self.containers) and all(c.ready for c in self.containers)
        )

    @property
    def succeeded(self) -> bool:
        return bool(self.containers) and all(c.exit_code == 0 for c in self.containers)

    @property
    def failed(self) -> bool:
        return any(c.exit_code not in (None, 0) for c in self.containers)

    def main_pid(self) -> int:
        for c in self.containers:
            if c.proc is not None and c.proc.returncode is None:
                return c.proc.pid
        raise ClusterError(f"pod {self.name} has no running container")


@dataclass
class ImageMap:
    """What runs for an image's entry point: the local file for each command name."""

    commands: dict[str, str]
    default_path: str

    def image_env(self, image: str) -> dict[str, str]:
        """The ENV lines of the image (the Dockerfile's for Ponto's own image)."""
        if "etcd" in image:
            return {"HOME": "/"}
        if _is_redis(image):
            return {"HOME": "/data"}
        return {"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}

    def workdir(self, image: str) -> str:
        if _is_redis(image):
            return "/data"  # the official Valkey and Redis images' WORKDIR
        return "/" if "etcd" in image else "/tmp"

    def resolve(self, argv0: str) -> str:
        if argv0 in self.commands:
            return self.commands[argv0]
        base = os.path.basename(argv0)
        if base in self.commands:
            return self.commands[base]
        found = shutil.which(argv0, path=self.default_path)
        if found:
            return found
        raise ClusterError(f"no local program for the image entry point {argv0!r}")


class Cluster:
    """Objects as the API server would hold them, and the controllers that act on them.

    Single-threaded (one asyncio loop); every method is called from that loop.
    """

    def __init__(
        self,
        root: Path,
        images: ImageMap,
        *,
        namespace: str,
        cluster_domain: str = "cluster.local",
        python: str = sys.executable,
        repo: Path,
    ) -> None:
        self.root = root
        self.images = images
        self.namespace = namespace
        self.domain = cluster_domain
        self.python = python
        self.repo = repo
        self.objects: dict[tuple[str, str], Obj] = {}
        self.pods: dict[str, Pod] = {}
        self.service_ips: dict[str, str] = {}
        self.hosts_file = root / "hosts"
        self.external_hosts: dict[str, str] = {}
        self._pod_ips = net.addresses("127.1.1.1")
        self._svc_ips = net.addresses("127.1.200.1")
        self._pod_index = itertools.count(1)
        self._servers: dict[tuple[str, int], asyncio.Server] = {}
        self._rr = itertools.count()
        self._controllers: dict[str, asyncio.Task[None]] = {}
        self._created_mountpoints: list[Path] = []
        self._background: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None
        self.probe_timeouts: list[str] = []
        self.not_exercised: dict[str, str] = {}

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        net.setup_node()
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self.write_hosts()

    async def stop(self) -> None:
        for task in self._controllers.values():
            task.cancel()
        await asyncio.gather(
            *(self._kill_pod(p, grace=2.0) for p in list(self.pods.values())),
            return_exceptions=True,
        )
        for server in self._servers.values():
            server.close()
        if self._http is not None:
            await self._http.close()
        for path in reversed(self._created_mountpoints):
            with contextlib.suppress(OSError):
                path.rmdir()

    def event(self, text: str) -> None:
        log.info("%s", text)

    # ----------------------------------------------------------------- objects

    def get(self, kind: str, name: str) -> Obj:
        try:
            return self.objects[(kind, name)]
        except KeyError:
            raise ClusterError(f"{kind}/{name} does not exist") from None

    def secret_value(self, name: str, key: str) -> bytes:
        secret = self.get("Secret", name)
        if key in secret.get("data", {}):
            return base64.b64decode(secret["data"][key])
        if key in secret.get("stringData", {}):
            return str(secret["stringData"][key]).encode()
        raise ClusterError(f"Secret {name} has no key {key}")

    def configmap_value(self, name: str, key: str) -> bytes:
        return str(self.get("ConfigMap", name)["data"][key]).encode()

    async def apply(self, objects: Iterable[Obj], *, prune: bool) -> None:
        """Create or update objects as `helm upgrade` does (hooks are the caller's).

        With prune, objects of the previous apply that the new set lacks are deleted.
        """
        new = {key_of(o): o for o in objects}
        if prune:
            for key in [k for k in self.objects if k not in new and k[0] != "Job"]:
                await self.delete(*key)
        for key, obj in new.items():
            old = self.objects.get(key)
            self.objects[key] = obj
            if old == obj:
                continue
            self.event(f"{'configured' if old else 'created'} {key[0]}/{key[1]}")
            kind = key[0]
            if kind == "Service":
                await self._ensure_service(obj)
            elif kind in ("Deployment", "StatefulSet"):
                self._kick(key)
        self.write_hosts()

    async def delete(self, kind: str, name: str) -> None:
        obj = self.objects.pop((kind, name), None)
        if obj is None:
            return
        self.event(f"deleted {kind}/{name}")
        self.stop_controller(kind, name)
        if kind in ("Deployment", "StatefulSet", "Job"):
            owner = f"{kind}/{name}"
            await asyncio.gather(
                *(self.terminate(p) for p in self.pods.values() if p.owner == owner)
            )
        if kind == "Service":
            for port in obj["spec"].get("ports", []):
                server = self._servers.pop((name, int(port["port"])), None)
                if server:
                    server.close()

    # ----------------------------------------------------------------- names

    def write_hosts(self) -> None:
        """Cluster DNS as a hosts file, rewritten in place (pods bind-mount the inode)."""
        lines = ["127.0.0.1 localhost"]
        ns = self.namespace
        for name, ip in self.service_ips.items():
            names = [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.{self.domain}"]
            lines.append(f"{ip} {' '.join(names)}")
        for pod in self.pods.values():
            if pod.deleted or pod.terminating or not pod.subdomain:
                continue
            svc = self.objects.get(("Service", pod.subdomain))
            if svc is None or svc["spec"].get("clusterIP") != "None":
                continue  # no headless Service of that name: no pod records
            if not matches(svc["spec"].get("selector", {}), pod.labels):
                continue
            if not (pod.ready or svc["spec"].get("publishNotReadyAddresses")):
                continue
            base = f"{pod.hostname}.{pod.subdomain}.{ns}.svc"
            lines.append(f"{pod.ip} {base} {base}.{self.domain}")
        for host, ip in self.external_hosts.items():
            lines.append(f"{ip} {host}")
        text = "\n".join(lines) + "\n"
        if not self.hosts_file.exists():
            self.hosts_file.write_text(text)
            return
        with open(self.hosts_file, "r+") as f:
            f.seek(0)
            f.write(text)
            f.truncate()

    def resolve(self, host: str) -> str:
        for line in self.hosts_file.read_text().splitlines():
            ip, *names = line.split()
            if host in names:
                return ip
        raise ClusterError(f"{host} does not resolve in the cluster")

    # ----------------------------------------------------------------- services

    async def _ensure_service(self, svc: Obj) -> None:
        name = svc["metadata"]["name"]
        spec = svc["spec"]
        if spec.get("clusterIP") == "None":
            return  # headless: per-pod names only
        if name not in self.service_ips:
            ip = next(self._svc_ips)
            net.add_service_address(ip)
            self.service_ips[name] = ip
        ip = self.service_ips[name]
        for port in spec.get("ports", []):
            key = (name, int(port["port"]))
            if key in self._servers:
                continue

            async def handle(
                reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter,
                svc_name: str = name,
                svc_port: int = int(port["port"]),
            ) -> None:
                # Held here: a connection cut at both ends may leave no other
                # reference to this task while it waits.
                task = asyncio.current_task()
                assert task is not None
                self._background.add(task)
                try:
                    await self._forward(svc_name, svc_port, reader, writer)
                except asyncio.CancelledError:
                    # Cut when a Service or the cluster goes: nothing waits for
                    # this task, and asyncio's start_server would log a handler
                    # that ends cancelled as an error with a traceback.
                    return
                finally:
                    self._background.discard(task)

            self._servers[key] = await asyncio.start_server(handle, ip, int(port["port"]))

    def endpoints(self, service: str, port: int) -> list[tuple[Pod, int]]:
        """Ready pods behind a Service port, with the pod port each takes."""
        svc = self.objects.get(("Service", service))
        if svc is None:
            return []
        spec = svc["spec"]
        selector = spec.get("selector", {})
        target: Any = None
        for p in spec.get("ports", []):
            if int(p["port"]) == port:
                target = p.get("targetPort", p["port"])
        out = []
        now = time.monotonic()
        for pod in self.pods.values():
            if pod.deleted or not matches(selector, pod.labels):
                continue
            # Endpoint removal reaches every node's proxy a moment after the pod
            # starts terminating (its preStop hook covers that moment).
            lingering = pod.terminating and now - pod.terminating_since < ENDPOINT_DELAY_S
            serving = all(c.ready for c in pod.containers) and bool(pod.containers)
            if not (pod.ready or (lingering and serving)):
                continue
            if isinstance(target, str):
                ports = self.named_ports(pod)
                if target not in ports:
                    continue
                out.append((pod, ports[target]))
            else:
                out.append((pod, int(target)))
        return out

    async def open_to_service(
        self, service: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        eps = self.endpoints(service, port)
        if not eps:
            raise ConnectionRefusedError(f"service {service}:{port} has no ready endpoints")
        pod, target = eps[next(self._rr) % len(eps)]
        return await asyncio.open_connection(pod.ip, target)

    async def _forward(
        self, service: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            up_reader, up_writer = await self.open_to_service(service, port)
        except OSError:
            writer.close()
            return
        await pipe_both(reader, writer, up_reader, up_writer)

    async def port_forward(self, service: str, remote: int, local: int) -> asyncio.Server:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await self._forward(service, remote, r, w)

        return await asyncio.start_server(handle, "127.0.0.1", local)

    # ----------------------------------------------------------------- workloads

    def _kick(self, key: tuple[str, str]) -> None:
        name = f"{key[0]}/{key[1]}"
        task = self._controllers.get(name)
        if task is None or task.done():
            self._controllers[name] = asyncio.create_task(self._reconcile_loop(key))

    async def _reconcile_loop(self, key: tuple[str, str]) -> None:
        try:
            while key in self.objects:
                obj = self.objects[key]
                if key[0] == "Deployment":
                    await self._reconcile_deployment(obj)
                else:
                    await self._reconcile_statefulset(obj)
                await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("controller %s/%s failed", *key)
            raise

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def desired_replicas(self, obj: Obj) -> int:
        name = obj["metadata"]["name"]
        for (kind, _), hpa in self.objects.items():
            if kind != "HorizontalPodAutoscaler":
                continue
            ref = hpa["spec"]["scaleTargetRef"]
            if ref["kind"] == obj["kind"] and ref["name"] == name:
                return int(hpa["spec"].get("minReplicas", 1))
        return int(obj["spec"].get("replicas", 1))

    def owned(self, kind: str, name: str) -> list[Pod]:
        owner = f"{kind}/{name}"
        return [p for p in self.pods.values() if p.owner == owner and not p.terminating]

    async def _reconcile_deployment(self, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        want = self.desired_replicas(obj)
        template = obj["spec"]["template"]
        h = template_hash(template)
        strategy = obj["spec"].get("strategy", {}).get("rollingUpdate", {})
        surge = _scaled(strategy.get("maxSurge", "25%"), want, up=True)
        unavailable = _scaled(strategy.get("maxUnavailable", "25%"), want, up=False)
        if surge == 0 and unavailable == 0:
            raise ClusterError(f"Deployment {name}: maxSurge and maxUnavailable are both 0")
        pods = self.owned("Deployment", name)
        new = [p for p in pods if p.template_hash == h]
        old = [p for p in pods if p.template_hash != h]
        ready = [p for p in pods if p.ready]
        # Scale up the new set within the surge.
        while len(new) < want and len(new) + len(old) < want + surge:
            pod = await self.create_pod(
                f"{name}-{h[:6]}-{_suffix()}", template, f"Deployment/{name}", h
            )
            new.append(pod)
        # Remove old pods while enough stay available.
        min_available = want - unavailable
        for pod in list(old):
            if len(ready) - (1 if pod.ready else 0) < min_available and pod.ready:
                break
            old.remove(pod)
            if pod in ready:
                ready.remove(pod)
            self._spawn(self.terminate(pod))
        # Scale down surplus new pods (not-ready first).
        surplus = len(new) - want
        for pod in sorted(new, key=lambda p: p.ready)[: max(0, surplus)]:
            self._spawn(self.terminate(pod))

    async def _reconcile_statefulset(self, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        want = self.desired_replicas(obj)
        template = obj["spec"]["template"]
        h = template_hash(template)
        service = obj["spec"].get("serviceName", "")
        claims = obj["spec"].get("volumeClaimTemplates", [])
        pods = {p.name: p for p in self.owned("StatefulSet", name)}
        ordered = obj["spec"].get("podManagementPolicy", "OrderedReady") == "OrderedReady"
        for i in range(want):
            pod_name = f"{name}-{i}"
            if pod_name not in pods and pod_name in self.pods:
                return  # the previous pod of that name is still terminating
            if pod_name not in pods:
                volumes = {
                    c["metadata"]["name"]: {
                        "persistentVolumeClaim": {
                            "claimName": f"{c['metadata']['name']}-{pod_name}"
                        }
                    }
                    for c in claims
                }
                await self.create_pod(
                    pod_name,
                    template,
                    f"StatefulSet/{name}",
                    h,
                    hostname=pod_name,
                    subdomain=service,
                    extra_volumes=volumes,
                )
                if ordered:
                    return  # OrderedReady: the next ordinal once this one is ready
            elif ordered and not pods[pod_name].ready:
                return
        for pod_name, pod in pods.items():
            if int(pod_name.rsplit("-", 1)[1]) >= want:
                await self.terminate(pod)
        # Rolling update: the highest ordinal first, one at a time, the rest ready.
        current = [pods[f"{name}-{i}"] for i in range(want) if f"{name}-{i}" in pods]
        if len(current) == want and all(p.ready for p in current):
            for pod in reversed(current):
                if pod.template_hash != h:
                    await self.terminate(pod)
                    return

    async def run_job(self, job: Obj, *, deadline: float) -> Pod:
        """Run a Job to completion: a new pod per failure, up to backoffLimit."""
        name = job["metadata"]["name"]
        spec = job["spec"]
        backoff = int(spec.get("backoffLimit", 6))
        limit = min(deadline, float(spec.get("activeDeadlineSeconds", deadline)))
        end = time.monotonic() + limit
        self.objects[key_of(job)] = job
        for attempt in range(backoff + 1):
            pod = await self.create_pod(
                f"{name}-{_suffix()}", spec["template"], f"Job/{name}", "job"
            )
            while not (pod.succeeded or pod.failed):
                if time.monotonic() > end:
                    await self.terminate(pod)
                    raise ClusterError(f"Job {name} passed its deadline")
                await asyncio.sleep(0.1)
            if pod.succeeded:
                self.event(f"Job {name} succeeded (attempt {attempt + 1})")
                return pod
            self.event(f"Job {name} pod {pod.name} failed: {tail(pod.containers[0].log_file)}")
            # The Job controller's back-off starts at 10 s; this harness waits 1 s so
            # that a broken Job fails the run within its time budget.
            await asyncio.sleep(1.0)
        raise ClusterError(f"Job {name} failed {backoff + 1} times")

    # ----------------------------------------------------------------- pods

    def named_ports(self, pod: Pod) -> dict[str, int]:
        ports: dict[str, int] = {}
        for c in pod.spec.get("containers", []):
            for p in c.get("ports", []):
                if "name" in p:
                    ports[p["name"]] = int(p["containerPort"])
        return ports

    async def create_pod(
        self,
        name: str,
        template: Obj,
        owner: str,
        thash: str,
        *,
        hostname: str = "",
        subdomain: str = "",
        extra_volumes: dict[str, Obj] | None = None,
    ) -> Pod:
        meta = template.get("metadata", {})
        spec = json.loads(json.dumps(template["spec"]))
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for vname, vsrc in (extra_volumes or {}).items():
            volumes[vname] = {"name": vname, **vsrc}
        spec["volumes"] = list(volumes.values())
        index = next(self._pod_index)
        pod = Pod(
            name=name,
            namespace=self.namespace,
            labels=dict(meta.get("labels", {})),
            spec=spec,
            owner=owner,
            template_hash=thash,
            ip=next(self._pod_ips),
            index=index,
            dir=self.root / "pods" / f"{name}.{index}",
            hostname=hostname,
            subdomain=subdomain,
            restart_policy=spec.get("restartPolicy", "Always"),
        )
        pod.dir.mkdir(parents=True)
        pod.dir.chmod(0o711)
        self.pods[name] = pod
        self.event(f"pod {name} ({owner}) at {pod.ip}")
        pod.sandbox = await asyncio.create_subprocess_exec("unshare", "--net", "sleep", "infinity")
        own = net.netns_inode("self")
        while net.netns_inode(pod.sandbox.pid) == own:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(net.attach_pod, pod.sandbox.pid, index, pod.ip)
        if subdomain:
            self.write_hosts()
        for cspec in spec.get("initContainers", []):
            raise ClusterError(f"{name}: init containers are not supported ({cspec['name']})")
        for cspec in spec["containers"]:
            c = Container(cspec["name"], cspec, log_file=pod.dir / f"{cspec['name']}.log")
            pod.containers.append(c)
            pod.tasks.append(asyncio.create_task(self._run_container(pod, c)))
        return pod

    def _volume_source(self, pod: Pod, vol: Obj) -> Path:
        """Materialise a volume for the pod; returns the host directory to bind."""
        sc = pod.spec.get("securityContext", {})
        fs_group = sc.get("fsGroup")
        path: Path = pod.dir / "volumes" / str(vol["name"])
        if "secret" in vol or "configMap" in vol:
            src = vol.get("secret") or vol["configMap"]
            is_secret = "secret" in vol
            obj_name = src["secretName"] if is_secret else src["name"]
            obj = self.get("Secret" if is_secret else "ConfigMap", obj_name)
            data = obj.get("data", {})
            keys = (
                [(i["key"], i["path"]) for i in src["items"]]
                if "items" in src
                else [(k, k) for k in data]
            )
            mode = int(src.get("defaultMode", 0o644))
            path.mkdir(parents=True)
            for key, rel in keys:
                raw = base64.b64decode(data[key]) if is_secret else str(data[key]).encode()
                target = path / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(raw)
                target.chmod(mode)
                if fs_group is not None:
                    os.chown(target, 0, int(fs_group))
            path.chmod(0o755)
            return path
        if "emptyDir" in vol:
            path.mkdir(parents=True)
            path.chmod(0o777)
            return path
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            pv: Path = self.root / "pv" / str(claim)
            if not pv.exists():
                pv.mkdir(parents=True)
            if fs_group is not None:
                os.chown(pv, 0, int(fs_group))
                pv.chmod(0o2775)
            return pv
        raise ClusterError(f"{pod.name}: volume kind not supported: {sorted(vol)}")

    def _env(self, pod: Pod, cspec: Obj) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in cspec.get("envFrom", []):
            if "secretRef" in item:
                for k, v in self.get("Secret", item["secretRef"]["name"]).get("data", {}).items():
                    env[k] = base64.b64decode(v).decode()
            if "configMapRef" in item:
                env.update(self.get("ConfigMap", item["configMapRef"]["name"]).get("data", {}))
        for item in cspec.get("env", []):
            if "value" in item:
                # $(VAR) names only variables defined before it in the container.
                env[item["name"]] = expand(str(item["value"]), env)
                continue
            ref = item["valueFrom"]
            if "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                values = {
                    "metadata.name": pod.name,
                    "metadata.namespace": pod.namespace,
                    "status.podIP": pod.ip,
                }
                if path not in values:
                    raise ClusterError(f"{pod.name}: fieldRef {path} is not supported")
                env[item["name"]] = values[path]
            elif "secretKeyRef" in ref:
                r = ref["secretKeyRef"]
                env[item["name"]] = self.secret_value(r["name"], r["key"]).decode()
            elif "configMapKeyRef" in ref:
                r = ref["configMapKeyRef"]
                env[item["name"]] = self.configmap_value(r["name"], r["key"]).decode()
            else:
                raise ClusterError(f"{pod.name}: env source not supported: {sorted(ref)}")
        return env

    def container_env(self, pod: Pod, cspec: Obj, declared: dict[str, str]) -> dict[str, str]:
        """What the process sees: the image's ENV, then the pod's, then the container's."""
        return {
            "PATH": self.images.default_path,
            **self.images.image_env(cspec.get("image", "")),
            "HOSTNAME": pod.hostname or pod.name,
            **declared,
        }

    def _ensure_mountpoint(self, path: Path) -> None:
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            m.mkdir()
            self._created_mountpoints.append(m)

    async def _start_container(self, pod: Pod, c: Container) -> None:
        cspec = c.spec
        declared = self._env(pod, cspec)
        argv = [expand(a, declared) for a in [*cspec.get("command", []), *cspec.get("args", [])]]
        env = self.container_env(pod, cspec, declared)
        if not argv:
            raise ClusterError(f"{pod.name}/{c.name}: no command (image defaults are not known)")
        argv[0] = self.images.resolve(argv[0])
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        mounts = []
        for vm in cspec.get("volumeMounts", []):
            vol = volumes[vm["name"]]
            src_dir = pod.dir / "volumes" / vm["name"]
            if "persistentVolumeClaim" in vol or not src_dir.exists():
                src_dir = self._volume_source(pod, vol)
            source = src_dir / vm["subPath"] if "subPath" in vm else src_dir
            target = Path(vm["mountPath"])
            self._ensure_mountpoint(target)
            mounts.append(
                {"source": str(source), "path": str(target), "read_only": bool(vm.get("readOnly"))}
            )
        psc = pod.spec.get("securityContext", {})
        csc = cspec.get("securityContext", {})
        uid = csc.get("runAsUser", psc.get("runAsUser"))
        gid = csc.get("runAsGroup", psc.get("runAsGroup"))
        if (csc.get("runAsNonRoot") or psc.get("runAsNonRoot")) and not uid:
            raise ClusterError(f"{pod.name}/{c.name}: runAsNonRoot without a runAsUser")
        expose = []
        image_paths = [str(self.repo), os.path.realpath(sys.base_prefix)]
        if uid:
            blocked = _blocked_ancestor(Path(os.path.realpath(sys.base_prefix)), int(uid))
            if blocked is not None:
                expose.append({"path": os.path.realpath(sys.base_prefix), "blocked": str(blocked)})
        spec = {
            "hosts_file": str(self.hosts_file),
            "expose": expose,
            "image_paths": image_paths,
            "mounts": mounts,
            "read_only_root": bool(csc.get("readOnlyRootFilesystem")),
            "uid": uid,
            "gid": gid,
            "fs_group": psc.get("fsGroup"),
            "env": env,
            "argv": argv,
            "cwd": cspec.get("workingDir", self.images.workdir(cspec.get("image", ""))),
            "log_file": str(c.log_file),
        }
        c.env = env
        c.user = []
        if uid is not None:
            c.user += ["-S", str(uid)]
        if gid is not None:
            c.user += ["-G", str(gid)]
        spec_file = pod.dir / f"{c.name}.spec.json"
        spec_file.write_text(json.dumps(spec))
        spec_file.chmod(0o600)  # it holds Secret values
        assert pod.sandbox is not None
        c.proc = await asyncio.create_subprocess_exec(
            "nsenter",
            f"--net=/proc/{pod.sandbox.pid}/ns/net",
            "--",
            "unshare",
            "--mount",
            "--",
            self.python,
            "-m",
            "tests.chartrun.podinit",
            str(spec_file),
            cwd=self.repo,
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(self.repo)},
            stdin=asyncio.subprocess.DEVNULL,
        )
        c.started_at = time.monotonic()
        c.exit_code = None
        c.ready = False
        self.event(f"started {pod.name}/{c.name} pid {c.proc.pid}: {' '.join(argv[:1])}")

    async def _run_container(self, pod: Pod, c: Container) -> None:
        """Start, probe and restart one container until its pod terminates."""
        ports = self.named_ports(pod)
        startup = parse_probe(c.spec.get("startupProbe"), ports)
        readiness = parse_probe(c.spec.get("readinessProbe"), ports)
        liveness = parse_probe(c.spec.get("livenessProbe"), ports)
        backoff = 0.5
        while not pod.terminating:
            try:
                await self._start_container(pod, c)
            except Exception as exc:
                self.event(f"{pod.name}/{c.name} cannot start: {exc}")
                c.exit_code = 128
                return
            assert c.proc is not None
            probes = asyncio.create_task(self._probe_loop(pod, c, startup, readiness, liveness))
            code = await c.proc.wait()
            probes.cancel()
            c.ready = False
            c.exit_code = code
            if _stopping(pod):
                return
            self.event(f"{pod.name}/{c.name} exited {code}: {tail(c.log_file)}")
            if pod.restart_policy == "Never" or (pod.restart_policy == "OnFailure" and code == 0):
                return
            c.restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _probe_loop(
        self,
        pod: Pod,
        c: Container,
        startup: Probe | None,
        readiness: Probe | None,
        liveness: Probe | None,
    ) -> None:
        assert c.proc is not None
        if startup is not None:
            # The kubelet allows period x failureThreshold; chart-run probes more
            # often within that allowance, so the run does not wait out periods.
            allowance = startup.initial_delay + startup.period * startup.failure_threshold
            await asyncio.sleep(startup.initial_delay)
            while not await self.probe(pod, startup):
                if time.monotonic() - c.started_at > allowance:
                    self.event(f"{pod.name}/{c.name} failed its startup probe: restarting")
                    await _kill(c.proc, grace=1.0)
                    return
                await asyncio.sleep(min(startup.period, 0.25))
        if readiness is None:
            c.ready = True
        tasks = []
        if readiness is not None:
            tasks.append(self._watch(pod, c, readiness, live=False))
        if liveness is not None:
            tasks.append(self._watch(pod, c, liveness, live=True))
        await asyncio.gather(*tasks)

    async def _watch(self, pod: Pod, c: Container, probe: Probe, *, live: bool) -> None:
        await asyncio.sleep(probe.initial_delay)
        fails = successes = 0
        # The kubelet probes readiness on its period; chart-run probes faster while
        # a pod is not ready yet, so the run does not wait whole periods.
        while True:
            ok = await self.probe(pod, probe)
            if ok:
                fails = 0
                successes += 1
                if not live and not c.ready and pod.last_probe_error:
                    pod.last_probe_error = ""
                if not live and successes >= probe.success_threshold and not c.ready:
                    c.ready = True
                    self.write_hosts()
                    self.event(f"{pod.name}/{c.name} ready")
            else:
                successes = 0
                fails += 1
                if fails >= probe.failure_threshold:
                    if live:
                        self.event(f"{pod.name}/{c.name} failed its liveness probe: restarting")
                        assert c.proc is not None
                        await _kill(
                            c.proc, grace=float(pod.spec.get("terminationGracePeriodSeconds", 30))
                        )
                        return
                    if c.ready:
                        self.event(f"{pod.name}/{c.name} not ready")
                    c.ready = False
                    self.write_hosts()
            fast = not live and not c.ready
            await asyncio.sleep(min(probe.period, 0.25) if fast else probe.period)

    async def probe(self, pod: Pod, probe: Probe) -> bool:
        try:
            if probe.kind == "http":
                assert self._http is not None
                url = f"http://{pod.ip}:{probe.port}{probe.path}"
                async with self._http.get(
                    url, timeout=aiohttp.ClientTimeout(total=probe.timeout)
                ) as resp:
                    return 200 <= resp.status < 400
            if probe.kind == "grpc":
                async with grpc.aio.insecure_channel(f"{pod.ip}:{probe.port}") as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    resp = await stub.Check(
                        health_pb2.HealthCheckRequest(service=probe.service),
                        timeout=probe.timeout,
                    )
                    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
            if probe.kind == "tcp":
                # Attempts of at most 1 s (the kubelet waits timeoutSeconds): on this
                # machine a new pod's first connections from the node are now and
                # then unanswered for a while, and fresh short attempts get through
                # sooner. Timeouts are listed in the summary.
                t0 = time.monotonic()
                try:
                    _, w = await asyncio.wait_for(
                        asyncio.open_connection(pod.ip, probe.port), min(probe.timeout, 1.0)
                    )
                except TimeoutError:
                    self.probe_timeouts.append(f"{pod.name} {time.monotonic() - t0:.1f}s")
                    raise
                w.close()
                return True
        except (OSError, TimeoutError, aiohttp.ClientError, grpc.aio.AioRpcError) as exc:
            pod.last_probe_error = f"{probe.kind} :{probe.port}: {type(exc).__name__}: {exc}"
            return False
        return False

    async def terminate(self, pod: Pod) -> None:
        """Delete a pod: out of endpoints first, then preStop, SIGTERM, and the grace period."""
        if pod.terminating:
            return
        pod.terminating = True
        pod.terminating_since = time.monotonic()
        self.write_hosts()
        self.event(f"terminating pod {pod.name}")
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        start = time.monotonic()
        for c in pod.containers:
            pre = c.spec.get("lifecycle", {}).get("preStop", {})
            if "exec" in pre and c.proc is not None and c.proc.returncode is None:
                hook = await asyncio.create_subprocess_exec(
                    *c.nsenter(pre["exec"]["command"]), env=c.env
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hook.wait(), grace)
        left = max(1.0, grace - (time.monotonic() - start))
        await self._kill_pod(pod, grace=left)

    async def _kill_pod(self, pod: Pod, *, grace: float) -> None:
        pod.terminating = True
        await asyncio.gather(
            *(_kill(c.proc, grace=grace) for c in pod.containers if c.proc is not None)
        )
        for t in pod.tasks:
            t.cancel()
        if pod.sandbox is not None:
            await _kill(pod.sandbox, grace=1.0)
        pod.deleted = True
        self.pods.pop(pod.name, None)
        self.write_hosts()

    def stop_controller(self, kind: str, name: str) -> None:
        """Stop reconciling a workload (its pods stay as they are)."""
        task = self._controllers.pop(f"{kind}/{name}", None)
        if task:
            task.cancel()

    async def kill_container(self, pod: Pod) -> None:
        """SIGKILL every container of a pod (a crash), without deleting it."""
        for c in pod.containers:
            if c.proc is not None and c.proc.returncode is None:
                c.proc.kill()

    async def exec_in(
        self, pod: Pod, argv: list[str], *, env: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """`kubectl exec`: argv in the container's namespaces, as its user, with its env."""
        c = pod.containers[0]
        resolved = [self.images.resolve(argv[0]), *argv[1:]]
        proc = await asyncio.create_subprocess_exec(
            *c.nsenter(resolved),
            env=env or c.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        return proc.returncode or 0, out

    def workload_ready(self, kind: str, name: str) -> bool:
        obj = self.objects.get((kind, name))
        if obj is None:
            return False
        h = template_hash(obj["spec"]["template"])
        pods = self.owned(kind, name)
        want = self.desired_replicas(obj)
        current = [p for p in pods if p.template_hash == h]
        return len(current) == want and all(p.ready for p in current) and len(pods) == want


async def pipe_both(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while chunk := await r.read(65536):
                w.write(chunk)
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if w.can_write_eof():
                    w.write_eof()

    await asyncio.gather(pump(a_reader, b_writer), pump(b_reader, a_writer))
    for w in (a_writer, b_writer):
        w.close()


async def _kill(proc: asyncio.subprocess.Process, *, grace: float) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def _is_redis(image: str) -> bool:
    name = image.rsplit("/", 1)[-1]
    return name.startswith(("valkey:", "redis:"))


def _stopping(pod: Pod) -> bool:
    # A function, not the attribute, so that type narrowing from the loop
    # condition does not hide that another task may have set it meanwhile.
    return pod.terminating


def _blocked_ancestor(path: Path, uid: int) -> Path | None:
    """The outermost directory above `path` that `uid` (not its owner) cannot enter."""
    for parent in reversed(path.parents):
        st = parent.stat()
        if st.st_uid != uid and not st.st_mode & 0o001:
            return parent
    return None


def _scaled(value: Any, replicas: int, *, up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        exact = replicas * int(value[:-1]) / 100
        return math.ceil(exact) if up else math.floor(exact)
    return int(value)


_suffixes = itertools.count(1)


def _suffix() -> str:
    return f"{next(_suffixes):05d}"


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])
