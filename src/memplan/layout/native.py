"""The exact offset search's compiled engines: `csrc/offset_search.cpp`, built once.

The C++ file holds two complete searches for the decision form (does a packing
within this capacity exist?):

- the skyline search of `exact.py`, node for node (exact.py stays its reference and
  the tests compare the two), about a hundred times faster per node;
- an offset-order search written from minimalloc's description (Moffitt, ASPLOS
  2023): buffers placed at their lowest viable offset in non-decreasing (offset,
  pre-order) order, dominance, section inference with monotonic and unallocated
  floors, dynamic decomposition, pre-orders WAT/TAW/TWA round robin;

and `solve_portfolio`, which runs both at once on two threads and keeps the first
definite answer: neither search dominates the other (the skyline search is the
stronger on random guillotine cuts, the offset-order search on minimalloc's own
challenging benchmarks). Past its share of the time, the offset-order search's thread
runs the skyline search on the time-reversed problem, whose canonical form stalls on
other instances than the forward one's. The file is compiled by `memplan.native.build_extension`, the loader the planned
allocator's build uses too.

`available()` says whether the engines can be used (a compiler and ninja present, and
the build succeeded); callers fall back to the Python search when they cannot.
`extension()` raises a UserError saying what is missing.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

from memplan.errors import UserError
from memplan.native import build_extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "offset_search.cpp"
EXTENSION = "memplan_offset_search"


@cache
def extension() -> ModuleType:
    """The compiled searches (`solve`, `solve_offset_order`, `solve_portfolio`)."""
    module = build_extension(EXTENSION, [SOURCE], purpose="memplan's exact offset search")
    assert module is not None
    return module


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
