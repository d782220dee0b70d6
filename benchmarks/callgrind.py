"""Instructions one call executes, counted by valgrind's callgrind: a cost this machine's clocks cannot resolve.

Two identical plain decoding calls of 128 tokens differ by 0.01% in instructions, whatever else the machine runs,
where their times scatter by 10% from one call to the next: a 1% overhead is invisible to the clock here and plain
in a count. A count is not a time (an instruction of the interpreter's bookkeeping and one of a matrix product take
different times), so a benchmark reports both, each for what it can show.

A script opts in with `rerun_under_callgrind()`, which runs it again under valgrind with nothing counted until a
`count()`. Calls run about 50 times slower there: a 128-token call of the reference pair takes 3-4 minutes.
Needs valgrind and its headers (Debian: `apt-get install valgrind`) and a C compiler.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Client requests are instruction sequences valgrind recognises, so they run from C: a two-function library.
_CLIENT_REQUESTS = r"""
#include <valgrind/callgrind.h>
int running_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
void start_counting(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void stop_counting(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""
_DUMPS = "HYPERDFLASH_CALLGRIND_DUMPS"  # where the rerun's counts are written, for the script to read back


@functools.cache
def _client_requests() -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("Counting instructions needs a C compiler (Debian: apt-get install gcc).")
    folder = tempfile.mkdtemp(prefix="callgrind_requests_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    library = Path(folder) / "requests.so"
    built = subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", str(library)],
        input=_CLIENT_REQUESTS,
        text=True,
        capture_output=True,
    )
    if built.returncode:
        raise RuntimeError(
            f"Counting instructions needs valgrind's headers (apt-get install valgrind): {built.stderr}"
        )
    return ctypes.CDLL(str(library))


def running_under_callgrind() -> bool:
    return _DUMPS in os.environ and bool(_client_requests().running_on_valgrind())


def rerun_under_callgrind() -> int:
    """Run this script again, with the same arguments, under callgrind (counting nothing until `count()`); its exit
    status."""
    if shutil.which("valgrind") is None:
        raise RuntimeError("Counting instructions needs valgrind (Debian: apt-get install valgrind).")
    _client_requests()  # fail here, not after the rerun has loaded its models
    with tempfile.TemporaryDirectory(prefix="callgrind_") as dumps:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            f"--callgrind-out-file={dumps}/counts",
            "--quiet",
            sys.executable,
            *sys.argv,
        ]
        return subprocess.run(command, env=os.environ | {_DUMPS: dumps}).returncode


def count(call: Callable[[], object]) -> int:
    """Instructions `call()` executes, from a collected heap (a full collection that one call starts and another
    does not would be millions of instructions of noise)."""
    gc.collect()
    requests = _client_requests()
    requests.start_counting()
    try:
        call()
    finally:
        requests.stop_counting()
    dump = max(Path(os.environ[_DUMPS]).glob("counts.*"), key=lambda path: int(path.suffix[1:]))  # counts.1, .2, ..
    # "totals" sums the functions' costs; "summary", the global counter, once read 2**64 less a few million here
    totals = int(next(line for line in dump.read_text().splitlines() if line.startswith("totals:")).split()[1])
    dump.unlink()
    if not 0 < totals < 2**62:
        raise RuntimeError(f"callgrind counted {totals} instructions, which cannot be: count again.")
    return totals
