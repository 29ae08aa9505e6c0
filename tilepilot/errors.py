"""The one exception type that the CLI turns into a single line and exit status 2."""


class UserError(Exception):
    """Bad input or a missing prerequisite: the message names the thing and the fix."""

    exit_code = 2
