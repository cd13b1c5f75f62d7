"""The container runtime's last step, run inside a pod's mount namespace.

chart-run starts every container as
``nsenter --net=/proc/<sandbox>/ns/net unshare --mount -- python -m tests.chartrun.podinit SPEC``:
the pod's network namespace already exists (the sandbox process holds it), this
process has a private mount namespace of its own. It does what a container runtime
does before the entry point runs, then execs the entry point, so the container's
PID is this process's PID:

- the cluster's name table bind-mounted over /etc/hosts (cluster DNS);
- the interpreter made reachable when it sits under a directory the pod's user
  may not enter (a container image keeps it in /usr);
- each volume bind-mounted at its mountPath, read-only where the spec says so;
- the root file system read-only when ``readOnlyRootFilesystem`` is set;
- the pod's user, group and fsGroup (``runAsUser``/``runAsGroup``/``fsGroup``);
- the rendered environment, working directory and command.

The spec is JSON written by the harness (tests/chartrun/cluster.py). Mount points
that do not exist in the host file system are created by the harness before the
container starts and removed when it stops, as a runtime creates them in an image.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _bind_fd(fd: int, target: str) -> None:
    """Bind the directory or file `fd` (an O_PATH handle) names onto `target`.

    mount(2) itself, not mount(8), which would canonicalise /proc/self/fd/N back
    to a path that a mount made since may hide.
    """
    src = f"/proc/self/fd/{fd}".encode()
    if _libc.mount(src, target.encode(), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind {src.decode()} on {target}: {os.strerror(err)}")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    # Nothing mounted here may leak back into the host's namespace.
    _mount("--make-rprivate", "/")
    # The log is opened first and through a bind mount of its own, so that this
    # open file does not keep the root mount busy when it is made read-only.
    log_dir = os.path.dirname(spec["log_file"])
    _mount("--bind", log_dir, log_dir)
    log = os.open(spec["log_file"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    # Every source is held by a handle before anything is mounted: a volume at
    # /tmp, say, would hide a harness directory or a checkout under /tmp.
    sources = [os.open(m["source"], os.O_PATH) for m in spec["mounts"]]
    image = [(path, os.open(path, os.O_PATH), _identity(path)) for path in spec["image_paths"]]
    hosts = os.open(spec["hosts_file"], os.O_PATH)
    _bind_fd(hosts, "/etc/hosts")
    for e in spec["expose"]:
        # The image's Python lives under a directory the pod's user cannot enter
        # (pyenv under /root, say): an empty directory replaces that one in this
        # namespace and the interpreter is mounted back in its place.
        fd = os.open(e["path"], os.O_PATH)
        _mount("-t", "tmpfs", "-o", "mode=755,size=1m", "tmpfs", e["blocked"])
        os.makedirs(e["path"])
        _bind_fd(fd, e["path"])
    for m, fd in zip(spec["mounts"], sources, strict=True):
        if not os.path.exists(m["path"]):
            os.makedirs(m["path"])  # inside a volume mounted just before
        _bind_fd(fd, m["path"])
        if m["read_only"]:
            _mount("-o", "remount,bind,ro", m["path"])
    for path, fd, ident in image:
        # What the image holds (the code and its interpreter) stays visible even
        # under a volume mounted over one of its parents.
        if _identity(path) != ident:
            os.makedirs(path, exist_ok=True)
            _bind_fd(fd, path)
            _mount("-o", "remount,bind,ro", path)
    if spec["read_only_root"]:
        _mount("-o", "remount,bind,ro", "/")
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if spec["gid"] is not None:
        os.setgroups([g for g in (spec["fs_group"],) if g is not None])
        os.setgid(spec["gid"])
    if spec["uid"] is not None:
        os.setuid(spec["uid"])
    os.chdir(spec["cwd"])
    argv0 = spec["argv"][0]
    try:
        os.execve(argv0, spec["argv"], spec["env"])
    except OSError as exc:
        print(f"chart-run: cannot start {argv0}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
