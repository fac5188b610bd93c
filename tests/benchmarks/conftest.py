"""The benchmarks are scripts that import each other by module name, with benchmarks/ on sys.path (as
running one puts it there); the tests here import them the same way, so each module is loaded once."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
