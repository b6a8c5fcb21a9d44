"""Release hygiene: the version is written once, pyproject's settings name files that exist, and
``python -m build`` makes a wheel and an sdist with what an install and a test run need.

The build is slow (an isolated build environment, twice): it runs only with
``THREADLOADER_RELEASE_TEST=1``. The checks of pyproject need a checkout and skip without one.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

import threadloader

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
PACKAGE = Path(threadloader.__file__).parent


def _pyproject() -> dict[str, Any]:
    if not PYPROJECT.is_file():
        pytest.skip("needs the repository's pyproject.toml (tests run from a checkout)")
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


def test_version_is_the_installed_distributions() -> None:
    """``threadloader.__version__`` is the version pip installed (pyproject reads it from there)."""
    try:
        installed = importlib.metadata.version("threadloader")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("threadloader is not installed (imported from a path)")
    assert threadloader.__version__ == installed


def test_version_is_written_in_one_place() -> None:
    """pyproject has no version of its own: setuptools reads ``threadloader.__version__``."""
    config = _pyproject()
    assert "version" not in config["project"]
    assert "version" in config["project"]["dynamic"]
    attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "threadloader.__version__"


def test_settings_name_files_that_exist() -> None:
    """Every path pytest, mypy and ruff are pointed at exists: none is left from a rename."""
    config = _pyproject()
    tool = config["tool"]
    paths = [*tool["pytest"]["ini_options"]["testpaths"], *tool["mypy"]["files"]]
    globs = list(tool["ruff"]["lint"]["per-file-ignores"])
    for path in paths:
        assert (REPO / path).exists(), path
    for pattern in globs:
        assert glob.glob(str(REPO / pattern), recursive=True), pattern


def test_every_extra_the_suite_needs_is_in_test() -> None:
    """README's test command installs ``.[test]`` only: it must hold what tests/ imports."""
    test_extra = " ".join(_pyproject()["project"]["optional-dependencies"]["test"])
    for requirement in (
        "pytest",
        "pytest-timeout",
        "psutil",
        "matplotlib",
        "pillow",
        "s3fs",
        "moto[server]",
        "pytorch-lightning",
        "datasets",
        "torchdata",
        "accelerate",
        "transformers",
    ):
        assert requirement in test_extra, requirement


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel and the sdist ``python -m build`` makes from this checkout."""
    if os.environ.get("THREADLOADER_RELEASE_TEST") != "1":
        pytest.skip("slow: set THREADLOADER_RELEASE_TEST=1 to build the wheel and the sdist")
    if not PYPROJECT.is_file():
        pytest.skip("needs the repository's pyproject.toml (tests run from a checkout)")
    pytest.importorskip("build", reason="needs the build package (pip install build)")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("threadloader-*.whl")
    (sdist,) = out.glob("threadloader-*.tar.gz")
    return wheel, sdist


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_holds_the_package_and_nothing_else(built: tuple[Path, Path]) -> None:
    """Every subpackage, py.typed and the metadata at this version; no tests, no examples."""
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "threadloader/py.typed" in names
    subpackages = {
        str(init.parent.relative_to(PACKAGE.parent))
        for init in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert len(subpackages) > 5
    for package in subpackages:
        assert f"{package}/__init__.py" in names, package
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"threadloader", f"threadloader-{threadloader.__version__}.dist-info"}
    metadata = zipfile.ZipFile(wheel).read(
        f"threadloader-{threadloader.__version__}.dist-info/METADATA"
    )
    assert f"\nVersion: {threadloader.__version__}\n".encode() in metadata


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sdist_holds_what_a_build_and_the_tests_need(built: tuple[Path, Path]) -> None:
    """README, pyproject and CHANGELOG beside the package; tests/ with its helpers."""
    _, sdist = built
    root = f"threadloader-{threadloader.__version__}"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
    for name in (
        "README.md",
        "pyproject.toml",
        "CHANGELOG.md",
        "threadloader/__init__.py",
        "threadloader/py.typed",
        "tests/helpers.py",
        "tests/test_release.py",
    ):
        assert f"{root}/{name}" in names, name
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
