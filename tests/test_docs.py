"""The documentation holds together: every relative link in README.md and docs/**/*.md
resolves (the file exists; an #anchor names a heading of the target), the README stays
under its size budget, and each page of docs/results/ opens with its numbers and the
command that produced them (issue 39, item 6)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15_360
OPENING_LINES = 15  # a results page's numbers and command come within its first lines

LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
COMMAND = re.compile(r"recdepth|python -m|\bmake\b|python ")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase; letters, digits, marks, '-', '_' and spaces
    kept, every other character (punctuation, symbols: backticks, §, parentheses, dashes
    other than '-', ×, ≤) dropped; each space becomes '-'."""
    kept = (
        ch
        for ch in heading.strip().lower()
        if ch in "-_ " or unicodedata.category(ch)[0] in "LNM"
    )
    return "".join(kept).replace(" ", "-")


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines not inside a fenced code block."""
    out, fence = [], None
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is None:
            out.append((n, line))
    return out


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link and image in a markdown file, outside
    code blocks and code spans."""
    out = []
    for n, line in outside_fences(path.read_text(encoding="utf-8")):
        line = CODE_SPAN.sub(lambda m: "code" if m.group(0).count("](") == 0 else "", line)
        out.extend((n, m.group("target")) for m in LINK.finditer(line))
    return out


def broken_links(path: Path) -> list[str]:
    """Every relative link of `path` that does not resolve, as 'file:line: target (why)'.
    http(s) and mailto links are not checked."""
    bad = []
    cache: dict[Path, set[str]] = {}
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path}:{n}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                bad.append(f"{where} (an anchor into a non-markdown target)")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                bad.append(f"{where} (no heading with that anchor)")
    return bad


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def results_pages() -> list[Path]:
    return [p for p in sorted((ROOT / "docs" / "results").glob("*.md")) if p.name not in ("README.md", "index.md")]


# ------------------------------------------------------------------------------ the slug


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("§4b Baselines and statistics for exit comparisons", "4b-baselines-and-statistics-for-exit-comparisons"),
        (
            "The compiled batch-1 step: fused products, attention spans, `eval.latency_backend` (issue 23)",
            "the-compiled-batch-1-step-fused-products-attention-spans-evallatency_backend-issue-23",
        ),
        ("Addition, first version (4-layer model, 1–4 digits)", "addition-first-version-4-layer-model-14-digits"),
        ("2026-11-26 — issue 23: the oracle 2× and the shared decode", "2026-11-26--issue-23-the-oracle-2-and-the-shared-decode"),
        ("Huginn-0125's decode cost (issue 13)", "huginn-0125s-decode-cost-issue-13"),
        ("Σ ratios, as measured (run 1)", "σ-ratios-as-measured-run-1"),
    ],
)
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_anchors_number_duplicates_and_skip_code_blocks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n## Runs\n\n```bash\n# not a heading\n```\n\n## Runs\n", encoding="utf-8")
    assert anchors(page) == {"title", "runs", "runs-1"}


# ------------------------------------------------------------------------------ the checker can fail


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    target = tmp_path / "docs" / "target.md"
    target.write_text("# Target\n\n## A section (issue 1)\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "[good](docs/target.md) [good anchor](docs/target.md#a-section-issue-1)",
                "[self](#page) and ![img](docs/missing.png)",
                "[bad file](docs/nope.md) [bad anchor](docs/target.md#no-such-section)",
                "[web](https://example.com/x#y) `[in code](docs/nope.md)`",
                "```",
                "[in a fence](docs/nope.md)",
                "```",
                "# Page",
            ]
        ),
        encoding="utf-8",
    )
    bad = broken_links(page)
    assert len(bad) == 3, bad
    assert any("docs/missing.png (no such file)" in b for b in bad)
    assert any("docs/nope.md (no such file)" in b for b in bad)
    assert any("#no-such-section (no heading with that anchor)" in b for b in bad)


# ------------------------------------------------------------------------------ the repository's docs


def test_every_link_in_readme_and_docs_resolves():
    bad = [b for path in doc_files() for b in broken_links(path)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_stays_the_manual_size():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move measurements to docs/results/"


def opening_problems(path: Path) -> list[str]:
    """What a results page's first lines lack: a table or list with numbers, and a command."""
    head = path.read_text(encoding="utf-8").split("\n")[:OPENING_LINES]
    numbers = any(
        (line.startswith("|") or re.match(r"^\s*[-*] ", line)) and re.search(r"\d", line) for line in head
    )
    fenced, command = False, False
    for line in head:
        if line.startswith("```"):
            fenced = not fenced
            continue
        code = line if fenced else " ".join(m.group(0) for m in CODE_SPAN.finditer(line))
        command = command or bool(COMMAND.search(code))
    problems = []
    if not numbers:
        problems.append(f"{path.name}: no table or list of numbers in its first {OPENING_LINES} lines")
    if not command:
        problems.append(f"{path.name}: no command in its first {OPENING_LINES} lines")
    return problems


def test_results_pages_open_with_numbers_and_a_command():
    pages = results_pages()
    assert pages, "docs/results/ has no topic pages"
    problems = [p for page in pages for p in opening_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_opening_check_can_fail(tmp_path):
    prose = tmp_path / "prose.md"
    prose.write_text("# A topic\n\nSome words about it, and no numbers.\n", encoding="utf-8")
    assert len(opening_problems(prose)) == 2
    good = tmp_path / "good.md"
    good.write_text("# A topic\n\n```bash\nmake bench\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n", encoding="utf-8")
    assert opening_problems(good) == []


def test_results_has_an_index_listing_every_page():
    index = ROOT / "docs" / "results" / "README.md"
    assert index.exists()
    listed = {t.partition("#")[0] for _, t in links(index)}
    missing = [p.name for p in results_pages() if p.name not in listed]
    assert not missing, f"docs/results/README.md does not list {missing}"
