"""How every `hyperdflash` command ends on a user mistake: the way argparse does, one line and exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# Bad input, by the project's convention: a ValueError whose message names the problem and the fix.
USER_ERRORS = (ValueError, FileNotFoundError)


def run_command(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)`; a user mistake (USER_ERRORS) ends it the way argparse does: one line
    `PROG: error: MESSAGE` on stderr, exit status 2, no traceback."""
    try:
        return run(args)
    except USER_ERRORS as error:
        message = " ".join(str(error).split())  # one line, whatever the message's layout
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
