"""The scripts under benchmarks/, imported by the tests that run them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"  # tests/helpers/ -> the repository root


def import_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (with the scripts' shared ``common`` on the path while
    it imports: the scripts import it by that name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
