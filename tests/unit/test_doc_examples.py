"""The apply files the docs show are ones the control plane accepts: each
```yaml block of README.md and docs/*.md (indented ones too) that is a
topology (regions, origins, tenants), or chart values with a `topology:`
(docs/helm.md: applied with the regions of `proxy.regions`, as the chart's
apply Job does), goes through the Admin API's Apply as `pontoctl apply
--dry-run` sends it, to a real gRPC server on loopback over an in-memory
store."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import orjson
import yaml

from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from tests.unit.test_alias_warnings import admin

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY_KEYS = {"regions", "origins", "tenants"}
BLOCK = re.compile(r"^ *```yaml\n(.*?)^ *```", re.MULTILINE | re.DOTALL)


def topology_examples() -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in BLOCK.findall(path.read_text(encoding="utf-8")):
            doc = yaml.safe_load(textwrap.dedent(block))
            if not isinstance(doc, dict) or not doc:
                continue
            if set(doc) <= TOPOLOGY_KEYS:
                found.append((path.name, doc))
            elif isinstance(topology := doc.get("topology"), dict):  # chart values
                # As charts/ponto/templates/topology.yaml builds its document.
                regions = [
                    {k: r[k] for k in ("name", "lat", "lon") if k in r}
                    for r in doc.get("proxy", {}).get("regions", [])
                ]
                applied = {"regions": regions + topology.get("extraRegions", [])}
                applied |= {k: topology[k] for k in ("origins", "tenants") if topology.get(k)}
                found.append((path.name, applied))
    return found


async def test_the_docs_apply_examples_pass_a_dry_run() -> None:
    examples = topology_examples()
    assert {name for name, _ in examples} == {
        "README.md",
        "helm.md",
        "migrating-from-litellm.md",
        "operations.md",
        "routing.md",
        "security.md",
    }
    # The README shows where a tenant's aliases go: under prompt:.
    assert any(
        t.get("prompt", {}).get("aliases")
        for name, doc in examples
        if name == "README.md"
        for t in doc.get("tenants", [])
    )
    async with admin(MemoryStore()) as stub:
        for name, doc in examples:
            request = apb.ApplyRequest(document=orjson.dumps(doc).decode(), dry_run=True)
            response = await stub.Apply(request)  # INVALID_ARGUMENT would raise
            assert response.dry_run and response.changes, (name, doc)
