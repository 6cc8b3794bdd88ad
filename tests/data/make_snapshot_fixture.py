"""Writes tests/data/snapshot_two_devices.pickle: a hand-written PyTorch memory snapshot.

Shaped like what `torch.cuda.memory._dump_snapshot` writes (keys, actions, frames
innermost first, C++ frames before Python ones, stream values that are pointers),
small enough to check by hand. tests/trace/test_snapshot.py states what it must
import as. Run: .venv/bin/python tests/data/make_snapshot_fixture.py
"""

from __future__ import annotations

import pickle
from pathlib import Path

MiB = 1024 * 1024
SEG_A = 0x7F12_0000_0000  # device 0, stream 0, 20 MiB, large pool
SEG_B = 0x7F12_0200_0000  # device 0, stream 0, 2 MiB, small pool
SEG_D = 0x7F12_0400_0000  # device 0, side stream, 2 MiB
SEG_V = 0x7F34_0000_0000  # device 1, stream 0, 2 MiB
SIDE_STREAM = 94_823_612_345_678  # a cudaStream_t pointer value

CPP = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::Native::malloc"}
TORCH_LINEAR = {
    "filename": "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py",
    "line": 125,
    "name": "forward",
}
USER_MODEL = {"filename": "/home/user/train.py", "line": 42, "name": "forward"}
TORCH_SOFTMAX = {
    "filename": "/opt/venv/lib/python3.11/site-packages/torch/nn/functional.py",
    "line": 2140,
    "name": "softmax",
}


def entry(action: str, addr: int, size: int, time_us: int, stream: int = 0, frames=(), **extra):
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": stream,
        "time_us": time_us,
        "frames": list(frames),
        **extra,
    }


def snapshot() -> dict:
    device0 = [
        entry("segment_alloc", SEG_D, 2 * MiB, 990, stream=SIDE_STREAM),
        entry("alloc", SEG_A + 4 * MiB, 2 * MiB, 1000, frames=[CPP, TORCH_LINEAR, USER_MODEL]),
        entry("alloc", SEG_A + 6 * MiB, MiB, 1010, frames=[CPP, TORCH_SOFTMAX], category="activation"),
        entry("free_requested", SEG_A + 6 * MiB, MiB, 1020),
        entry("free_completed", SEG_A + 6 * MiB, MiB, 1021),
        # allocated before _record_memory_history: only its free is in the trace
        entry("free_requested", SEG_B + 512, 512, 1030),
        entry("free_completed", SEG_B + 512, 512, 1031),
        entry("alloc", SEG_D, MiB, 1040, stream=SIDE_STREAM),
        # record_stream: the free was requested, its completion is not in the trace
        entry("free_requested", SEG_D, MiB, 1050, stream=SIDE_STREAM),
        {"action": "oom", "size": 80 * 1024 * MiB, "stream": 0, "device_free": 3 * MiB,
         "time_us": 1060, "frames": []},
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 1070, "frames": []},
    ]
    device1 = [entry("alloc", SEG_V, 8192, 1035, frames=[USER_MODEL])]
    segments = [
        {
            "device": 0, "address": SEG_A, "total_size": 20 * MiB, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0),
            "allocated_size": 6 * MiB, "active_size": 6 * MiB, "requested_size": 4000000 + 2 * MiB,
            "blocks": [
                # never in the trace: allocated before recording, still live
                {"address": SEG_A, "size": 4 * MiB, "requested_size": 4000000,
                 "state": "active_allocated", "frames": []},
                {"address": SEG_A + 4 * MiB, "size": 2 * MiB, "requested_size": 2 * MiB,
                 "state": "active_allocated", "frames": [CPP, TORCH_LINEAR, USER_MODEL]},
                {"address": SEG_A + 6 * MiB, "size": 14 * MiB, "requested_size": 0,
                 "state": "inactive", "frames": []},
            ],
        },
        {
            "device": 0, "address": SEG_B, "total_size": 2 * MiB, "stream": 0,
            "segment_type": "small", "segment_pool_id": (0, 0),
            "allocated_size": 512, "active_size": 512, "requested_size": 100,
            "blocks": [
                {"address": SEG_B, "size": 512, "requested_size": 100,
                 "state": "active_allocated", "frames": []},
                {"address": SEG_B + 512, "size": 2 * MiB - 512, "requested_size": 0,
                 "state": "inactive", "frames": []},
            ],
        },
        {
            "device": 0, "address": SEG_D, "total_size": 2 * MiB, "stream": SIDE_STREAM,
            "segment_type": "small", "segment_pool_id": (0, 0),
            "allocated_size": 0, "active_size": MiB, "requested_size": MiB,
            "blocks": [
                {"address": SEG_D, "size": MiB, "requested_size": MiB,
                 "state": "active_awaiting_free", "frames": []},
                {"address": SEG_D + MiB, "size": MiB, "requested_size": 0,
                 "state": "inactive", "frames": []},
            ],
        },
        {
            "device": 1, "address": SEG_V, "total_size": 2 * MiB, "stream": 0,
            "segment_type": "small", "segment_pool_id": (0, 0),
            "allocated_size": 8192, "active_size": 8192, "requested_size": 8192,
            "blocks": [
                {"address": SEG_V, "size": 8192, "requested_size": 8192,
                 "state": "active_allocated", "frames": [USER_MODEL]},
                {"address": SEG_V + 8192, "size": 2 * MiB - 8192, "requested_size": 0,
                 "state": "inactive", "frames": []},
            ],
        },
    ]
    return {
        "segments": segments,
        "device_traces": [device0, device1],
        "allocator_settings": {"expandable_segments": False, "max_split_size": -1},
        "external_annotations": [],
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("snapshot_two_devices.pickle")
    out.write_bytes(pickle.dumps(snapshot(), protocol=4))
    print(f"wrote {out}")
