"""The README against the repository: its test command is what CI runs, its images are small PNGs
that exist, and the recipes its commands run load."""

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


def test_readme_images_exist_and_are_small_pngs():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    assert images
    for image in images:
        data = (ROOT / image).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", image
        assert len(data) < 150_000, (image, len(data))  # the repository carries them in every clone


def test_readme_sweep_commands_name_the_shipped_sweep_recipe():
    from pipelines.recipe import load_recipe

    text = (ROOT / "README.md").read_text()
    recipes = set(re.findall(r"distill run (pipelines/recipes/\S+\.toml)", text))
    assert "pipelines/recipes/sweep_quickstart.toml" in recipes
    for recipe in recipes:
        load_recipe(ROOT / recipe)
