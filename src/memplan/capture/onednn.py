"""What a CPU matmul that PyTorch runs with oneDNN holds beyond its output, measured.

Where `memplan.hardware.onednn.takes_onednn` says PyTorch sends a matmul to oneDNN,
ideep's `matmul_forward` (`include/ideep/operators/matmul.hpp`, `do_compute`) allocates
the primitive's scratchpad, `tensor scratchpad(pd.scratchpad_desc())`, for the length of
the call (and a reordered copy of an operand whose layout the primitive does not take),
and PyTorch registers c10's CPU allocator as ideep's allocator
(`aten/src/ATen/native/mkldnn/IDeepRegistration.cpp`): torch.profiler counts it, while
the dispatch-level recorder, which sees the tensors an op returns, does not. oneDNN's
brgemm matmul books that scratchpad per thread (oneDNN v3.12
`src/cpu/x64/matmul/brgemm_matmul_utils.cpp` lines 2251-2311, `init_scratchpad`: batch
descriptors, copies of A and B blocks, an f32 accumulator for a bf16 output; each entry
padded by 128 B, `src/common/memory_tracking.hpp` lines 384-425), with blockings chosen
from the shape, the thread count and, in some heuristics, the cache sizes, so its size
is measured, not modelled (docs/estimation.md works one case through by hand): once
per distinct (op, shapes, strides, dtypes, alpha, beta, thread count),
`matmul_transient_bytes` runs the real kernel on real tensors and reads its allocations
from torch.profiler (`memplan.capture.groundtruth.transient_bytes`), and
`onednn_workspaces` places a buffer of that size beside each such op's output.

The recorder keeps each matmul's arguments (`matmul_signature`) in the trace's
`meta["matmul_args"]`. Assumes the job runs with this process's oneDNN settings and
thread count (`torch.get_num_threads()`), which the measurement runs under.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memplan.capture.groundtruth import transient_bytes
from memplan.hardware.onednn import MATMUL_OPS, OnednnPath, host_onednn_path, takes_onednn
from memplan.trace.edit import ExtraBuffer
from memplan.trace.model import PHASES, Trace

SCALED_OPS = frozenset({"aten::addmm", "aten::baddbmm"})  # the matmuls that take alpha and beta


def matmul_signature(schema_name: str | None, args: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments of a `MATMUL_OPS` call as JSON (None for any other op, or symbolic
    sizes): each tensor argument's shape, strides and dtype, then alpha and beta (an
    `out=` is left out: the kernel is the same)."""
    if schema_name not in MATMUL_OPS:
        return None
    tensors = [(list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch."))
               for t in args if isinstance(t, torch.Tensor)]
    if not all(isinstance(d, int) for shape, strides, _ in tensors for d in shape + strides):
        return None  # symbolic sizes (a dynamic-shape graph): no kernel to run
    return {"op": schema_name, "tensors": [list(t) for t in tensors], "alpha": float(kwargs.get("alpha", 1)),
            "beta": float(kwargs.get("beta", 1))}


_MEASURED: dict[tuple[str, int], int] = {}


def matmul_transient_bytes(signature: dict[str, Any]) -> int:
    """Bytes the real kernel of `signature` holds beyond its output, measured once per
    signature and thread count (zero-filled inputs of the recorded strides)."""
    key = (json.dumps(signature, sort_keys=True), torch.get_num_threads())
    if key not in _MEASURED:
        inputs = [torch.empty_strided(shape, stride, dtype=getattr(torch, dtype)).zero_()
                  for shape, stride, dtype in signature["tensors"]]
        op = getattr(torch.ops.aten, signature["op"].removeprefix("aten::")).default
        scalars = {"alpha": signature["alpha"], "beta": signature["beta"]} if signature["op"] in SCALED_OPS else {}
        with torch.no_grad():
            _MEASURED[key] = transient_bytes(lambda: op(*inputs, **scalars))
    return _MEASURED[key]


def onednn_workspaces(trace: Trace, path: OnednnPath | None = None,
                      measure: Callable[[dict[str, Any]], int] = matmul_transient_bytes) -> list[ExtraBuffer]:
    """One temporary buffer per recorded matmul that takes oneDNN's kernel under `path`
    (None: this process's), of its measured size, allocated just after the op's last
    output and freed before the trace's next event: live with everything the op holds."""
    path = path if path is not None else host_onednn_path()
    recorded = [(int(op), sig) for op, sig in trace.meta.get("matmul_args", [])]
    taken = [(op, sig) for op, sig in recorded if takes_onednn(sig, path)]
    if not taken:
        return []
    last_alloc = np.full(trace.num_ops, -1, np.int64)
    made = trace.buffers["alloc_op"] >= 0
    np.maximum.at(last_alloc, trace.buffers["alloc_op"][made], trace.buffers["alloc_event"][made])
    device = trace.main_device()
    extras = []
    for op, sig in taken:
        nbytes = measure(sig)
        if nbytes > 0:
            at = int(last_alloc[op]) + 1 if last_alloc[op] >= 0 else int(trace.ops["first_event"][op])
            extras.append(ExtraBuffer(nbytes, at, at, "temporary", PHASES[int(trace.ops["phase"][op])], op=op,
                                      device=device))
    return extras
