"""The README's test command is what CI runs; keep the two from drifting apart."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("python3 -m venv")]


def test_readme_has_exactly_two_setup_and_go_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("distill quickstart")  # the embedded default, end to end
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_lines
