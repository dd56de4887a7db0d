"""The README is a front door that works: its CPU example runs as written, its links lead somewhere,
and it stays short (details in docs/, figures in benchmarks/RESULTS.md)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_front_door():
    assert len(README.splitlines()) <= 150
    assert "python3 -m pytest -q" in README and "shrinkwrap demo" in README


def test_the_sixty_second_example_runs_on_a_cpu(capsys):
    block = re.search(r"## Sixty seconds on a CPU\n\n```python\n(.*?)```", README, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "estimated CUDA peak" in out and "FusedBatchNormAct[BatchNorm2d]" in out


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file(page):
    prose = re.sub(r"```.*?```|`[^`]*`", "", page.read_text(), flags=re.S)  # code is no link
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", prose):
        assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_docs_index_lists_every_page_once():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = re.findall(r"\]\(([^)#]+\.md)\)", index)
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md") if p.name != "README.md")
    assert sorted(p for p in linked if not p.startswith("..")) == pages
    assert "docs/README.md" in README
