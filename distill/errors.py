"""The user-error base class: a leaf module every package imports, importing nothing of ours.

The CLI prints a `DistillUserError`'s message as one `error:` line and exits non-zero; anything
else is a bug and keeps its traceback.
"""


class DistillUserError(ValueError):
    """A mistake the user can fix: the message says what was wrong, the value seen and what to do."""
