"""The image's bytecode steps (Dockerfile): each compileall run as the image
runs it, over a small tree laid out as the directory it compiles. No Docker
daemon is needed: the steps are read from the Dockerfile and run here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"
TAG = sys.implementation.cache_tag


def compile_step(target: str) -> list[str]:
    """The options of the Dockerfile's `python -m compileall ... TARGET` run."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    found = re.findall(r"python -m compileall (.*?) " + re.escape(target) + r"\s*$", text, re.M)
    assert len(found) == 1, found
    return shlex.split(found[0])


def run_step(target: str, root: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "compileall", *compile_step(target), str(root)], check=True
    )


def module(root: Path, name: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('"""Doc."""\nX = 1\n')
    return path


def compiled(source: Path) -> set[str]:
    """The optimisation levels `source` has bytecode for ("" for level 0)."""
    cache = source.parent / "__pycache__"
    stem = f"{source.stem}.{TAG}"
    levels = {"": f"{stem}.pyc", "1": f"{stem}.opt-1.pyc", "2": f"{stem}.opt-2.pyc"}
    return {level for level, name in levels.items() if (cache / name).exists()}


def test_the_standard_library_is_compiled_for_levels_0_and_2_but_not_its_site_packages(
    tmp_path: Path,
) -> None:
    # The official image strips every .pyc; the base's own site-packages
    # (pip, setuptools) is not on the venv's path.
    lib = tmp_path / "python3.11"
    json_init = module(lib, "json/__init__.py")
    test_module = module(lib, "test/test_json.py")
    pip_init = module(lib, "site-packages/pip/__init__.py")
    run_step("/usr/local/lib/python3.11", lib)
    assert compiled(json_init) == {"", "2"}
    assert compiled(test_module) == set()
    assert compiled(pip_init) == set()


def test_the_venvs_packages_are_compiled_for_levels_0_and_2_but_not_their_tests(
    tmp_path: Path,
) -> None:
    lib = tmp_path / "lib"
    package = module(lib, "python3.11/site-packages/aiohttp/__init__.py")
    tests = module(lib, "python3.11/site-packages/yarl/tests/test_url.py")
    run_step("/opt/ponto/lib", lib)
    assert compiled(package) == {"", "2"}
    assert compiled(tests) == set()
