"""The exact offset search's compiled engine: `csrc/offset_search.cpp`, built once.

The C++ file reimplements minimalloc's search (Moffitt, ASPLOS 2023) — canonical
placements in offset order, dominance, section inference with monotonic and
unallocated floors, hatless pruning, static and dynamic decomposition, pre-orders
tried in turn — about a thousand times faster per node than the Python search in
`exact.py`, which stays the reference. It is compiled with
`torch.utils.cpp_extension.load` (ninja, cached under `TORCH_EXTENSIONS_DIR`, keyed
by the source's hash), as `memplan.runtime.build` compiles the planned allocator.

`available()` says whether the engine can be used (a compiler and ninja present, and
the build succeeded); callers fall back to the Python search when it cannot.
`extension()` raises a UserError saying what is missing.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

from memplan.errors import UserError
from memplan.runtime.build import missing_build_tools

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "offset_search.cpp"
EXTENSION = "memplan_offset_search"


@cache
def extension() -> ModuleType:
    """The compiled search (`solve(lower, upper, nbytes, align, capacity, time_limit_s, heuristics)`)."""
    missing = missing_build_tools()
    if missing:
        raise UserError("memplan's exact offset search compiles a small C++ extension and needs " + " and ".join(missing))
    from torch.utils.cpp_extension import load

    try:
        return load(name=EXTENSION, sources=[str(SOURCE)], extra_cflags=["-O2", "-std=c++17"], verbose=False)
    except (RuntimeError, OSError) as exc:
        raise UserError(f"could not compile memplan's exact offset search: {str(exc).strip().splitlines()[-1]}") from exc


@cache
def available() -> bool:
    """True when the compiled engine can be used (builds it on first call)."""
    if os.environ.get("MEMPLAN_EXACT_ENGINE", "") == "python":
        return False
    try:
        extension()
    except UserError as exc:
        log.info("exact search: using the Python engine (%s)", exc)
        return False
    return True
