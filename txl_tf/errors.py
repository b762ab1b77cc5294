"""Expected user errors and the one way every command-line entry point reports them.

An expected error (a bad flag or gin binding, a damaged or missing file, a refused overwrite) is printed as one
line on stderr,

    error: <what went wrong, naming the file or value>; <how to fix it>

and the program exits with status 2. Anything else is a bug or an environment failure and keeps its traceback.

Every absl entry point starts with `errors.run(main)` instead of `absl.app.run(main)`; flag parsing errors get
the same one-line form.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An expected error whose message tells the user what to change (printed without a traceback)."""


class ConfigError(UserError, ValueError):
    """A gin binding, flag value or configuration field is unknown, of the wrong type or out of range."""


# Errors of the standard library that, raised by txl_tf code, name a path the user gave.
_EXPECTED = (UserError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)


def one_line(error: BaseException) -> str:
    """The first line of an error's message (gin appends "In call to configurable ..." lines)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_expected(error: BaseException) -> bool:
    return isinstance(error, _EXPECTED)


def report(error: BaseException, stream=None) -> None:
    """Prints `error: <first line of the message>` on `stream` (stderr)."""
    print(f"error: {one_line(error)}", file=stream or sys.stderr, flush=True)


def _parse_flags(argv: list) -> list:
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        report(ConfigError(f"{error}; see --helpshort"))
        sys.exit(EXIT_USER_ERROR)


def guard(main: Callable[[list], object]) -> Callable[[list], object]:
    """`main` wrapped so that expected errors print one line and exit with status 2."""

    def guarded(argv):
        try:
            return main(argv)
        except BaseException as error:  # noqa: BLE001  (re-raised unless expected)
            if not is_expected(error):
                raise
            report(error)
            sys.exit(EXIT_USER_ERROR)

    return guarded


def run(main: Callable[[list], object]) -> None:
    """`absl.app.run(main)` with one-line reporting of expected errors and flag errors (exit status 2)."""
    from absl import app

    app.run(guard(main), flags_parser=_parse_flags)
