"""The house rules for text: docs that read in a minute, and no pasted runs in source.

- No prose paragraph in README.md or docs/**/*.md is over 150 words (fenced code blocks and tables
  are not prose; a list item is a paragraph of its own).
- No comment or docstring under src/ names a GPU or an ISO date: a figure lives in
  benchmarks/RESULTS.md with its run, and the source points there.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_WORDS = 150
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SOURCES = sorted((ROOT / "src").rglob("*.py"))

_FENCE = re.compile(r"^\s*(```|~~~)")
_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+")
_GPU = re.compile(r"\b(?:[HA]100|H200|H800|A800|A10G|V100|L40S?|B200|GB200|MI[23]\d0X?|RTX ?\d{4})\b")
_DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")


def paragraphs(text: str) -> list[tuple[int, str]]:
    """The prose units of a markdown text, with the line each starts on: paragraphs split at blank
    lines, each list item on its own; fenced code blocks, tables and headings left out."""
    units: list[tuple[int, list[str]]] = []
    fenced = False
    current: list[str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced, current = not fenced, None
            continue
        stripped = line.strip()
        if fenced or not stripped or stripped.startswith(("|", "#", "<!--")):
            current = None
            continue
        item = _ITEM.match(line)
        if current is None or item:
            current = []
            units.append((number, current))
        current.append(line[item.end():].strip() if item else stripped)
    return [(number, " ".join(lines)) for number, lines in units]


def test_paragraphs_splits_items_and_skips_code_and_tables():
    text = "one two\nthree\n\n- a b\n- c\n  d\n\n```\nx y z\n```\n| t | u |\n|---|---|\n# Head\n"
    assert paragraphs(text) == [(1, "one two three"), (4, "a b"), (5, "c d")]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_docs_paragraph_over_150_words(path: pathlib.Path):
    long = [(number, len(unit.split())) for number, unit in paragraphs(path.read_text())
            if len(unit.split()) > MAX_WORDS]
    assert not long, f"{path.relative_to(ROOT)}: paragraphs over {MAX_WORDS} words (line, words): {long}"


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """Every comment and every module, class and function docstring of a Python source, with its line."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                    body[0].value.value, str):
                found.append((body[0].lineno, body[0].value.value))
    return found


def test_comments_and_docstrings_finds_both():
    source = '"""Module."""\n# a comment\ndef f():\n    """Doc."""\n    return "H100"  # why\n'
    assert sorted(comments_and_docstrings(source)) == [(1, "Module."), (2, "# a comment"), (4, "Doc."),
                                                       (5, "# why")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_gpu_names_or_dates_in_comments_and_docstrings(path: pathlib.Path):
    hits = [(line, m.group()) for line, text in comments_and_docstrings(path.read_text())
            for m in (*_GPU.finditer(text), *_DATE.finditer(text))]
    assert not hits, (f"{path.relative_to(ROOT)}: GPU names or dates in comments or docstrings (line, text): "
                      f"{hits}; give the reason in a line and point to benchmarks/RESULTS.md")
