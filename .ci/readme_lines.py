"""The README's lines that CI runs as written.

``python3 .ci/readme_lines.py install`` prints the first ```bash block under "## Install" (the
CPU-only machine's lines); ``test`` prints the test command (the ```bash block after "The tests").
tests/test_packaging.py checks that both are what a reader sees.
"""

import pathlib
import re
import sys

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def block_after(marker: str) -> str:
    """The first ```bash block after ``marker`` in the README."""
    found = re.search(re.escape(marker) + r".*?```bash\n(.*?)```", README, re.S)
    if found is None:
        raise SystemExit(f"README.md: no ```bash block after {marker!r}")
    return found.group(1)


LINES = {"install": lambda: block_after("## Install"), "test": lambda: block_after("The tests (")}

if __name__ == "__main__":
    print(LINES[sys.argv[1]](), end="")
