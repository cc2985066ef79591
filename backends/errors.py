"""Errors the CLI reports as one line on stderr with exit code 2 (bad recipe, data, override, env output,
server reply): the user can fix them, so no traceback."""


class UserError(Exception):
    """A problem with the user's input. The message is one line and names what to fix."""


def one_line(e: BaseException) -> str:
    """`Type: message` with its whitespace collapsed: how an exception raised in a user's code is quoted inside a
    UserError (which is one line)."""
    return " ".join(f"{type(e).__name__}: {e}".split())
