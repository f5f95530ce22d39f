"""The gateway's Python floor: ``edge_sdk`` and ``shared`` (what a gateway installs) run on Python 3.10.

JetPack 6 (Ubuntu 22.04) ships Python 3.10, and NVIDIA's torch and TensorRT bindings for Jetson exist for that Python
only; the coordinator and the laboratory (``wildfed_sim``) are tested on 3.11. Vermin (a static checker from PyPI,
``vermin`` in the ``test`` extra) reads every module of the two packages and reports each construct that needs a
newer Python (``tomllib``, ``typing.Self``, ``except*``, ``datetime.UTC``, ``hashlib.file_digest``, ...) with its file
and line; this test fails naming them. By hand, the same check:

    vermin --target=3.10- --eval-annotations --no-tips --format parsable edge_sdk shared

Annotations are evaluated (``--eval-annotations``) because pydantic and dataclasses evaluate them at run time. A line
that needs a newer Python only behind a version check may say ``# novm``. What vermin cannot see (a stdlib function
that accepts less on 3.10, e.g. ``datetime.fromisoformat`` without ``Z``) is caught by the gateway's tests, which
``.ci/run`` also runs under Python 3.10.

The check cannot pass by scanning nothing: it asserts that vermin reported every module of the two packages, and a
control runs it on a snippet of 3.11-only constructs and expects each of them, at its line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
GATEWAY_PACKAGES = ("edge_sdk", "shared")
FLOOR = (3, 10)
ARGS = (f"--target={FLOOR[0]}.{FLOOR[1]}-", "--eval-annotations", "--no-tips", "--format", "parsable")

# vermin's console script, run by this interpreter (vermin has no ``python -m vermin``)
_RUN_VERMIN = "import sys; from vermin import main; sys.argv[0] = 'vermin'; sys.exit(main())"
# vermin's parsable lines: ``file:line:column:py2:py3:feature``; a file's summary has no line or column
_LINE = re.compile(r"^(?P<path>.+?\.py):(?P<line>\d*):(?P<column>\d*):(?P<py2>[^:]*):(?P<py3>[^:]*):(?P<feature>.*)$")


@dataclass(frozen=True)
class Finding:
    """One construct vermin reports: where, and the lowest Python 3 it needs (``None``: none does, or the running
    Python cannot parse it: ``feature`` then starts with ``error:``)."""

    path: Path
    line: int | None
    needs: tuple[int, ...] | None
    feature: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else str(self.path)
        if self.feature.startswith("error:"):
            return f"{where}: {self.feature} (Python {sys.version.split()[0]} cannot parse it)"
        version = ".".join(map(str, self.needs)) if self.needs else "no Python 3"
        return f"{where}: {self.feature or 'this module'} needs Python {version}"


def _py3(field: str) -> tuple[int, ...] | None:
    """vermin's Python 3 field: ``3.11`` -> (3, 11); ``~3`` (nothing detected) -> (3, 0); ``!3`` -> None."""
    if field.startswith("!"):
        return None
    if field.startswith("~"):
        return (3, 0)
    return tuple(int(part) for part in field.split("."))


def scan(*paths: Path) -> tuple[set[Path], list[Finding]]:
    """Run vermin on ``paths``; returns (the files it reported on, every finding that needs more than 3.10).

    Raises:
        AssertionError: vermin did not run (not installed, or an error of its own), naming the fix.
    """
    out = subprocess.run([sys.executable, "-c", _RUN_VERMIN, *ARGS, *map(str, paths)], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=300)
    # vermin exits 1 when the target is not met and 0 otherwise; anything else (2: bad arguments, or no vermin) is
    # an error of the check itself
    assert out.returncode in (0, 1) and out.stdout.strip(), (
        f"vermin did not run (exit {out.returncode}): {out.stderr.strip()[-2000:]}; install the test tools: "
        "pip install -e '.[test]' (the dev extra includes them)")
    scanned: set[Path] = set()
    findings: list[Finding] = []
    for raw in out.stdout.splitlines():
        match = _LINE.match(raw.strip())
        if match is None:
            continue  # the last line (no file): the minimum over all files
        path = Path(match["path"]).resolve()
        needs = _py3(match["py3"])
        if not match["line"]:
            scanned.add(path)
        unreadable = match["feature"].startswith("error:")  # a syntax error to the Python running vermin
        if unreadable:
            needs = None
        if unreadable or needs is None or needs > FLOOR:
            findings.append(Finding(path, int(match["line"]) if match["line"] else None, needs, match["feature"]))
    return scanned, findings


def _modules(package: str) -> set[Path]:
    return {p.resolve() for p in (REPO_ROOT / package).rglob("*.py")}


def test_every_gateway_module_runs_on_python_3_10() -> None:
    scanned, findings = scan(*(REPO_ROOT / p for p in GATEWAY_PACKAGES))
    expected = set().union(*(_modules(p) for p in GATEWAY_PACKAGES))
    assert len(expected) > 100  # the two packages, not an empty folder
    assert scanned == expected, f"vermin did not report on: {sorted(map(str, expected - scanned))[:10]}"
    per_line = [f for f in findings if f.line is not None]
    whole_files = {f.path for f in findings if f.line is None}
    # a module that needs a newer Python names the construct and its line; show those
    assert not findings, ("gateway modules need a Python newer than 3.10 (edge_sdk and shared must run on "
                          "JetPack 6's Python 3.10):\n" + "\n".join(map(str, per_line or findings))
                          + (f"\n(files: {sorted(map(str, whole_files))})" if whole_files else ""))


def test_the_check_flags_3_11_constructs_at_their_lines(tmp_path: Path) -> None:
    """The control: modules written with 3.11-only library members and syntax are reported, each construct at its
    own line, and a module of 3.10 constructs (match, ``X | Y`` annotations, ``zip(strict=)``) is not. (Vermin
    parses with the Python that runs it: under 3.10, ``except*`` is reported as a syntax error at its line.)"""
    newer = tmp_path / "newer.py"
    newer.write_text(textwrap.dedent("""\
        import tomllib
        from typing import Self
        import datetime
        import hashlib


        def digest(handle):
            return hashlib.file_digest(handle, "sha256")


        def now():
            return datetime.datetime.now(datetime.UTC)
        """))
    syntax = tmp_path / "newer_syntax.py"
    syntax.write_text(textwrap.dedent("""\
        def run():
            try:
                pass
            except* ValueError:
                pass
        """))
    fine = tmp_path / "fine.py"
    fine.write_text(textwrap.dedent("""\
        from __future__ import annotations

        from dataclasses import dataclass


        @dataclass(slots=True, kw_only=True)
        class Point:
            x: int | None = None


        def pairs(a, b):
            match a:
                case [first, *_]:
                    return list(zip(a, b, strict=True)), first
            return [], None
        """))
    scanned, findings = scan(newer, syntax, fine)
    assert scanned == {newer.resolve(), syntax.resolve(), fine.resolve()}
    flagged = {(f.path.name, f.line) for f in findings if f.line is not None}
    assert {("newer.py", line) for line in (1, 2, 8, 12)} <= flagged, flagged
    assert all(f.needs == (3, 11) for f in findings if f.path.name == "newer.py" and f.line)
    (except_star,) = [f for f in findings if f.path.name == "newer_syntax.py" and f.line]
    assert except_star.line == 4
    if sys.version_info >= (3, 11):
        assert except_star.needs == (3, 11) and "except*" in except_star.feature
    else:
        assert except_star.feature.startswith("error:") and "cannot parse" in str(except_star)
    assert not [f for f in findings if f.path.name == "fine.py"], findings


@pytest.mark.parametrize("field,want", [("3.11", (3, 11)), ("3.10", (3, 10)), ("~3", (3, 0)), ("!3", None)])
def test_vermins_version_field_is_read_as_written(field: str, want: tuple[int, ...] | None) -> None:
    assert _py3(field) == want
