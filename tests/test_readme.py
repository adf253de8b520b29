"""The README's two commands are what the repository runs: .ci/run is exactly command 2."""

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
