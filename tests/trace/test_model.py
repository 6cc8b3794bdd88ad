"""The trace data model: live bytes, peak, breakdown, lifetimes, on-disk format."""

import json

import numpy as np
import pytest

from memplan.errors import UserError
from memplan.trace import (
    ALLOC,
    CATEGORY,
    FREE,
    TraceError,
    from_events,
    load,
    save,
    save_json,
    validate,
)
from memplan.trace.model import Trace


def three_buffers() -> Trace:
    # b0 (100 B) [0, 2), b1 (200 B) [1, 5), b2 (50 B) [3, 4); peak 300 after event 1
    return from_events(
        [ALLOC, ALLOC, FREE, ALLOC, FREE, FREE],
        [100, 200, 50],
        [0, 1, 0, 2, 2, 1],
        categories=[CATEGORY["parameter"], CATEGORY["activation"], CATEGORY["temporary"]],
    )


def test_live_bytes_after_each_event():
    assert three_buffers().live_bytes().tolist() == [100, 300, 200, 250, 200, 0]


def test_peak_is_first_maximum_and_its_event():
    assert three_buffers().peak() == (300, 1)


def test_breakdown_at_the_peak_counts_live_buffers_by_category():
    bd = three_buffers().breakdown_at(1)
    assert bd["parameter"] == 100 and bd["activation"] == 200 and bd["temporary"] == 0


def test_buffer_live_at_end_counts_until_the_end():
    t = from_events([ALLOC, ALLOC, FREE], [10, 20], [0, 1, 1])
    assert t.buffers["free_event"].tolist() == [-1, 2]
    assert t.free_event_or_end().tolist() == [3, 2]
    assert t.live_bytes().tolist() == [10, 30, 10]


def test_lifetimes_are_half_open_event_intervals():
    lower, upper, nbytes = three_buffers().lifetimes()
    assert lower.tolist() == [0, 1, 3] and upper.tolist() == [2, 5, 4] and nbytes.tolist() == [100, 200, 50]


def test_summary_has_the_show_json_keys():
    s = three_buffers().summary()
    for key in ("peak_bytes", "peak_event", "peak_phase", "breakdown", "num_buffers", "num_ops"):
        assert key in s
    assert s["largest_buffers"][0]["nbytes"] == 200


def test_empty_trace_is_valid_with_zero_peak():
    t = validate(Trace())
    assert t.peak() == (0, -1)


def test_validate_names_a_buffer_allocated_twice():
    t = from_events([ALLOC, FREE], [10, 10], [0, 0])
    t.events["buffer"] = np.array([0, 0])
    t.events["kind"] = np.array([ALLOC, ALLOC], np.int8)
    with pytest.raises(TraceError, match="buffer 0: allocated 2 times"):
        validate(t)


def test_validate_names_a_buffer_freed_before_its_allocation():
    t = three_buffers()
    t.buffers["free_event"] = t.buffers["free_event"].copy()
    t.buffers["free_event"][2] = 1
    with pytest.raises(TraceError, match="buffer 2"):
        validate(t)


def test_validate_names_an_event_of_a_missing_buffer():
    t = three_buffers()
    t.events["buffer"] = t.events["buffer"].copy()
    t.events["buffer"][4] = 7
    with pytest.raises(TraceError, match="event 4: buffer 7 does not exist"):
        validate(t)


def test_validate_names_a_bad_category_code():
    t = three_buffers()
    t.buffers["category"] = t.buffers["category"].copy()
    t.buffers["category"][1] = 42
    with pytest.raises(TraceError, match="buffer 1: category code 42"):
        validate(t)


def test_validate_names_an_op_reading_a_missing_buffer():
    t = three_buffers()
    t.ops = {k: np.zeros(1, v.dtype) for k, v in t.ops.items()}
    t.op_names = ["aten.mm.default"]
    t.csr = {
        "op_inputs_ptr": np.array([0, 1]),
        "op_inputs": np.array([9]),
        "op_outputs_ptr": np.array([0, 0]),
        "op_outputs": np.zeros(0, np.int64),
    }
    with pytest.raises(TraceError, match="op 0: input buffer 9 does not exist"):
        validate(t)


def test_memtrace_round_trip_keeps_every_column(tmp_path):
    t = three_buffers()
    t.meta = {"model": "toy", "setup": {"batch": 2}}
    save(t, tmp_path / "t.memtrace")
    back = load(tmp_path / "t.memtrace")
    for table in ("buffers", "events", "ops", "csr"):
        for name, col in getattr(t, table).items():
            assert np.array_equal(getattr(back, table)[name], col), (table, name)
            assert getattr(back, table)[name].dtype == col.dtype
    assert back.meta == t.meta and back.modules == t.modules and back.devices == t.devices


def test_load_rejects_a_file_that_is_not_a_trace(tmp_path):
    bad = tmp_path / "bad.memtrace"
    bad.write_text("hello")
    with pytest.raises(UserError, match="cannot read trace"):
        load(bad)


def test_load_rejects_another_format_version(tmp_path):
    path = tmp_path / "t.memtrace"
    save(three_buffers(), path)
    with np.load(path) as archive:
        arrays = dict(archive)
    header = json.loads(arrays["header"].tobytes())
    header["version"] = 99
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    with pytest.raises(UserError, match="version 99"):
        load(path)


def test_load_rejects_an_inconsistent_trace_naming_the_record(tmp_path):
    path = tmp_path / "t.memtrace"
    save(three_buffers(), path)
    with np.load(path) as archive:
        arrays = dict(archive)
    arrays["buffers/nbytes"] = np.array([100, -5, 50])
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    with pytest.raises(UserError, match="buffer 1: negative size"):
        load(path)


def test_failed_save_leaves_no_file(tmp_path):
    t = three_buffers()
    t.buffers["nbytes"] = np.array([1, -1, 1])
    with pytest.raises(TraceError):
        save(t, tmp_path / "t.memtrace")
    assert list(tmp_path.iterdir()) == []


def test_json_export_lists_buffers_ops_and_events(tmp_path):
    save_json(three_buffers(), tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["format"] == "memplan-trace" and len(doc["buffers"]) == 3 and len(doc["events"]) == 6
    assert doc["buffers"][1]["category"] == "activation"


def test_a_million_buffers_save_load_and_scan(tmp_path):
    n = 1_000_000
    rng = np.random.default_rng(0)
    # each buffer allocated then freed a few events later: a realistic interleaving
    kinds = np.empty(2 * n, np.int8)
    kinds[0::2] = ALLOC
    kinds[1::2] = FREE
    buffers = np.repeat(np.arange(n), 2)
    t = from_events(kinds, rng.integers(512, 1 << 20, n), buffers)
    save(t, tmp_path / "big.memtrace")
    back = load(tmp_path / "big.memtrace")
    peak, _ = back.peak()
    back.breakdown_at(int(np.argmax(back.live_bytes())))
    assert peak == int(back.buffers["nbytes"].max())


def test_host_memory_buffers_are_left_out_of_the_device_and_counted_apart():
    from memplan.trace.edit import device_view, without_host

    trace = three_buffers()
    trace.devices = ["cuda:0", "host:pinned"]
    trace.buffers["device"] = np.array([0, 1, 0], np.int16)  # the 200-B activation lives on the host
    assert trace.host_mask().tolist() == [False, True, False] and trace.host_mask("pageable").sum() == 0
    assert trace.main_device() == 0
    assert without_host(trace).peak()[0] == 100
    assert device_view(trace).peak()[0] == 100  # one accelerator: the host is another device
    assert trace.live_bytes(trace.host_mask()).max() == 200
    cpu_job = three_buffers()
    cpu_job.devices = ["cpu", "host:pageable"]
    cpu_job.buffers["device"] = np.array([0, 1, 0], np.int16)
    assert device_view(cpu_job).peak()[0] == 100  # a cpu job's host memory kept apart is left out too
