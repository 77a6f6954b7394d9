"""The linter over the whole code base: `ruff check` with the settings of pyproject.toml
([tool.ruff]: line length 100; pyflakes, pycodestyle errors and the line-length rule); and the
package's comments and docstrings, which hold no dates or commit hashes."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_ruff_finds_nothing():
    ruff = pytest.importorskip("ruff.__main__").find_ruff_bin()  # the binary: no interpreter
    done = subprocess.run(
        [
            ruff,
            "check",
            "--no-cache",
            "depthbench",
            "tests",
            "scripts",
            "benchmarks",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


# In the package's comments and docstrings: a date, or a commit hash (7 to 40 hexadecimal digits
# with at least one letter and one digit). Code states what is true now; when it was measured or
# changed lives in docs/benchmarks.md and git.
DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def dates_and_hashes(source: str) -> list[str]:
    return [
        f"line {line}: {m.group(0)}"
        for line, text in prose(source)
        for pattern in (DATE, HASH)
        for m in pattern.finditer(text)
    ]


def test_no_dates_or_commit_hashes_in_the_packages_prose():
    found = {
        str(path.relative_to(REPO)): hits
        for path in sorted((REPO / "depthbench").rglob("*.py"))
        if (hits := dates_and_hashes(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_the_prose_check_finds_dates_and_hashes_and_leaves_code_alone():
    source = (
        '"""Measured at a4e142a on 2026-12-04."""\n'
        "HEX = '0123456789abcdef'  # digest of 3f2b9c1d\n"
        "def f():\n"
        '    """An 8 x 1216 shape, deadbeef (no digit), 1234567 (no letter)."""\n'
    )
    assert dates_and_hashes(source) == [
        "line 2: 3f2b9c1d",
        "line 1: 2026-12-04",
        "line 1: a4e142a",
    ]
