"""Reading JSONL input files (chunks, validation items, LongBench data) with errors that name the spot.

Imports only the standard library. Every reader of a user's JSONL file goes through `read_jsonl`: it
reads the file as UTF-8, skips blank lines, parses each line, and reports an unreadable file by the
argument that named it and a bad line by `<path>:<line>`. Checking the shape of each value is the
caller's (the messages differ by what a line must hold).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path, what: str) -> Iterator[tuple[str, int, Any]]:
    """(where, line number, parsed value) for every non-blank line of `path`, in file order; lines are
    parsed as they are consumed, so a caller that stops early never sees the lines after.

    Args:
        path: the JSONL file.
        what: how the user named it, for file-level errors (e.g. "--chunks").

    Raises:
        ValueError: "<what> '<path>': ..." when the file cannot be read or is not UTF-8 text (at the
            first step), and "<path>:<line>: not valid JSON (...)" for a line that does not parse.
    """
    try:
        # "\n" only: splitlines() also breaks at U+2028, U+2029 and U+0085, which JSON strings may hold raw
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {str(path)!r}: not UTF-8 text ({exc.reason})") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        yield where, lineno, value
