"""Argument handling every ``ibex-context`` command shares: one-line usage errors, UTF-8 checks,
one line for a malformed ``IBEX_*`` variable (README "Quickstart").

Here rather than in a server module, so the CLI's client-side commands (``assemble``, ``keys``,
``explain``) run on an install without the server extra.
"""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

from pydantic import ValidationError

from ..wire.validation import first_error


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``PROG: what is wrong``), exit 2.

    argparse's default prints the whole usage block first; a newcomer then has to find the one
    line that matters. Subparsers inherit the class, so every subcommand behaves the same.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} -h)\n")


def utf8_arg(value: str) -> str:
    """argparse ``type=`` for text arguments: refuse bytes that are not UTF-8.

    Python hands undecodable argv bytes over as lone surrogates; they would fail much later
    (encoding for Redis or the wire) with a traceback instead of naming the argument.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (byte {exc.start} of the argument)") from exc
    return value


def settings_error(exc: ValidationError, prefix: str = "IBEX_") -> str:
    """One line naming a malformed environment variable (docs/settings.md)."""
    err = first_error(exc)
    name = "_".join(err.loc).upper()
    name = name if name.startswith("IBEX_") else prefix + name  # a field that names its variable
    return f"settings: {name}: {err.message}"


def write_port_file(path: str, *lines: object) -> None:
    """A ``--port-file``'s lines, written whole or not at all (temp file, then rename): a launcher
    that binds port 0 in the child and reads this file back gets free ports without a
    pick-then-bind race, and never reads a file half written."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)
