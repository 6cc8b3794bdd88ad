"""PyTorch memory snapshots: exact round trip, import from events and segments, safety."""

from __future__ import annotations

import copy
import os
import pickle
import pickletools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import UserError
from memplan.trace.model import (
    ALLOC,
    BUFFER_COLUMNS,
    CATEGORIES,
    CATEGORY,
    CSR_COLUMNS,
    EVENT_COLUMNS,
    FREE,
    OP_COLUMNS,
    PHASE,
    PHASES,
    Trace,
    from_events,
)
from memplan.trace.snapshot import load_snapshot, save_snapshot, to_snapshot

DATA = Path(__file__).resolve().parent.parent / "data"
FIXTURE = DATA / "snapshot_two_devices.pickle"
MiB = 1024 * 1024
SIDE_STREAM = 94_823_612_345_678

# The opcodes MemoryViz.js (the page behind pytorch.org/memory_viz) can unpickle.
MEMORY_VIZ_OPCODES = {
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET",
    "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET",
    "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE",
    "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}  # fmt: skip


def trace_with_ops() -> Trace:
    """Two devices, two streams, a zero-byte and an odd-sized buffer, NaN FLOPs, nested meta."""
    cat = [CATEGORY[c] for c in ("parameter", "activation", "temporary", "gradient")]
    buffers = {
        "nbytes": [4096, 1000, 0, 2048],
        "alloc_event": [0, 1, 2, 4],
        "free_event": [-1, 5, 3, -1],
        "category": cat,
        "device": [0, 0, 0, 1],
        "stream": [0, 0, 3, 0],
        "alloc_op": [-1, 0, 1, 2],
        "module": [0, 1, 1, 2],
        "phase": [PHASE["other"], PHASE["forward"], PHASE["forward"], PHASE["backward"]],
        "iteration": [0, 0, 0, 1],
        "microbatch": [0, 1, 1, 0],
    }
    ops = {
        "name": [2, 1, 0],
        "module": [1, 1, 2],
        "phase": [PHASE["forward"], PHASE["forward"], PHASE["backward"]],
        "iteration": [0, 0, 1],
        "microbatch": [1, 1, 0],
        "first_event": [1, 2, 4],
        "flops": [1e6, float("nan"), 2.5],
        "bytes_moved": [float("nan"), 8.0, 16.0],
    }
    events = {"kind": [ALLOC, ALLOC, ALLOC, FREE, ALLOC, FREE], "buffer": [0, 1, 2, 2, 3, 1],
              "op": [-1, 0, 1, 1, 2, 2]}  # fmt: skip
    csr = {"op_inputs_ptr": [0, 1, 2, 4], "op_inputs": [0, 1, 0, 1],
           "op_outputs_ptr": [0, 1, 2, 3], "op_outputs": [1, 2, 3]}  # fmt: skip
    return Trace(
        buffers={k: np.asarray(v, BUFFER_COLUMNS[k]) for k, v in buffers.items()},
        events={k: np.asarray(v, EVENT_COLUMNS[k]) for k, v in events.items()},
        ops={k: np.asarray(v, OP_COLUMNS[k]) for k, v in ops.items()},
        csr={k: np.asarray(v, CSR_COLUMNS[k]) for k, v in csr.items()},
        op_names=["aten::mm", "aten::add_", "aten::empty"],
        modules=["", "model.layers.0.mlp", "model.lm_head"],
        devices=["cuda:0", "cuda:1"],
        meta={"model": "tiny", "nested": {"a": [1, 2.5, None]}},
    )


def assert_identical(a: Trace, b: Trace) -> None:
    for table in ("buffers", "events", "ops", "csr"):
        ta, tb = getattr(a, table), getattr(b, table)
        assert ta.keys() == tb.keys()
        for name in ta:
            assert ta[name].dtype == tb[name].dtype, (table, name)
            assert np.array_equal(ta[name], tb[name], equal_nan=ta[name].dtype.kind == "f"), (
                table,
                name,
            )
    assert a.op_names == b.op_names
    assert a.modules == b.modules
    assert a.devices == b.devices
    assert a.meta == b.meta


@st.composite
def random_traces(draw) -> Trace:
    """Random alloc/free orders over 0-25 buffers with random columns (no ops)."""
    n = draw(st.integers(0, 25))
    starts = draw(st.lists(st.floats(0, 100), min_size=n, max_size=n))
    lengths = draw(st.lists(st.one_of(st.none(), st.floats(0.5, 50)), min_size=n, max_size=n))
    points = [(s, ALLOC, b) for b, s in enumerate(starts)]
    points += [(starts[b] + d, FREE, b) for b, d in enumerate(lengths) if d is not None]
    points.sort(key=lambda p: (p[0], p[1]))
    first_alloc = {}
    for _, kind, b in points:
        if kind == ALLOC:
            first_alloc.setdefault(b, len(first_alloc))
    renumber = np.array([first_alloc[b] for b in range(n)], dtype=np.int64)
    sizes = draw(st.lists(st.integers(0, 5 * MiB), min_size=n, max_size=n))
    nbytes = np.zeros(n, np.int64)
    nbytes[renumber] = sizes
    trace = from_events(
        np.array([p[1] for p in points], np.int8),
        nbytes,
        renumber[[p[2] for p in points]] if points else np.zeros(0, np.int64),
        streams=draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
        categories=draw(st.lists(st.integers(0, len(CATEGORIES) - 1), min_size=n, max_size=n)),
        meta={"seed": draw(st.integers(0, 9))},
    )
    ints = st.lists(st.integers(0, 1), min_size=n, max_size=n)
    trace.buffers["device"] = np.asarray(draw(ints), np.int16)
    trace.buffers["module"] = np.asarray(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), np.int32)
    trace.buffers["phase"] = np.asarray(
        draw(st.lists(st.integers(0, len(PHASES) - 1), min_size=n, max_size=n)), np.int8
    )
    trace.buffers["iteration"] = np.asarray(draw(ints), np.int32)
    trace.modules = ["", "model.embed", "model.layers.1.attn"]
    trace.devices = ["cuda:0", "cuda:1"]
    return trace


# --- exact round trip -------------------------------------------------------------------


def test_round_trip_through_a_file_reproduces_a_trace_with_ops_exactly(tmp_path):
    trace = trace_with_ops()
    save_snapshot(trace, tmp_path / "step.pickle")
    assert_identical(load_snapshot(tmp_path / "step.pickle"), trace)


def test_round_trip_reproduces_an_empty_trace_exactly(tmp_path):
    save_snapshot(Trace(), tmp_path / "empty.pickle")
    assert_identical(load_snapshot(tmp_path / "empty.pickle"), Trace())


@settings(max_examples=40, deadline=None)
@given(random_traces())
def test_round_trip_reproduces_any_trace_exactly(trace):
    assert_identical(load_snapshot(pickle.loads(pickle.dumps(to_snapshot(trace)))), trace)


@settings(max_examples=40, deadline=None)
@given(random_traces())
def test_snapshot_without_the_memplan_key_reads_back_the_same_buffers(trace):
    snapshot = to_snapshot(trace)
    del snapshot["memplan"]
    back = load_snapshot(snapshot)
    for name in ("nbytes", "alloc_event", "free_event", "category", "device", "stream", "phase",
                 "iteration", "microbatch"):  # fmt: skip
        assert np.array_equal(back.buffers[name], trace.buffers[name]), name
    assert np.array_equal(back.events["kind"], trace.events["kind"])
    assert np.array_equal(back.events["buffer"], trace.events["buffer"])
    assert [back.module_of_buffer(b) for b in range(back.num_buffers)] == [
        trace.module_of_buffer(b) for b in range(trace.num_buffers)
    ]


# --- what the exported snapshot looks like ------------------------------------------------


def test_exported_events_are_allocs_and_free_pairs_timed_by_event_index():
    snapshot = to_snapshot(trace_with_ops())
    device0 = [(e["action"], e["size"], e["time_us"]) for e in snapshot["device_traces"][0]]
    assert device0 == [
        ("segment_alloc", 2 * MiB, 0),  # stream 0
        ("segment_alloc", 2 * MiB, 0),  # stream 3
        ("alloc", 4096, 0),
        ("alloc", 1000, 1),
        ("alloc", 0, 2),
        ("free_requested", 0, 3),
        ("free_completed", 0, 3),
        ("free_requested", 1000, 5),
        ("free_completed", 1000, 5),
    ]
    assert [e["action"] for e in snapshot["device_traces"][1]] == ["segment_alloc", "alloc"]


def test_exported_frames_name_the_op_module_category_and_phase():
    snapshot = to_snapshot(trace_with_ops())
    alloc = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"][1]
    assert alloc["frames"] == [
        {"filename": "model.layers.0.mlp", "line": 0, "name": "aten::empty"},
        {"filename": "memplan", "line": 1,
         "name": "buffer 1 activation forward iteration 0 microbatch 1"},
    ]  # fmt: skip
    assert alloc["category"] == "activation"


def test_exported_segments_hold_exactly_the_buffers_live_at_the_end():
    snapshot = to_snapshot(trace_with_ops())
    active = {
        (seg["device"], blk["requested_size"])
        for seg in snapshot["segments"]
        for blk in seg["blocks"]
        if blk["state"] == "active_allocated"
    }
    assert active == {(0, 4096), (1, 2048)}  # buffers 0 and 3 are never freed


def check_layout(snapshot: dict) -> None:
    """Independent check of the exported layout, as memory_viz's page relies on it.

    Replays each device trace: an alloc lands inside a segment and overlaps no live
    allocation, each free matches a live allocation, and what is live at the end is
    exactly the segments' active blocks; blocks tile each segment.
    """
    for device, entries in enumerate(snapshot["device_traces"]):
        segments = [s for s in snapshot["segments"] if s["device"] == device]
        live: dict[int, int] = {}
        for e in entries:
            if e["action"] == "segment_alloc":
                assert any(s["address"] == e["addr"] and s["total_size"] == e["size"] for s in segments)
            elif e["action"] == "alloc":
                end = e["addr"] + max(e["size"], 1)
                assert any(s["address"] <= e["addr"] and end <= s["address"] + s["total_size"]
                           for s in segments)  # fmt: skip
                assert all(end <= a or a + n <= e["addr"] for a, n in live.items())
                live[e["addr"]] = max(e["size"], 1)
            elif e["action"] == "free_completed":
                del live[e["addr"]]
        active = set()
        for s in segments:
            addr = s["address"]
            for blk in s["blocks"]:
                assert blk["address"] == addr
                addr += blk["size"]
                if blk["state"] == "active_allocated":
                    active.add(blk["address"])
            assert addr == s["address"] + s["total_size"]
        assert active == set(live)


@settings(max_examples=40, deadline=None)
@given(random_traces())
def test_exported_layout_never_overlaps_live_buffers_and_matches_the_final_segments(trace):
    check_layout(to_snapshot(trace))


def test_exported_pickle_uses_only_opcodes_memory_viz_can_read(tmp_path):
    save_snapshot(trace_with_ops(), tmp_path / "step.pickle")
    data = (tmp_path / "step.pickle").read_bytes()
    opcodes = {op.name for op, arg, _ in pickletools.genops(data)}
    assert opcodes <= MEMORY_VIZ_OPCODES, opcodes - MEMORY_VIZ_OPCODES
    protocol = next(arg for op, arg, _ in pickletools.genops(data) if op.name == "PROTO")
    assert 2 <= protocol <= 4


def test_pytorch_memory_viz_code_accepts_the_exported_snapshot():
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    snapshot = to_snapshot(trace_with_ops())
    # segsum asserts that every segment's blocks account for its whole size
    assert "segments: 3" in memory_viz.segsum(copy.deepcopy(snapshot))
    assert "Device 1" in memory_viz.trace(copy.deepcopy(snapshot))
    lines = memory_viz.memory(copy.deepcopy(snapshot), format_flamegraph=lambda text: text)
    active = [line for line in lines.splitlines() if ";active_allocated;" in line]
    assert sum(int(line.rsplit(" ", 1)[1]) for line in active) == 4096 + 2048
    assert "Active Memory Timeline" in memory_viz.trace_plot(copy.deepcopy(snapshot))


# --- import of a real-shaped snapshot -----------------------------------------------------


def test_fixture_imports_with_the_hand_computed_sizes_and_lifetimes():
    trace = load_snapshot(FIXTURE)
    # ids: 0 = 4 MiB block live before recording, 1 = 512 B block live before recording,
    # 2 = 512 B block freed in the trace but allocated before it, 3 = X 2 MiB, 4 = Y 1 MiB,
    # 5 = V 8 KiB on device 1, 6 = W 1 MiB on the side stream.
    assert trace.buffers["nbytes"].tolist() == [4 * MiB, 512, 512, 2 * MiB, MiB, 8192, MiB]
    assert trace.buffers["alloc_event"].tolist() == [0, 1, 2, 3, 4, 7, 8]
    assert trace.buffers["free_event"].tolist() == [-1, -1, 6, -1, 5, -1, 9]


def test_fixture_peak_is_the_hand_computed_one():
    # after event 8: 4 MiB + 512 + 2 MiB + 8 KiB + 1 MiB
    assert load_snapshot(FIXTURE).peak() == (7 * MiB + 512 + 8192, 8)


def test_fixture_merges_devices_by_time_and_names_them():
    trace = load_snapshot(FIXTURE)
    assert trace.devices == ["cuda:0", "cuda:1"]
    assert trace.buffers["device"].tolist() == [0, 0, 0, 0, 0, 1, 0]


def test_fixture_pointer_streams_are_renumbered_and_kept_in_meta():
    trace = load_snapshot(FIXTURE)
    assert trace.buffers["stream"].tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert trace.meta["snapshot_streams"] == {"1": SIDE_STREAM}


def test_fixture_modules_come_from_the_innermost_user_python_frame():
    trace = load_snapshot(FIXTURE)
    modules = [trace.module_of_buffer(b) for b in range(trace.num_buffers)]
    # X: torch's linear.py is skipped for the user's train.py; Y: only torch frames
    assert modules == ["", "", "", "train.py:42:forward", "functional.py:2140:softmax",
                       "train.py:42:forward", ""]  # fmt: skip


def test_fixture_categories_come_from_the_entries():
    names = load_snapshot(FIXTURE).category_names().tolist()
    assert names == ["other"] * 4 + ["activation"] + ["other"] * 2


def test_fixture_non_tensor_actions_are_counted_not_imported():
    meta = load_snapshot(FIXTURE).meta
    assert meta["ignored_actions"] == {"oom": 1, "segment_alloc": 1, "snapshot": 1}
    assert meta["unrecorded_allocations"] == 3
    assert meta["allocator_settings"] == {"expandable_segments": False, "max_split_size": -1}


def test_fixture_file_is_what_its_script_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fixture", DATA / "make_snapshot_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert pickle.loads(FIXTURE.read_bytes()) == module.snapshot()


def test_blocks_allocated_before_recording_are_live_from_start_to_end():
    snapshot = {
        "segments": [
            {"device": 0, "address": 1 << 40, "total_size": 2 * MiB, "stream": 0, "blocks": [
                {"size": 1024, "requested_size": 1000, "state": "active_allocated"},
                {"size": 512, "state": "inactive"},
                {"size": 2 * MiB - 1536, "requested_size": 7, "state": "active_allocated"},
            ]},
        ],
        "device_traces": [[
            {"action": "alloc", "addr": (1 << 40) + 1024, "size": 512, "stream": 0},
            {"action": "free_completed", "addr": (1 << 40) + 1024, "size": 512, "stream": 0},
        ]],
    }  # fmt: skip
    trace = load_snapshot(snapshot)
    assert trace.buffers["nbytes"].tolist() == [1024, 2 * MiB - 1536, 512]
    assert trace.buffers["alloc_event"].tolist() == [0, 1, 2]
    assert trace.buffers["free_event"].tolist() == [-1, -1, 3]


def test_address_reused_after_an_uncompleted_free_request_closes_at_the_request():
    entries = [
        {"action": "alloc", "addr": 4096, "size": 512, "time_us": 1},
        {"action": "free_requested", "addr": 4096, "size": 512, "time_us": 2},
        {"action": "alloc", "addr": 4096, "size": 1024, "time_us": 3},
    ]
    trace = load_snapshot({"segments": [], "device_traces": [entries]})
    assert trace.buffers["alloc_event"].tolist() == [0, 2]
    assert trace.buffers["free_event"].tolist() == [1, -1]


def test_address_reused_without_any_free_is_freed_implicitly_and_counted():
    entries = [
        {"action": "alloc", "addr": 4096, "size": 512, "time_us": 1},
        {"action": "alloc", "addr": 4096, "size": 1024, "time_us": 3},
    ]
    trace = load_snapshot({"segments": [], "device_traces": [entries]})
    assert trace.buffers["free_event"].tolist() == [1, -1]
    assert trace.meta["implicit_frees"] == 1


def test_snapshot_with_no_history_imports_its_live_blocks():
    snapshot = {"segments": [{"address": 4096, "total_size": 2 * MiB, "stream": 0, "blocks": [
        {"size": 2 * MiB, "requested_size": 5, "state": "active_allocated"}]}]}  # fmt: skip
    trace = load_snapshot(snapshot)
    assert trace.buffers["nbytes"].tolist() == [2 * MiB]
    assert trace.peak() == (2 * MiB, 0)


@pytest.fixture(scope="module")
def profiler_snapshot() -> dict:
    """A snapshot written by PyTorch's own code (`profile_plot`'s converter) from a real CPU step."""
    torch = pytest.importorskip("torch")
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(32, 64)
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for _ in range(2):
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return memory_viz._profile_to_snapshot(prof)


def test_pytorch_written_snapshot_ends_with_the_bytes_its_segments_hold(profiler_snapshot):
    trace = load_snapshot(copy.deepcopy(profiler_snapshot))
    active = sum(
        blk["size"]
        for seg in profiler_snapshot["segments"]
        for blk in seg["blocks"]
        if blk["state"] == "active_allocated"
    )
    assert int(trace.buffers["nbytes"][trace.buffers["free_event"] < 0].sum()) == active
    # the step's parameters, batch... were allocated before profiling began
    assert trace.meta["unrecorded_allocations"] > 0


def test_pytorch_written_snapshot_keeps_categories_and_the_user_frame(profiler_snapshot):
    trace = load_snapshot(copy.deepcopy(profiler_snapshot))
    categories = set(trace.category_names().tolist())
    assert {"parameter", "gradient", "optimizer_state", "activation"} <= categories
    assert any(m.startswith("test_snapshot.py:") for m in trace.modules)


# --- bad input --------------------------------------------------------------------------


def one_line_user_error(path_or_obj) -> str:
    with pytest.raises(UserError) as info:
        load_snapshot(path_or_obj)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file_is_a_user_error(tmp_path):
    assert "does not exist" in one_line_user_error(tmp_path / "nope.pickle")


def test_garbage_bytes_are_a_user_error(tmp_path):
    (tmp_path / "x.pickle").write_bytes(b"this is not a pickle at all\n\x00\x01")
    assert "not a valid pickle" in one_line_user_error(tmp_path / "x.pickle")


def test_truncated_pickle_is_a_user_error(tmp_path):
    data = FIXTURE.read_bytes()
    (tmp_path / "x.pickle").write_bytes(data[: len(data) // 2])
    assert "not a valid pickle" in one_line_user_error(tmp_path / "x.pickle")


def test_pickle_of_something_else_is_not_a_snapshot(tmp_path):
    (tmp_path / "x.pickle").write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    assert "not a PyTorch memory snapshot" in one_line_user_error(tmp_path / "x.pickle")


def test_trace_entry_without_an_address_is_a_user_error():
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]}
    assert "entry 0 (alloc) has no integer 'addr'" in one_line_user_error(snapshot)


def test_memplan_key_of_another_version_is_a_user_error():
    snapshot = to_snapshot(trace_with_ops())
    snapshot["memplan"]["version"] = 999
    assert "version 999" in one_line_user_error(snapshot)


class RunsAShellCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps({"segments": [RunsAShellCommand(marker)]}))
    assert "system" in one_line_user_error(tmp_path / "evil.pickle")
    assert not marker.exists()


def test_saving_into_a_missing_directory_is_a_user_error(tmp_path):
    with pytest.raises(UserError):
        save_snapshot(trace_with_ops(), tmp_path / "missing" / "x.pickle")
