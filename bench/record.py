"""Run a benchmark module and keep what it printed for the report.

    .venv/bin/python -m bench.record NAME "TITLE" bench.module [ARGS...]

For benchmarks that print their tables rather than write JSON: the output is
shown as it comes and saved to docs/benchmarks/NAME.json as {"name", "title",
"text"}, which bench.report renders as a preformatted block. Exits with the
benchmark's exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    name, title, module, *args = argv
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    code = proc.wait()
    if code == 0:
        out = Path("docs/benchmarks") / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"name": name, "title": title, "text": "".join(lines)}, indent=2))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
