"""The user's pages: README.md stays a short page, every relative link in it and in docs/ leads
to a file of the repository (and a `#section` to a heading there), and nothing in the product
narrates how it was developed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]

# Phrases that tell the story of the project's development instead of what the code does.
HISTORY = re.compile(
    r"\bsessions?\s+\d+"  # "session 12", "sessions 3–4", "Session 2:" — numbered history entries
    r"|\bdevelopment sessions?\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))"
    r"\s+session\b"
    r"|\bearlier versions?\s+of\b"  # "an earlier version of this README"
    r"|[(;]\s*was\s+\d",  # "(was 12 s)", "(0.4 s; was 8.5 s)": a figure before a change
    re.IGNORECASE,
)


def _markdown_links(text: str) -> list[str]:
    """The targets of the Markdown links and images of `text`, outside code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_readme_is_a_short_page():
    size = len(README.read_bytes())
    assert size <= 15_000, f"README.md is {size:,} bytes; keep it at most 15,000 (the reference is in docs/)"


def test_docs_holds_one_page_per_topic():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    for page in (
        "commands.md",
        "recipes.md",
        "data.md",
        "models.md",
        "run-directory.md",
        "distributed.md",
        "guarantees.md",
        "evidence.md",
    ):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_to_a_file_in_the_repository(page):
    broken = []
    for target in _markdown_links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_test_the_guarantees_name_exists():
    page = (ROOT / "docs" / "guarantees.md").read_text()
    defined = set(re.findall(r"^\s*def (test_\w+)", _all_test_sources(), flags=re.M))
    files = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    missing = [name for name in sorted(set(re.findall(r"`(test_\w+)`", page))) if name not in defined]
    missing += [name for name in sorted(set(re.findall(r"`(test_\w+\.py)`", page))) if name not in files]
    assert missing == [], f"docs/guarantees.md names tests that do not exist: {missing}"


def _all_test_sources() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "tests").rglob("*.py")))


def _scanned_files() -> list[Path]:
    files = [*PAGES]
    for pattern in ("*.py", "*.c", "*.md", "*.yaml", "*.sh", "*.txt"):
        files += (ROOT / "difftrain").rglob(pattern)
    files += [ROOT / "benchmarks" / "README.md"]
    for pattern in ("*.py", "*.sh"):
        files += (ROOT / "benchmarks").glob(pattern)
    files += (ROOT / "recipes").glob("*.yaml")
    return sorted({f for f in files if f.is_file() and "__pycache__" not in f.parts})


def test_nothing_in_the_product_narrates_its_development():
    hits = []
    for path in _scanned_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if m := HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: …{m.group(0)}…")
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"\bdef (test_\w+)", line):
                if m := HISTORY.search(name.replace("_", " ")):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {name} (…{m.group(0)}…)")
    assert hits == [], (
        "say what the code does and what was measured (with date and machine), not how it was "
        "developed:\n" + "\n".join(hits)
    )


def test_the_history_scan_catches_what_it_is_for():
    for text in (
        "Session 12 found the compiled step slower",
        "sessions 3–4",
        "an earlier version of this README read the masses",
        "measured in this repository's first development session",
        "refused before torch loads (0.4 s; was 8.5 s)",
        "the ninth session's tables",
    ):
        assert HISTORY.search(text), text
    for text in (
        "wall_time_s covers the last session of a resumed run",
        "a REPL session ends at Ctrl-D",
        "the step was 120",
    ):
        assert not HISTORY.search(text), text
