"""Every README or docs/ section the code cites exists, every link between the docs resolves, and
no product text names an issue.

A citation is ``README "Section"`` or ``docs/file.md "Section"`` (quotes single, double or escaped
inside a string; a comma or colon may follow the file's name), and it resolves when the file has a
heading with exactly that text. ``docs/file.md`` alone cites the whole file. Unquoted forms
(``README: Section``, ``README, Section``) cannot be checked, so they are refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("broker", "worker", "client", "shared", "pipeline", "memory", "ops", "bench", "tests")
# A docs file or the README, then a quoted section. The README is never followed by ``.md`` here.
CITATION = re.compile(r"(?P<file>README|docs/[\w./-]+?\.md)(?!\.md|\w)(?:[,:]\s*|\s+)"
                      r"\\?(?P<q>[\"'])(?P<section>[^\"'\\]+?)\\?(?P=q)")
UNQUOTED = re.compile(r"\bREADME(?!\.md|\w)\s*[,:(]\s*(?=[A-Z])")
DOCS_PATH = re.compile(r"docs/[\w./-]+?\.md")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A markdown link to a doc followed by a quoted section: [assembly.md](assembly.md) "Size limits".
LINKED_SECTION = re.compile(r"\]\(([\w./-]+\.md)\)\s*\"([^\"]+)\"")
ISSUE = re.compile(r"\bissues? [0-9]+", re.IGNORECASE)


def _code_files() -> list[Path]:
    """Every module under the code folders but this one, whose examples are not citations."""
    here = Path(__file__).resolve()
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts and p.resolve() != here)


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _joined(text: str) -> str:
    """The text with line breaks (and a comment's leading ``#``) folded to one space, so a citation
    wrapped over two lines reads as one."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#[ \t]*)?", " ", text)


@cache
def _headings(path: Path) -> frozenset[str]:
    """The text of every markdown heading outside code blocks."""
    found, fenced = set(), False
    for line in path.read_text("utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            found.add(m.group(1))
    return frozenset(found)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _target(cited: str) -> Path:
    return ROOT / ("README.md" if cited == "README" else cited)


def _citations() -> Iterator[tuple[str, str, str]]:
    """(where, cited file, section) for every quoted citation in code and in the docs."""
    for path in [*_code_files(), *_doc_files()]:
        text = _joined(path.read_text("utf-8"))
        where = str(path.relative_to(ROOT))
        for m in CITATION.finditer(text):
            yield where, m.group("file"), m.group("section")
        if path.suffix == ".md":
            for m in LINKED_SECTION.finditer(text):
                yield where, str((path.parent / m.group(1)).resolve().relative_to(ROOT)), m.group(2)


def test_every_cited_section_exists() -> None:
    cites = list(_citations())
    assert len(cites) > 100, "the citation pattern no longer finds the code's citations"
    missing = [f"{where}: {cited} {section!r}" for where, cited, section in cites
               if not _target(cited).is_file() or section not in _headings(_target(cited))]
    assert not missing, "cited sections that are not headings there:\n" + "\n".join(missing)


def test_every_cited_docs_file_exists() -> None:
    missing = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in [*_code_files(), *_doc_files()]
               for m in DOCS_PATH.finditer(p.read_text("utf-8")) if not (ROOT / m.group(0)).is_file()]
    assert not missing, "\n".join(missing)


def test_no_unquoted_readme_citations() -> None:
    """``README: Deadlines`` could not be checked against the headings: quote the section."""
    bad = [f"{p.relative_to(ROOT)}: {_joined(p.read_text('utf-8'))[m.start():m.end() + 40]}"
           for p in _code_files() for m in UNQUOTED.finditer(_joined(p.read_text("utf-8")))]
    assert not bad, "\n".join(bad)


def test_links_between_docs_resolve() -> None:
    broken = []
    for doc in _doc_files():
        for m in LINK.finditer(doc.read_text("utf-8")):
            link = m.group(1)
            if re.match(r"[a-z]+:", link):
                continue
            file, _, anchor = link.partition("#")
            target = (doc.parent / file).resolve() if file else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and anchor not in {_anchor(h) for h in _headings(target)}:
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_no_issue_numbers_in_product_text() -> None:
    """History belongs in CHANGELOG.md, not in the docs or the code's comments."""
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in [*_code_files(), *_doc_files()]
             for m in ISSUE.finditer(_joined(p.read_text("utf-8")))]
    assert not found, "\n".join(found)


def test_a_missing_section_is_caught(tmp_path: Path) -> None:
    """The patterns see a citation wrapped over lines, and a heading inside a code block is none."""
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n## Real section\n\n```yaml\n# not a heading\n```\n", "utf-8")
    text = _joined('x = 1  # see README "Real\n    # section", docs/a.md "Gone" and README: Loose')
    assert [m.group("section") for m in CITATION.finditer(text)] == ["Real section", "Gone"]
    assert UNQUOTED.search(text)
    assert _headings(doc) == {"Title", "Real section"}
