"""The user documentation: README and docs/ stay short, current, linked and complete."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import threadloader

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_WORDS = 1600

#: Words that date a text to the project's own development: figures must be current.
HISTORY = {
    "a work session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? ?#?\d", re.IGNORECASE),
    "the build machine": re.compile(r"\bVMs?\b"),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
}

#: The blocks CI reads: the line after each marker's fence is the command it runs.
MARKER_BLOCKS = {
    "demo-command": "pip install torch==2.13.0 && pip install -e . && python -m threadloader compare",
    "test-command": (
        'pip install torch==2.13.0 && pip install -e ".[test]" '
        "&& python -m pytest -n 2 --dist loadfile"
    ),
}

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _user_texts() -> list[Path]:
    """README, every text file of the docs site, and bench/README."""
    docs = [p for p in sorted(DOCS.rglob("*")) if p.suffix in (".md", ".py", ".yml")]
    return [README, ROOT / "bench" / "README.md", ROOT / "mkdocs.yml", *docs]


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _words(text: str) -> int:
    return len(re.findall(r"\S+", text))


def test_the_benchmarks_page_is_what_the_committed_results_render() -> None:
    proc = subprocess.run(
        [sys.executable, str(DOCS / "bench_tables.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_readme_is_short() -> None:
    words = _words(README.read_text())
    assert words <= README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS})"


@pytest.mark.parametrize("path", _user_texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_history(path: Path) -> None:
    text = path.read_text()
    found = [
        f"{what}: {m.group(0)!r} in line {text.count(chr(10), 0, m.start()) + 1}"
        for what, pattern in HISTORY.items()
        for m in pattern.finditer(text)
    ]
    assert not found, f"{path.relative_to(ROOT)} dates itself: " + "; ".join(found)


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(path: Path) -> None:
    text = _FENCE.sub("", path.read_text())  # code blocks hold no links
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on this page
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("marker", MARKER_BLOCKS)
def test_readme_keeps_the_command_blocks_ci_reads(marker: str) -> None:
    lines = README.read_text().splitlines()
    at = lines.index(f"<!-- {marker} -->")
    assert lines[at + 1 : at + 4] == ["```bash", MARKER_BLOCKS[marker], "```"]


def test_every_public_name_is_in_the_api_reference() -> None:
    api = (DOCS / "api.md").read_text()
    missing = [name for name in threadloader.__all__ if f"threadloader.{name}" not in api]
    assert not missing, f"docs/api.md does not document: {missing}"
