import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from memplan import models
from memplan.capture.step import build_training_step
from memplan.offload.runtime import FileStore, OffloadError, RunOptions, run
from memplan.offload.runtime import engine as engine_module


def tiny_step():
    return build_training_step(models.tiny_config("gpt2"), models.TrainingSetup(precision="32-true", batch=2, seq=32), device="cpu")


def train(step, steps, **offload):
    if offload:
        with run(step.model, step.optimizer, options=RunOptions(**offload)) as engine:
            for _ in range(steps):
                step.run()
        return engine
    for _ in range(steps):
        step.run()
    return None


def test_parameters_are_bit_identical_to_no_offload_after_3_steps(tmp_path):
    ref = tiny_step()  # each build seeds the RNG: build and train one after the other
    train(ref, 3)
    off = tiny_step()
    engine = train(off, 3, directory=tmp_path, min_nbytes=1024, checksum=True)
    assert engine.bytes_written > 0 and engine.bytes_read > 0
    for (name, a), (_, b) in zip(ref.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), name
    for pa, pb in zip(ref.optimizer.state.values(), off.optimizer.state.values()):
        assert torch.equal(pa["exp_avg"], pb["exp_avg"]) and torch.equal(pa["exp_avg_sq"], pb["exp_avg_sq"])


def test_files_are_removed_on_exit(tmp_path):
    train(tiny_step(), 1, directory=tmp_path, min_nbytes=1024)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_process_leaves_files_cleaned_at_the_next_start(tmp_path):
    code = (
        "import os, sys; from memplan.offload.runtime import FileStore;"
        f"s = FileStore({str(tmp_path)!r}); (s.path / 'x.bin').write_bytes(b'1' * 4096); os._exit(9)"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith("memplan-offload-")
    store = FileStore(tmp_path)
    assert [os.path.basename(p) for p in store.stale_removed] == left
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_full_disk_degrades_to_host_memory(tmp_path, monkeypatch):
    def full(op, key):
        if op == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    ref = tiny_step()
    train(ref, 2)
    off = tiny_step()
    monkeypatch.setattr(engine_module, "_fault_hook", full)
    engine = train(off, 2, directory=tmp_path, min_nbytes=1024)
    assert engine.degraded and "No space left" in engine.degraded[0]
    for a, b in zip(ref.model.parameters(), off.model.parameters()):
        assert torch.equal(a, b)


def test_injected_io_error_without_fallback_is_a_clear_error(tmp_path, monkeypatch):
    def broken(op, key):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(engine_module, "_fault_hook", broken)
    with pytest.raises(OffloadError, match="Input/output error"):
        train(tiny_step(), 2, directory=tmp_path, min_nbytes=1024, host_fallback=False)
    assert list(tmp_path.iterdir()) == []


def test_a_corrupted_file_is_detected(tmp_path, monkeypatch):
    def corrupt(op, key):
        if op == "read" and key.startswith("state."):
            for f in (tmp_path).glob("memplan-offload-*/*.bin"):
                with open(f, "r+b") as fh:
                    fh.write(b"\xff\x00\xff\x00")

    monkeypatch.setattr(engine_module, "_fault_hook", corrupt)
    with pytest.raises(OffloadError, match="corrupted"):
        train(tiny_step(), 3, directory=tmp_path, min_nbytes=1024, checksum=True)



WORKER = """
import json, os, resource, signal, sys
import torch
from memplan import models
from memplan.capture.step import build_training_step
from memplan.offload.runtime import OffloadError, RunOptions, run

directory, limit = sys.argv[1], int(sys.argv[2])
def step():
    return build_training_step(models.tiny_config("gpt2"), models.TrainingSetup(batch=2, seq=32), device="cpu")
ref = step()
for _ in range(2):
    ref.run()
if limit:
    # past RLIMIT_FSIZE a write fails with EFBIG instead of killing the process with SIGXFSZ
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
results = {}
for fallback in (True, False):
    off = step()
    out = {"error": None}
    try:
        with run(off.model, off.optimizer, options=RunOptions(directory=directory, min_nbytes=1024, host_fallback=fallback)) as engine:
            for _ in range(2):
                off.run()
        out["degraded"] = engine.degraded
        out["written"] = engine.bytes_written
    except OffloadError as exc:
        out["error"] = str(exc)
    out["equal"] = all(torch.equal(a, b) for a, b in zip(ref.model.parameters(), off.model.parameters()))
    out["left"] = os.listdir(directory)
    results["fallback" if fallback else "no_fallback"] = out
print(json.dumps(results))
"""


def run_worker(directory, limit_bytes=0):
    """Train 2 steps with and without host fallback in a fresh process; their outcomes by name."""
    proc = subprocess.run([sys.executable, "-c", WORKER, str(directory), str(limit_bytes)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_file_size_limit_degrades_to_host_memory_or_fails_clearly(tmp_path):
    # RLIMIT_FSIZE needs no privileges: files past 64 KiB cannot grow (EFBIG), smaller ones still land
    out = run_worker(tmp_path, limit_bytes=64 * 1024)
    fb, strict = out["fallback"], out["no_fallback"]
    assert fb["error"] is None and fb["equal"] and fb["left"] == []
    assert fb["degraded"] and all("File too large" in d for d in fb["degraded"])
    assert fb["written"] > 0  # tensors under the limit still went to the files
    assert strict["error"] and "File too large" in strict["error"] and strict["left"] == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB file system (tmpfs): needs root with CAP_SYS_ADMIN, as in CI and here."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_file_system_degrades_to_host_memory_or_fails_clearly(small_tmpfs):
    # the tiny model's states and activations are several MiB: the 1 MiB tmpfs fills up (ENOSPC)
    out = run_worker(small_tmpfs)
    fb, strict = out["fallback"], out["no_fallback"]
    assert fb["error"] is None and fb["equal"] and fb["left"] == []
    assert fb["degraded"] and any("No space left" in d for d in fb["degraded"])
    assert strict["error"] and "No space left" in strict["error"] and strict["left"] == []


def mid_step():
    # 4 layers of width 256: ~3.3M parameters, so parameters, gradients and AdamW states dominate
    config = models.tiny_config("gpt2", n_embd=256, n_layer=4, n_head=4)
    return build_training_step(config, models.TrainingSetup(precision="32-true", batch=1, seq=32), device="cpu")


def two_steps_each(tmp_path, **mode):
    """Two steps of mid_step() without and with offloading (`mode`); the second step of
    each is profiled: (reference, its peak, offloaded, its peak, the engine)."""
    from memplan.offload.measure import step_peak_bytes

    ref = mid_step()
    ref.run()
    ref_peak = step_peak_bytes(ref)
    ref.run()
    off = mid_step()
    with run(off.model, off.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=64 << 10, chunk_nbytes=1 << 20,
             checksum=True, **mode)) as engine:
        off.run()
        off_peak = step_peak_bytes(off)
        off.run()
    return ref, ref_peak, off, off_peak, engine


def test_streamed_step_halves_the_measured_peak_and_keeps_parameters_bit_identical(tmp_path):
    ref, ref_peak, off, off_peak, engine = two_steps_each(tmp_path, streamed_step=True)
    assert engine.bytes_written > 0 and not engine.degraded
    assert off_peak <= ref_peak // 2, (off_peak, ref_peak)
    for (name, a), (_, b) in zip(ref.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), name
    for x, y in zip(ref.optimizer.state.values(), off.optimizer.state.values()):
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
    assert list(tmp_path.iterdir()) == []


def test_step_in_backward_halves_the_measured_peak_and_keeps_parameters_bit_identical(tmp_path):
    ref, ref_peak, off, off_peak, engine = two_steps_each(tmp_path, step_in_backward=True)
    assert engine.bytes_written > 0 and not engine.degraded
    assert not any(key.startswith("grad.") for key in engine.table)  # gradients never leave
    assert off_peak <= ref_peak // 2, (off_peak, ref_peak)
    for (name, a), (_, b) in zip(ref.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), name
        x, y = ref.optimizer.state[a], off.optimizer.state[b]  # states are created in backward's order
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"]), name
    assert list(tmp_path.iterdir()) == []


def test_step_in_backward_refuses_gradient_accumulation(tmp_path):
    from memplan.models import forward_loss

    step = mid_step()
    with pytest.raises(OffloadError, match="one backward per optimizer step"):
        with run(step.model, step.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=64 << 10, step_in_backward=True)):
            for _ in range(2):
                forward_loss(step.model, step.batches[0]).backward()


def test_paused_engine_leaves_another_models_saved_tensors_alone(tmp_path):
    ref, off = tiny_step(), tiny_step()
    with run(off.model, off.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=1024, optimizer_states=False)) as engine:
        with engine.paused():
            ref.run()
        assert engine.bytes_written == 0
        off.run()
        assert engine.bytes_written > 0


def test_a_tensor_larger_than_the_bounce_buffer_round_trips_through_o_direct(tmp_path):
    from memplan.offload.runtime.store import bytes_of

    store = FileStore(tmp_path, bounce_nbytes=8192)
    t = torch.arange(5000, dtype=torch.float32)  # 20000 B: three pieces, the last one partial
    path = store.write("x", bytes_of(t))
    out = torch.empty_like(t)
    store.read(path, bytes_of(out))
    assert torch.equal(t, out)
    store.close()


def test_step_in_backward_keeps_the_states_of_the_largest_parameters_within_resident_nbytes(tmp_path):
    ref = mid_step()  # each build seeds the RNG: build and train one after the other
    for _ in range(2):
        ref.run()
    off = mid_step()
    # the largest weights are the 1 MiB MLP ones; of those, h.3's c_proj comes first in backward's order
    with run(off.model, off.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=1024, step_in_backward=True,
             resident_nbytes=2 << 20)) as engine:  # room for exactly one of them (two moments)
        for _ in range(2):
            off.run()
        written = set(engine.table)
    assert "state.transformer.h.3.mlp.c_proj.weight.exp_avg" not in written
    assert "state.transformer.h.3.mlp.c_fc.weight.exp_avg" in written  # same size, later in backward
    assert "state.transformer.ln_f.weight.exp_avg" in written  # small ones leave too: the room is full
    for (name, a), (_, b) in zip(ref.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), name
        x, y = ref.optimizer.state[a], off.optimizer.state[b]  # states are created in backward's order
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"]), name
    assert list(tmp_path.iterdir()) == []


def _held_state_nbytes(step) -> int:
    return sum(t.untyped_storage().nbytes() for s in step.optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= 1024)


def test_forward_prefetch_nbytes_bounds_the_states_read_during_the_forward(tmp_path):
    step = mid_step()
    states_nbytes = 2 * sum(p.numel() * p.element_size() for p in step.model.parameters()
                            if p.numel() * p.element_size() >= 1024)
    held = {}
    for ahead in (0, 1 << 20, 1 << 30):
        step = mid_step()
        with run(step.model, step.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=1024, step_in_backward=True,
                 chunk_nbytes=256 << 10, forward_prefetch_nbytes=ahead)):
            step.run()
            step.run()
            held[ahead] = _held_state_nbytes(step)  # right after the step: what the forward will hold
    assert held[0] == 0
    assert 1 << 20 <= held[1 << 20] < (1 << 20) + (2 << 20) + 4 * 4096 * 2  # one more parameter's states at most
    assert held[1 << 30] >= states_nbytes  # all of them (each refill is 2 pages larger)


def test_a_page_aligned_tensor_moves_through_o_direct_without_the_bounce_buffer(tmp_path):
    from memplan.offload.runtime.store import bytes_of, refill_page_aligned

    t = torch.arange(3 * 4096, dtype=torch.float32)
    expected = t.clone()
    t.untyped_storage().resize_(0)
    refill_page_aligned(t, expected.numel() * 4)
    assert t.data_ptr() % 4096 == 0 and t.shape == expected.shape
    t.copy_(expected)
    store = FileStore(tmp_path)
    path = store.write("aligned", bytes_of(t))
    t.zero_()
    store.read(path, bytes_of(t))
    assert torch.equal(t, expected)
    assert getattr(store._local, "bounce", None) is None or store.direct_refused
    store.close()


def act_step():
    # activations dominate: 2 layers of width 128, batch 8 x seq 128
    config = models.tiny_config("gpt2", n_embd=128, n_layer=2, n_head=4)
    return build_training_step(config, models.TrainingSetup(precision="32-true", batch=8, seq=128), device="cpu")


def saved_storages(step, min_nbytes):
    """(saved tensors, distinct storages, their bytes) that one plain forward saves for backward,
    parameters' and buffers' storages left out: an independent count with a recording hook."""
    from memplan.models import forward_loss

    kept = {t.untyped_storage().data_ptr() for t in (*step.model.parameters(), *step.model.buffers())}
    seen: dict[int, int] = {}
    count = 0

    def pack(t):
        nonlocal count
        s = t.untyped_storage()
        if s.nbytes() >= min_nbytes and s.data_ptr() not in kept:
            count += 1
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward_loss(step.model, step.batches[0])
    del loss
    return count, len(seen), sum(seen.values())


def test_activation_offload_writes_each_saved_storage_once(tmp_path):
    from memplan.models import forward_loss

    saved, distinct, nbytes = saved_storages(act_step(), 64 << 10)
    assert saved > distinct  # views of one storage saved by several ops: the case under test
    step = act_step()
    with run(step.model, step.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=64 << 10, optimizer_states=False)) as engine:
        loss = forward_loss(step.model, step.batches[0])
        for key in list(engine.pending):
            engine.wait(key)
        written = engine.bytes_written
        loss.backward()
        read = engine.bytes_read
    assert written == nbytes and read == nbytes


def test_activation_offload_moves_activations_that_require_grad_and_cuts_the_measured_peak(tmp_path):
    from memplan.offload.measure import step_peak_bytes

    ref = act_step()
    ref.run()
    ref_peak = step_peak_bytes(ref)
    _, _, act_nbytes = saved_storages(act_step(), 64 << 10)
    off = act_step()
    with run(off.model, off.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=64 << 10, optimizer_states=False,
             chunk_nbytes=1 << 20)):
        off.run()
        off_peak = step_peak_bytes(off)
    assert act_nbytes > ref_peak // 2  # the step is activation-bound
    assert off_peak < ref_peak - act_nbytes // 2, (ref_peak, off_peak, act_nbytes)
    for a, b in zip(ref.model.parameters(), off.model.parameters()):
        assert torch.equal(a, b)


def test_backward_reads_activations_ahead_in_reverse_pack_order(tmp_path):
    from memplan.models import forward_loss

    step = act_step()
    events = []
    with run(step.model, step.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=64 << 10, optimizer_states=False,
             chunk_nbytes=1 << 20)) as engine:
        submit, remove = engine.prefetch_into, engine.store.remove
        engine.prefetch_into = lambda key, out: (events.append(("read", key)), submit(key, out))[1]
        engine.store.remove = lambda path: (events.append(("done", path)), remove(path))[1]
        forward_loss(step.model, step.batches[0]).backward()
    reads = [int(key.split(".")[1]) for kind, key in events if kind == "read"]
    assert reads == sorted(reads, reverse=True)  # backward's order: last packed, first read
    first_done = next(i for i, (kind, _) in enumerate(events) if kind == "done")
    assert first_done >= 2  # more than the storage being unpacked was already on its way


def test_unpacking_an_offloaded_activation_twice_is_a_clear_error(tmp_path):
    from memplan.models import forward_loss

    step = act_step()
    with pytest.raises(OffloadError, match="retain_graph"):
        with run(step.model, step.optimizer, options=RunOptions(directory=tmp_path, min_nbytes=64 << 10, optimizer_states=False)):
            loss = forward_loss(step.model, step.batches[0])
            loss.backward(retain_graph=True)
            loss.backward()


def test_the_cuda_path_is_imported_only_when_a_cuda_tensor_moves(tmp_path):
    code = (
        "import sys; from memplan.offload.runtime import RunOptions, run; from memplan import models;"
        "from memplan.capture.step import build_training_step;"
        "s = build_training_step(models.tiny_config('gpt2'), models.TrainingSetup(batch=2, seq=32), device='cpu');"
        f"ctx = run(s.model, s.optimizer, options=RunOptions(directory={str(tmp_path)!r}, min_nbytes=1024));"
        "e = ctx.__enter__(); s.run(); ctx.__exit__(None, None, None);"
        "assert e.bytes_written > 0; print('memplan.offload.runtime.cuda_io' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
