"""Every code block in README.md and docs/ runs as written on a CPU, and a section's blocks together
within the time its heading states ("Sixty seconds on a CPU", "Example (a minute on a CPU)";
otherwise a minute).

A block is fenced with its language: ``python`` (run as one script), ``bash`` (each line a command)
or ``text`` (output, a usage line or a tree: not run). The README's install blocks are run by
.ci/run (tests/test_packaging.py), and its test command is this suite.
"""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WORDS = {"a": 1, "one": 1, "two": 2, "three": 3, "five": 5, "ten": 10, "twenty": 20, "thirty": 30, "sixty": 60,
         "ninety": 90}
DEFAULT_S = 60


def limit(heading: str) -> float:
    """The seconds a heading promises ("Sixty seconds on a CPU", "Two minutes ..."), or the default."""
    found = re.search(r"(\d+|[A-Za-z]+) (second|minute)s?", heading)
    if not found:
        return DEFAULT_S
    n, unit = found.groups()
    return (int(n) if n.isdigit() else WORDS[n.lower()]) * (60 if unit == "minute" else 1)


def blocks(text: str) -> list[tuple[str, str, str, int]]:
    """(language, code, heading above it, line number) of every fenced block."""
    out, heading, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("```"):
            lang, start = line[3:].strip(), i + 1
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            out.append((lang, "\n".join(lines[start:i]) + "\n", heading, start))
        i += 1
    return out


def indented_code(text: str) -> list[int]:
    """Line numbers of indented (unfenced) code blocks: a blank line, then four spaces."""
    found, lines, fenced = [], text.splitlines(), False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and n > 1 and not lines[n - 2].strip() and re.match(r" {4,}\S", line):
            found.append(n)
    return found


def test_blocks_and_indented_code_are_found():
    page = "# A minute on a CPU\n\n```python\nx = 1\n```\n\ntext\n\n    indented\n```text\nout\n```\n"
    assert [(lang, heading) for lang, _, heading, _ in blocks(page)] == [("python", "A minute on a CPU"),
                                                                           ("text", "A minute on a CPU")]
    assert indented_code(page) == [9]
    assert limit("Sixty seconds on a CPU") == 60 and limit("Two minutes on a CPU") == 120 and limit("Example") == 60
    assert limit("Example (a minute on a CPU)") == 60 and limit("Examples (ninety seconds on a CPU)") == 90


def cases() -> list:
    """A case a section: its runnable blocks, in order, and the seconds its heading states."""
    out = []
    for page in PAGES:
        name, sections = str(page.relative_to(ROOT)), {}
        for lang, code, heading, line in blocks(page.read_text()):
            if lang == "bash" and name == "README.md" and (heading == "Install" or code == "python3 -m pytest -q\n"):
                continue  # .ci/run runs these as written (tests/test_packaging.py)
            if lang in ("python", "bash"):
                sections.setdefault((heading, limit(heading)), []).append((lang, code, line))
        for (heading, seconds), found in sections.items():
            out.append(pytest.param(found, seconds, id=f"{name}:{found[0][2]}"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_says_its_language_and_none_is_indented(page):
    text = page.read_text()
    assert {lang for lang, *_ in blocks(text)} <= {"python", "bash", "text"}, page.name
    assert indented_code(text) == [], f"{page.name}: fence these as ```python, ```bash or ```text"


@pytest.mark.parametrize("section,seconds", cases())
def test_a_sections_blocks_run_as_written_within_its_time(section, seconds, tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    start = time.perf_counter()
    for lang, code, _ in section:  # in order, in one folder: a later block may read what an earlier wrote
        commands = [code] if lang == "python" else [c for c in code.splitlines() if c.strip() and not c.startswith("#")]
        for command in commands:
            argv = [sys.executable, "-c", command] if lang == "python" else ["bash", "-euo", "pipefail", "-c", command]
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=seconds * 3)
            assert done.returncode == 0, f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    took = time.perf_counter() - start
    assert took <= seconds, f"took {took:.0f} s, its section says {seconds:.0f} s"
