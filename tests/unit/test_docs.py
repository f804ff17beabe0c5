"""The documentation stays true to the tree: docs/settings.md is the render of the Settings
docstrings, every relative link (and #anchor) in the README and docs/ resolves inside the
repository, every LLMQ_* name the docs mention is a real setting, and the code map names every
module that exists and none that does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared import settings_doc
from shared.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SETTINGS = {f"LLMQ_{name.upper()}" for name in Settings.__struct_fields__}
README_MAX_LINES = 250  # the "a few screens, about 200 lines"; details belong in docs/


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "api/dialects/README.md",
            ROOT / "deploy/README.md"]


# --- reading markdown ----------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (links and headings there are code, not markdown)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def links(text: str) -> list[str]:
    """Every link target: inline ``[text](target)`` (images too) and reference definitions."""
    found = []
    for line in prose_lines(text):
        line = _CODE_SPAN.sub("code", line)  # a `](` inside a code span is no link
        found += _INLINE_LINK.findall(line)
        found += _REFERENCE.findall(line)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower-cased, without punctuation, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        if m := _HEADING.match(line):
            base = slug(m[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links in ``path``: targets that do not exist, lie outside
    ``root``, or name an #anchor the target markdown file has no heading for."""
    problems = []
    text = path.read_text(encoding="utf-8")
    for target in links(text):
        if not target or _SCHEME.match(target):
            continue  # a web address: not this test's business
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{target}: no heading for #{anchor}")
    return problems


# --- settings.md ---------------------------------------------------------------------------------


def test_settings_md_is_the_render_of_the_settings_docstrings():
    written = (DOCS / "settings.md").read_text(encoding="utf-8")
    assert written == settings_doc.render(), (
        "docs/settings.md differs from the Settings docstrings in shared/config.py: run `make docs`")


def test_settings_md_lists_every_setting_once_with_its_default():
    rows = [line for line in settings_doc.render().splitlines() if line.startswith("| `LLMQ_")]
    names = [row.split("`")[1] for row in rows]
    assert sorted(names) == sorted(SETTINGS)
    assert len(names) == len(set(names))
    port = next(row for row in rows if row.startswith("| `LLMQ_PORT`"))
    assert port.startswith("| `LLMQ_PORT` | `int` | `8080` | the API's port")
    redis = next(row for row in rows if row.startswith("| `LLMQ_REDIS_URL`"))
    assert redis.startswith("| `LLMQ_REDIS_URL` | `str \\| None` | unset | ")  # a pipe in a cell is escaped


def test_an_alias_in_a_docstring_is_kept():
    rows = settings_doc.render().splitlines()
    row = next(r for r in rows if r.startswith("| `LLMQ_LMI_OUTPUT_FORMATTER`"))
    assert "Also read as LMI's OPTION_OUTPUT_FORMATTER. `jsonlines` or `sse`." in row


def test_settings_are_grouped_by_the_section_comments_of_the_class():
    source = '''
class Settings:
    a: int = 1
    """LLMQ_A: first."""

    # worker
    b: str = ""
    """LLMQ_B: second,
    on two lines."""
    c: bool = False
    """LLMQ_C (or OTHER_C): third."""
'''
    assert settings_doc.parse(source) == [
        settings_doc.Entry("a", "int", "first.", "general"),
        settings_doc.Entry("b", "str", "second, on two lines.", "worker"),
        settings_doc.Entry("c", "bool", "Also read as OTHER_C. third.", "worker"),
    ]


def test_every_setting_sits_in_a_named_section():
    entries = settings_doc.parse((ROOT / "shared/config.py").read_text(encoding="utf-8"))
    assert [e.field for e in entries if e.section == settings_doc.FIRST_SECTION] == [], (
        "put a `# concern` comment above the first field of each group in Settings")


def test_a_setting_without_a_docstring_fails_the_render():
    source = 'class Settings:\n    a: int = 1\n    """LLMQ_A: documented."""\n    b: int = 2\n'
    with pytest.raises(ValueError, match=r"Settings\.b has no docstring"):
        settings_doc.parse(source)


def test_a_docstring_naming_another_variable_fails_the_render():
    source = 'class Settings:\n    port: int = 1\n    """LLMQ_OLD_PORT: renamed field, stale docstring."""\n'
    with pytest.raises(ValueError, match=r"must open with 'LLMQ_PORT: '"):
        settings_doc.parse(source)


# --- links ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path):
    assert broken_links(path) == []


def test_the_link_check_reports_each_kind_of_broken_link(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A dead worker's jobs move on\n\n## Twice\n## Twice\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#a-dead-workers-jobs-move-on) [ok](other.md#twice-1) [ok](#page)\n"
        "[web](https://example.com/x) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[gone](missing.md) [anchor](other.md#nope) [self](#nope) [out](../../outside.md)\n"
        "[ref]: ../nothing.py\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "missing.md: no such file",
        "other.md#nope: no heading for #nope",
        "#nope: no heading for #nope",
        "../../outside.md: outside the repository",
        "../nothing.py: no such file",
    ]


def test_slugs_follow_githubs_rules():
    assert slug("AWS LMI / DJL Serving") == "aws-lmi--djl-serving"
    assert slug("Bad input gets the dialect's own 4xx, never a 500 or a hang") == (
        "bad-input-gets-the-dialects-own-4xx-never-a-500-or-a-hang")
    assert slug("`api/`: the web process") == "api-the-web-process"
    assert slug("happy_vllm") == "happy_vllm"


# --- what the docs say about the code --------------------------------------------------------------


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_llmq_variable_named_in_the_docs_is_a_setting(path: Path):
    named = set(re.findall(r"\bLLMQ_[A-Z][A-Z0-9_]*\b", path.read_text(encoding="utf-8")))
    assert named - SETTINGS == set()


@pytest.mark.parametrize("path", [p for p in markdown_files() if p != DOCS / "settings.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_settings_are_described_only_in_settings_md(path: Path):
    # A second table of settings is how the README's drifted from the docstrings.
    rows = [line for line in path.read_text(encoding="utf-8").splitlines() if re.match(r"\|\s*`LLMQ_", line)]
    assert rows == [], "describe settings in their Settings docstring (docs/settings.md), link to it here"


def test_the_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, "the README is the overview: move the details to docs/"


def source_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for top in ("api", "shared", "workers") for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix in (".py", ".lua", ".md") and "__pycache__" not in p.parts}


def test_the_code_map_names_every_module_and_no_other():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    mapped = set(re.findall(r"^\| `((?:api|shared|workers)/[^`]+)` \|", text, re.MULTILINE))
    files = source_files()
    missing = sorted(f for f in files - mapped if not f.endswith("__init__.py"))
    assert missing == [], "add a row for each to the code map in docs/architecture.md"
    assert sorted(mapped - files) == [], "these rows of docs/architecture.md's code map name no file"
