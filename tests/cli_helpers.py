"""Running `distill` in-process the way a user's shell would, for the CLI tests."""

from __future__ import annotations

import sys

from distill.cli import main


def run_cli(args, capsys):
    """Run `distill ARGS` in-process; returns (exit code, stdout, stderr)."""
    old = sys.argv
    sys.argv = ["distill", *map(str, args)]
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(code, err) -> str:
    """The one `error:` line a failed command printed (no traceback), after checking it failed."""
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_cli_ok(args) -> None:
    """Run `distill ARGS` in-process where no capsys is at hand (module-scoped fixtures); fails
    unless the command exits 0."""
    old = sys.argv
    sys.argv = ["distill", *map(str, args)]
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, None), f"distill {' '.join(map(str, args))} exited {e.code}"
    finally:
        sys.argv = old
