"""The installed version of a distribution, read without importlib.metadata.

`importlib.metadata.version` imports zipfile, csv and its own helpers (some
0.7 MB of a proxy worker's RSS, issue 17) to read one line. This reads the
same line the same way for what Ponto installs: the first entry of sys.path
holding NAME's `*.dist-info/METADATA` (a wheel or an editable install) or
`*.egg-info/PKG-INFO` (a source checkout's `setup.py develop`), in sys.path
order as importlib.metadata searches. A test holds the two equal.
"""

from __future__ import annotations

import os
import re
import sys

__all__ = ["installed_version"]

# importlib.metadata's name normalisation (PEP 503), applied to both sides.
_SEPARATORS = re.compile(r"[-_.]+")


def _normal(name: str) -> str:
    return _SEPARATORS.sub("_", name).lower()


def installed_version(name: str) -> str | None:
    """NAME's `Version:`, or None if no entry of sys.path holds its metadata.

    A file read per sys.path entry until found: call it at start, not per request.
    """
    wanted = _normal(name)
    for entry in sys.path:
        folder = entry or "."
        try:
            listing = sorted(os.listdir(folder))
        except OSError:  # a zip, or an entry that does not exist
            continue
        for item in listing:
            stem, _, kind = item.rpartition(".")
            if kind not in ("dist-info", "egg-info") or _normal(stem.split("-")[0]) != wanted:
                continue
            meta = "METADATA" if kind == "dist-info" else "PKG-INFO"
            version = _version_line(os.path.join(folder, item, meta))
            if version is not None:
                return version
    return None


def _version_line(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.partition(":")[2].strip()
                if not line.strip():  # the headers end at the first empty line
                    break
    except OSError:
        return None
    return None
