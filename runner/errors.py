"""User-facing errors.

Anything a user can cause (a bad path, a malformed checkpoint, an impossible shard count) raises
:class:`PmxError` with a message naming the file, tensor or value and what was expected. The command
line prints the message (no traceback) and exits with status 2.
"""


class PmxError(Exception):
    """A problem with the user's input, reported without a traceback."""
