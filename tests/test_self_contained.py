"""The repository explains itself: no module or doc outside tests/ points at a file the repository does not hold.

Two checks, over every text file of the project outside tests/ (the packages, benchmarks/, docs/,
firmware_configs/, .ci/, README.md, pyproject.toml):

1. **No outside citations.** No line names ``DESIGN.md``, ``STYLE.md`` or an issue number (``issue 7``,
   ``issues 6 and 20``, ``Issue #16``, ``runs/x-issue20``; case-insensitive): what the code does and why is in the
   code and in docs/, and a reader has neither the issue tracker nor those files.
2. **Every named path exists.** A markdown link in a doc (``[text](target)``, resolved from the doc's folder), a
   path in backticks that starts at a top-level folder of the repository (``shared/``, ``edge_sdk/``,
   ``coordinator/``, ``wildfed_sim/``, ``docs/``, ``benchmarks/``, ``firmware_configs/``, ``tests/``), and such a
   path in plain text ending in a file extension the project uses (``docs/privacy.md``, ``coordinator/ledger.py``)
   must each be a file (or, ending in ``/``, a folder) of the checkout. Skipped: URLs, anchors within a page, globs
   (``*``, ``?``, ``[``, ``{``), placeholders (``<site>``, ``$VAR``, ``...``), paths under a run folder or a cache
   (a run writes them; the repository does not ship them), and the few paths :data:`ELSEWHERE` names with why.

A failure lists ``file:line: what`` for every hit. The control tests plant each kind of bad reference in a scratch
tree and check that it is caught, naming its file and line, so the checks cannot pass by finding nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The folders and files outside tests/ whose text is checked.
SCANNED_DIRS = ("shared", "edge_sdk", "coordinator", "wildfed_sim", "benchmarks", "docs", "firmware_configs", ".ci")
SCANNED_FILES = ("README.md", "pyproject.toml")
TEXT_SUFFIXES = frozenset({".py", ".md", ".toml", ".yaml", ".yml", ".html", ".sh", ".cfg", ".txt", ".ini", ".j2"})
SKIPPED_DIRS = frozenset({".venv", "__pycache__", "node_modules", ".git", "runs", ".pytest_cache", ".mypy_cache"})

#: Top-level folders a backticked path may start at.
PATH_ROOTS = ("shared", "edge_sdk", "coordinator", "wildfed_sim", "docs", "benchmarks", "firmware_configs", "tests")

FORBIDDEN = re.compile(r"DESIGN\.md|STYLE\.md|\bissues?[\s_-]*#?\d+", re.IGNORECASE)
MARKDOWN_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
BACKTICKED = re.compile(r"`+([^`\n]+?)`+")
#: A path in plain text: a top-level folder, then names, then a file extension the project uses.
PLAIN_PATH = re.compile(r"(?<![\w./<>$~-])((?:%s)/[\w.-]+(?:/[\w.-]+)*\.(?:%s))\b"
                        % ("|".join(PATH_ROOTS), "py|md|yaml|yml|toml|json|txt|sh|html|png|csv"))
PATH_IN_TICKS = re.compile(r"^(?:\./)?((?:%s)/[\w./-]*)$" % "|".join(PATH_ROOTS))
#: ``{path as written: why}``: the few repository-looking paths that name something elsewhere, on purpose.
ELSEWHERE = {
    "coordinator/broker-credentials.yaml": "written by `wildfed-coordinator broker-config` under its output folder",
    "coordinator/client.crt": "written by `wildfed-coordinator broker-config` under its output folder",
    "tests/assets/images/ena24_small/": "a folder of zamba's repository, where the ENA24 sample photos come from",
}
#: Words that mark a path as one a run or a cache writes, not one the repository ships.
RUN_OR_CACHE = re.compile(r"(^|/)(runs?|run_dir|out|cache|\.cache|outgoing|staging)(/|$)")


def scanned_files(root: Path) -> list[Path]:
    """The text files under ``root`` that the checks read: the folders of :data:`SCANNED_DIRS` (every file in .ci/,
    whatever its name) and :data:`SCANNED_FILES`, sorted."""
    out: list[Path] = []
    for name in SCANNED_DIRS:
        base = root / name
        if not base.is_dir():
            continue
        for path in base.rglob("*"):
            rel = path.relative_to(root)
            if any(part in SKIPPED_DIRS for part in rel.parts) or not path.is_file():
                continue
            if path.suffix in TEXT_SUFFIXES or (name == ".ci" and not path.suffix):
                out.append(path)
    out += [root / name for name in SCANNED_FILES if (root / name).is_file()]
    return sorted(out)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file; nothing for a file that is not UTF-8."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return
    yield from enumerate(text.splitlines(), start=1)


def outside_citations(root: Path) -> list[str]:
    """``file:line: ...`` for every line of a scanned file that names DESIGN.md, STYLE.md or an issue number."""
    hits = []
    for path in scanned_files(root):
        for number, line in _lines(path):
            for match in FORBIDDEN.finditer(line):
                hits.append(f"{path.relative_to(root)}:{number}: names {match.group(0)!r}: {line.strip()[:100]}")
    return hits


def _skipped(target: str) -> bool:
    """True for what is not a path of the checkout: globs, placeholders, and what a run or a cache writes."""
    return (any(ch in target for ch in "*?[]{}<>$~ ") or "..." in target or target.startswith("/")
            or RUN_OR_CACHE.search(target) is not None)


def _clean(target: str) -> str:
    """``target`` without a pytest node id, a ``:line`` suffix, or trailing punctuation."""
    target = target.split("::")[0]
    target = re.sub(r":\d+(-\d+)?$", "", target)
    return target.rstrip(".,;:)")


def _named_paths(root: Path, path: Path, line: str) -> Iterator[tuple[str, Path]]:
    """``(target as written, resolved path)`` for every repository path ``line`` of ``path`` names."""
    is_markdown = path.suffix == ".md"
    if is_markdown:
        for match in MARKDOWN_LINK.finditer(line):
            target = match.group(1).split("#")[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target) or _skipped(target):
                continue  # a URL (http:, mailto:), an anchor in this page, or not a path
            yield match.group(1), (path.parent / target)
    for match in BACKTICKED.finditer(line):
        found = PATH_IN_TICKS.match(match.group(1).strip())
        if found is None:
            continue
        target = _clean(found.group(1))
        if not _skipped(target) and "/" in target:
            yield target, root / target
    for match in PLAIN_PATH.finditer(line):
        target = _clean(match.group(1))
        if not _skipped(target):
            yield target, root / target


def broken_paths(root: Path) -> list[str]:
    """``file:line: ...`` for every path a scanned file names (markdown link, backticked or plain repository path)
    that is not in the checkout."""
    hits = []
    for path in scanned_files(root):
        for number, line in _lines(path):
            seen = set()
            for written, resolved in _named_paths(root, path, line):
                if written in seen or written in ELSEWHERE:
                    continue
                seen.add(written)
                wants_dir = written.endswith("/")
                ok = resolved.is_dir() if wants_dir else resolved.exists()
                if not ok:
                    hits.append(f"{path.relative_to(root)}:{number}: names {written!r}, which is not in the "
                                f"repository")
    return hits


# ---- the repository ------------------------------------------------------------------------------------------------
def test_no_module_or_doc_cites_design_md_style_md_or_an_issue_number() -> None:
    hits = outside_citations(ROOT)
    assert not hits, ("name what the code does and the docs/ page that explains it instead of:\n"
                      + "\n".join(hits))


def test_every_path_a_module_or_doc_names_exists() -> None:
    hits = broken_paths(ROOT)
    assert not hits, "fix or drop each reference:\n" + "\n".join(hits)


def test_every_named_exception_is_still_named() -> None:
    """Each :data:`ELSEWHERE` entry is still named somewhere, so that the list never outlives what it excuses."""
    named = {w for p in scanned_files(ROOT) for _, line in _lines(p) for w, _ in _named_paths(ROOT, p, line)}
    for written, why in ELSEWHERE.items():
        assert written in named, f"nothing names {written!r} ({why}) any more: drop it from ELSEWHERE"


def test_the_scan_reads_the_project() -> None:
    """The scan is not vacuous here: it reads the packages, the docs and README, and finds references to check."""
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files(ROOT)}
    for expected in ("README.md", "pyproject.toml", "docs/architecture.md", "shared/envelope.py",
                     "coordinator/ledger.py", "edge_sdk/agent.py", "wildfed_sim/cli.py"):
        assert expected in files
    assert not any(f.startswith("tests/") for f in files)
    named = [w for p in scanned_files(ROOT) for _, line in _lines(p) for w, _ in _named_paths(ROOT, p, line)]
    assert len(named) > 100  # the docs name hundreds of files; far fewer means the patterns stopped matching


# ---- controls: a planted bad reference is caught, with its file and line ---------------------------------------------
def _scratch(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real\n", encoding="utf-8")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "ok.py").write_text('"""Fine: see docs/real.md and ``shared/ok.py``."""\n',
                                              encoding="utf-8")
    (tmp_path / "README.md").write_text("See [the page](docs/real.md) and `docs/` and https://example.org/x.md.\n",
                                        encoding="utf-8")
    return tmp_path


def test_control_a_clean_tree_passes(tmp_path: Path) -> None:
    root = _scratch(tmp_path)
    assert outside_citations(root) == []
    assert broken_paths(root) == []


def test_control_each_outside_citation_is_caught_with_its_line(tmp_path: Path) -> None:
    root = _scratch(tmp_path)
    (root / "shared" / "bad.py").write_text(
        '"""A module.\n\nAs DESIGN.md asks (issue 7).\n"""\n# STYLE.md item 5\nX = 1  # Issues 6 and 20\n'
        "Y = 2  # see Issue #16, runs/x-issue20\n", encoding="utf-8")
    (root / "docs" / "bad.md").write_text("# Bad\n\n## Added with the head model (issue 18, item 3)\n",
                                          encoding="utf-8")
    hits = outside_citations(root)
    assert [h.split(": names")[0] for h in hits] == [
        "docs/bad.md:3", "shared/bad.py:3", "shared/bad.py:3", "shared/bad.py:5", "shared/bad.py:6",
        "shared/bad.py:7", "shared/bad.py:7"]
    assert "'DESIGN.md'" in hits[1] and "'issue 7'" in hits[2] and "'Issues 6'" in hits[4]
    assert "'issue20'" in hits[6]


def test_control_tests_are_not_scanned(tmp_path: Path) -> None:
    root = _scratch(tmp_path)
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text('assert "issue 7" in text  # DESIGN.md\n', encoding="utf-8")
    assert outside_citations(root) == []


def test_control_each_broken_path_is_caught_with_its_line(tmp_path: Path) -> None:
    root = _scratch(tmp_path)
    (root / "docs" / "links.md").write_text(
        "# Links\n"
        "[gone](missing.md) and [fine](real.md) and [anchor](#links)\n"
        "`coordinator/nowhere.py`, `docs/real.md`, `shared/ok.py::test_x`, `shared/ok.py:12`\n"
        "Plain: docs/absent.md.\n"
        "Skipped: `shared/*.py`, `docs/<page>.md`, `runs/demo/report.json`, `firmware_configs/x-$KIND.yaml`\n"
        "`edge_sdk/` is a folder that is not here\n", encoding="utf-8")
    (root / "wildfed_sim").mkdir()
    (root / "wildfed_sim" / "m.py").write_text(
        '"""Writes ``benchmarks/out.txt`` (docs/gone.md, coordinator/gone.py)."""\n', encoding="utf-8")
    hits = broken_paths(root)
    assert [h.split(": names ")[0] + " " + h.split(": names ")[1].split(",")[0] for h in hits] == [
        "docs/links.md:2 'missing.md'",
        "docs/links.md:3 'coordinator/nowhere.py'",
        "docs/links.md:4 'docs/absent.md'",
        "docs/links.md:6 'edge_sdk/'",
        "wildfed_sim/m.py:1 'benchmarks/out.txt'",
        "wildfed_sim/m.py:1 'docs/gone.md'",
        "wildfed_sim/m.py:1 'coordinator/gone.py'",
    ]
