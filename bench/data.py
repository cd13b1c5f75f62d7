"""Where the labelled query sets live (../shared/data/semcache/ beside the repo).

PONTO_SEMCACHE_DATA overrides it, for a clone that does not sit next to shared/.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEMCACHE = Path(
    os.environ.get("PONTO_SEMCACHE_DATA") or REPO.parent / "shared" / "data" / "semcache"
)
