"""The README's two commands are what the repository runs (.ci/run is exactly command 2), and the user docs
(README.md, docs/*.md) stay short, linked and free of development history."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"## The two commands\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_exactly_the_readmes_test_command():
    commands = _commands()
    assert len(commands) == 2, commands
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == commands[1], (ci[-1], commands[1])
    assert "pytest" in commands[1] and commands[0].startswith("scripts/bootstrap.sh")


# the user docs: a short README, links that resolve, no development history
MAX_README_LINES = 350
LINK = re.compile(r"\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")
HISTORY = re.compile(r"#\d+|\bsessions?\b|\b\d{4}-\d{2}-", re.I)


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _prose(text: str, inline_code: bool = False) -> str:
    """The page without fenced code blocks, and without inline code unless asked (where `](...)` is no link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return text if inline_code else re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", _prose(page.read_text(), inline_code=True), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower().replace("`", "")).replace(" ", "-") for h in headings}


def test_readme_is_short():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for a, b in LINK.findall(_prose(page.read_text())):
            target = a or b
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.is_file():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_docs_describe_the_present_not_the_history():
    found = []
    for page in _pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in HISTORY.finditer(line):
                found.append(f"{page.relative_to(REPO)}:{n}: {m.group(0)!r} in {line.strip()[:80]!r}")
    assert not found, "issue numbers, sessions or dates in the user docs:\n" + "\n".join(found)
