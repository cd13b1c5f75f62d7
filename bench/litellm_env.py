"""A LiteLLM proxy to compare Ponto with: its own venv, a config for one origin, a process.

    .venv/bin/python -m bench.litellm_env --origin http://127.0.0.1:9000/v1   # try it by hand

LiteLLM is installed into ``.bench/litellm-venv`` (never into the project's
venv: its dependency tree is large and pins its own grpcio/protobuf), from
PyPI at a pinned version, once; a stamp file records what was installed.

Why 1.106.12: it is the newest release whose ``[proxy]`` extra resolves here.
From 1.108 on the extra pins ``litellm-proxy-extras`` post-releases that the
index does not serve, and from 1.110 it needs a ``litellm-proxy`` package that
is not published at all. 1.82.7-1.82.8 and 1.107.0 (compromised releases,
withdrawn from PyPI) are not candidates.

The config makes LiteLLM as cheap as it can be for this comparison: one model
on the origin simulator as an OpenAI-compatible provider (``openai/<model>``
with ``api_base``), no callbacks, telemetry off, message logging off, no
database (so no spend logs), the cost map read from the package instead of
fetched, log level ERROR, one worker; uvicorn with uvloop and httptools.
LiteLLM refuses to start its proxy without a master key, so one is set and the
benchmark sends it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.procs import affinity

LITELLM_VERSION = "1.106.12"
# uvicorn's C HTTP parser, as `uvicorn[standard]` brings: without it LiteLLM's
# uvicorn parses HTTP in pure Python (h11) and would look slower than a
# production install is.
EXTRAS = ("httptools==0.9.0",)
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = ROOT / ".bench" / "litellm-venv"
MASTER_KEY = "sk-ponto-bench-master"
INSTALL_TIMEOUT = 900.0
START_TIMEOUT = 180.0


class LiteLLMUnavailable(RuntimeError):
    """LiteLLM could not be installed or started; the message says why."""


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if not line.startswith("WARNING: Location")]
    return "\n".join(kept[-lines:])


def venv_python(venv: Path = DEFAULT_VENV) -> Path:
    return venv / "bin" / "python"


def ensure_installed(venv: Path = DEFAULT_VENV, version: str = LITELLM_VERSION) -> Path:
    """Create the venv and install ``litellm[proxy]==version`` unless already there.

    Returns the venv's ``litellm`` entry point. Raises LiteLLMUnavailable with
    the end of pip's log when the install fails.
    """
    stamp = venv / f".installed-litellm-{version}-{'-'.join(EXTRAS)}"
    entry = venv / "bin" / "litellm"
    if stamp.exists() and entry.exists():
        return entry
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / "litellm-install.log"
    started = time.monotonic()
    print(f"installing litellm[proxy]=={version} into {venv} (once; about 1-2 minutes) ...")
    with log.open("w") as out:
        try:
            if not venv_python(venv).exists():
                subprocess.run(
                    [sys.executable, "-m", "venv", "--clear", str(venv)],
                    check=True,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=120,
                )
            subprocess.run(
                [str(venv_python(venv)), "-m", "pip", "install", "--quiet",
                 "--disable-pip-version-check", f"litellm[proxy]=={version}", *EXTRAS],
                check=True,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=INSTALL_TIMEOUT,
            )  # fmt: skip
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            raise LiteLLMUnavailable(
                f"pip could not install litellm[proxy]=={version} ({exc}); log {log}:\n{_tail(log)}"
            ) from exc
    if not entry.exists():
        raise LiteLLMUnavailable(f"litellm[proxy]=={version} installed no {entry}")
    for old in venv.glob(".installed-litellm-*"):
        old.unlink()
    stamp.touch()
    print(f"installed litellm {version} in {time.monotonic() - started:.0f} s")
    return entry


def write_config(path: Path, origin_url: str, models: tuple[str, ...]) -> Path:
    """A LiteLLM proxy config routing each model to the origin (an OpenAI-compatible API)."""
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": origin_url,
                    "api_key": "sk-origin-unused",
                },
            }
            for model in models
        ],
        "litellm_settings": {
            "telemetry": False,
            "set_verbose": False,
            "json_logs": False,
            "turn_off_message_logging": True,
            "drop_params": True,
            "callbacks": [],
            "success_callback": [],
            "failure_callback": [],
            "cache": False,
        },
        "general_settings": {
            "master_key": MASTER_KEY,
            "disable_spend_logs": True,
            "disable_error_logs": True,
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class LiteLLMProxy:
    """A running LiteLLM proxy process (one uvicorn worker)."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    version: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            # Its own process group: uvicorn and anything LiteLLM forks go too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)

    def log_tail(self, lines: int = 25) -> str:
        return _tail(self.log_path, lines)


def start(
    workdir: Path,
    origin_url: str,
    *,
    port: int,
    models: tuple[str, ...] = ("sim-small",),
    cpus: set[int] | None = None,
    venv: Path = DEFAULT_VENV,
    timeout: float = START_TIMEOUT,
) -> LiteLLMProxy:
    """Start ``litellm --config ... --num_workers 1`` and wait until it answers a completion.

    With ``cpus`` the process starts pinned there (every thread it makes
    inherits the mask). Raises LiteLLMUnavailable, with its log, if it exits or
    does not answer within ``timeout``.
    """
    entry = ensure_installed(venv)
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(workdir / "litellm-config.yaml", origin_url, models)
    log_path = workdir / "litellm.log"
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from the internet at import
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "DISABLE_ADMIN_UI": "True",
        "NO_DOCS": "True",
        "PYTHONUNBUFFERED": "1",
    }
    for key in ("DATABASE_URL", "REDIS_HOST", "REDIS_URL"):  # no accidental backends
        env.pop(key, None)
    argv = [str(entry), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]  # fmt: skip
    with log_path.open("ab") as log, affinity(cpus):
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    proxy = LiteLLMProxy(proc, port, log_path, LITELLM_VERSION)
    try:
        _wait_ready(proxy, models[0], timeout)
    except BaseException:
        proxy.stop()
        raise
    return proxy


def _wait_ready(proxy: LiteLLMProxy, model: str, timeout: float) -> None:
    body = json.dumps(
        {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "ready?"}]}
    ).encode()
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not proxy.alive():
            raise LiteLLMUnavailable(
                f"litellm exited with {proxy.proc.returncode} while starting:\n{proxy.log_tail()}"
            )
        request = urllib.request.Request(
            proxy.base_url + "/chat/completions",
            data=body,
            headers={"content-type": "application/json", "authorization": f"Bearer {MASTER_KEY}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise LiteLLMUnavailable(
        f"litellm did not answer a completion within {timeout:.0f} s (last: {last}):\n"
        f"{proxy.log_tail()}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--origin", required=True, help="origin base URL, e.g. http://127.0.0.1:9000/v1")
    p.add_argument("--port", type=int, default=4000)
    p.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "litellm-run")
    p.add_argument("--cpu", type=int, default=None)
    p.add_argument("--install-only", action="store_true")
    a = p.parse_args(argv)
    try:
        if a.install_only:
            print(ensure_installed())
            return 0
        proxy = start(a.workdir, a.origin, port=a.port, cpus={a.cpu} if a.cpu is not None else None)
    except LiteLLMUnavailable as exc:
        print(f"LiteLLM unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"litellm {proxy.version} (pid {proxy.pid}) at {proxy.base_url}; key {MASTER_KEY}")
    print("Ctrl-C stops it")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the proxy on SIGTERM too
    try:
        while proxy.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
