"""The one exception type the CLI turns into a one-line message (no traceback)."""


class BlockspecError(RuntimeError):
    """An expected failure caused by input (a file, a prompt, an option), worded for the user."""
