"""The device world of a program run: which tensors are fake, which are device memory."""

import json
import struct

import torch
from torch._subclasses.fake_tensor import is_fake

from memplan.program import fakes
from memplan.program.patches import Patches
from memplan.program.world import DeviceRedirect, World


def test_parameters_and_buffers_a_module_registers_are_fake():
    world = World("cpu", None)
    hooks = fakes.module_hooks(world)
    try:
        norm = torch.nn.BatchNorm1d(4)
    finally:
        for h in hooks:
            h.remove()
    assert is_fake(norm.weight) and isinstance(norm.weight, torch.nn.Parameter) and norm.weight.requires_grad
    assert is_fake(norm.running_mean) and norm.running_mean.shape == (4,)


def test_a_batch_moved_to_cuda_stays_real_and_is_device_memory():
    world = World("cuda", None)
    batch = torch.arange(6).view(2, 3)
    with DeviceRedirect(world):
        moved = batch.to("cuda")
        count = int((moved > 2).sum())
    assert not is_fake(moved) and moved is not batch and world.on_device(moved)
    assert not world.on_device(batch) and count == 3  # values are the program's own


def test_a_factory_for_cuda_makes_a_fake_device_tensor():
    world = World("cuda", None)
    with DeviceRedirect(world):
        big = torch.zeros(1 << 20, 1 << 10, device="cuda")
    assert is_fake(big) and world.on_device(big) and big.nbytes == 4 << 30


def test_a_model_built_on_the_host_is_device_memory_once_moved():
    world = World("cuda", None)
    hooks, patches = fakes.module_hooks(world), Patches()
    fakes.swappable_fakes(patches)
    try:
        with DeviceRedirect(world):
            model = torch.nn.Linear(4, 4)
            on_host = world.on_device(model.weight)
            model.to("cuda")
    finally:
        patches.restore()
        for h in hooks:
            h.remove()
    assert not on_host and world.on_device(model.weight) and is_fake(model.weight)


def test_safetensors_weights_are_fake_tensors_read_from_the_header(tmp_path):
    header = {"w": {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, 30]}, "__metadata__": {"format": "pt"}}
    body = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 30)
    world = World("cpu", None)
    opened = fakes.FakeSafeOpen(world, path)
    w = opened.get_slice("w")[...]
    assert opened.keys() == ["w"] and is_fake(w) and w.shape == (3, 5) and w.dtype == torch.bfloat16


def test_vmap_over_a_device_tensor_gives_device_tensors():
    world = World("cuda", None)
    with DeviceRedirect(world):
        positions = torch.arange(4, device="cuda")
        # flex attention's create_block_mask calls its mask function so, under vmap
        mask = torch.vmap(lambda p: p.new_ones((), dtype=torch.bool) & (p >= 1))(positions)
    assert mask.tolist() == [False, True, True, True] and world.on_device(mask)


def test_torchdynamo_traces_a_function_under_the_cuda_facade():
    from memplan.hardware.devices import device_profile
    from memplan.program import cuda_api

    patches = Patches()
    cuda_api.install(World("cuda", None), patches, device_profile("h100-80gb"), device_count=1, local_rank=0)
    try:
        torch._dynamo.reset()
        # TorchDynamo keys its handlers by function: torch.accelerator's must not be torch.cuda's
        twice = torch.compile(lambda x: torch.mul(x, 2), backend="eager", fullgraph=True)
        assert twice(torch.ones(2)).tolist() == [2.0, 2.0]
    finally:
        patches.restore()
        torch._dynamo.reset()


def test_a_device_buffer_is_traced_on_the_stream_the_program_allocates_it_on():
    from memplan.hardware.devices import device_profile
    from memplan.program import cuda_api
    from memplan.program.recording import ProgramRecorder

    world, patches = World("cuda", None), Patches()
    cuda_api.install(world, patches, device_profile("h100-80gb"), device_count=1, local_rank=0)
    try:
        side = torch.cuda.Stream(priority=-1)  # as FSDP2 makes its all-gather and reduce-scatter streams
        with DeviceRedirect(world), ProgramRecorder(world) as recorder:
            on_default = torch.empty(1024, device="cuda")
            with torch.cuda.stream(side):
                on_side = torch.empty(2048, device="cuda")
                current = torch.cuda.current_stream()
            with side:
                also_on_side = torch.empty(4096, device="cuda")
            after = torch.empty(8192, device="cuda")
            # FSDP2's mesh is on the cpu in a cuda run: its device handle is torch.cpu
            cpu_side = torch.cpu.Stream()
            with torch.cpu.stream(cpu_side):
                gathered = torch.empty(16384, device="cuda")
        trace = recorder.finish()
    finally:
        patches.restore()
    assert current is side
    streams = dict(zip(trace.buffers["nbytes"].tolist(), trace.buffers["stream"].tolist()))
    assert streams == {4096: 0, 8192: side.number, 16384: side.number, 32768: 0, 65536: cpu_side.number}
    assert 0 < side.number < cpu_side.number
    del on_default, on_side, also_on_side, after, gathered


def test_the_cuda_facade_answers_that_nccl_is_there_as_a_cuda_build_would():
    from memplan.hardware.devices import device_profile
    from memplan.program import cuda_api

    patches = Patches()
    cuda_api.install(World("cuda", None), patches, device_profile("a100-80gb"), device_count=1, local_rank=0)
    try:  # torchtune's bf16 check (verify_bf16_support) asks both
        assert torch.distributed.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    finally:
        patches.restore()
    assert not torch.distributed.is_nccl_available()  # the CPU build's own answer is back


def test_a_pack_hook_that_offloads_to_pinned_memory_makes_host_memory_inside_the_ops_handler():
    from memplan.models import tracing
    from memplan.program.world import redirect_in_saved_tensor_hooks

    world, patches, offloaded = World("cuda", None), Patches(), []
    redirect = DeviceRedirect(world)
    redirect_in_saved_tensor_hooks(redirect, patches)

    def pack(t):  # as torchtune's OffloadActivations packs a saved activation
        host = torch.empty_like(t, pin_memory=True, device="cpu")
        host.copy_(t, non_blocking=True)
        offloaded.append(host)
        return host

    try:
        with redirect:
            x = torch.ones(3, device="cuda", requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda host: host.to("cuda")):
                (x * x).sum().backward()
    finally:
        patches.restore()
    host = offloaded[0]
    assert is_fake(host) and not world.on_device(host)
    assert tracing.host_kind(host.untyped_storage()) == "pinned" and is_fake(x.grad) and world.on_device(x.grad)


def test_a_copy_to_cuda_by_keyword_is_a_new_device_tensor():
    # GradScaler's per-device copy of found_inf: master.to(device=d, non_blocking=True, copy=True)
    world = World("cuda", None)
    with DeviceRedirect(world):
        master = torch.full((1,), 0.0, device="cuda")
        replica = master.to(device="cuda", non_blocking=True, copy=True)
        half = master.to("cuda", torch.float16, False, True)
    assert replica is not master and world.on_device(replica) and replica.dtype == torch.float32
    assert half is not master and world.on_device(half) and half.dtype == torch.float16


def test_a_real_tensor_that_meets_a_fake_one_in_an_op_stays_real():
    world = World("cpu", None)
    weight = world.fake(torch.ones, 3)
    batch = torch.arange(3.0)
    with DeviceRedirect(world):
        product = weight * batch
        total = batch.sum().item()
    assert is_fake(product) and not is_fake(batch) and total == 3.0  # the batch's values are its own


def test_a_subclass_holding_fake_and_real_tensors_holds_their_fake_copies_once_an_op_meets_it():
    from torchao.optim.subclass_8bit import OptimState8bit

    world = World("cuda", None)
    codes, scale = world.fake(torch.zeros, 4096, dtype=torch.uint8), world.fake(torch.zeros, 16)
    with DeviceRedirect(world):
        qmap = torch.tensor(range(256), dtype=torch.float32, device="cuda")  # a lookup table, real
        state = OptimState8bit(codes, scale, qmap, signed=True)
        dequantized = state.float()
    assert is_fake(state) and is_fake(state.qmap) and not is_fake(qmap) and qmap[255].item() == 255.0
    assert is_fake(dequantized) and dequantized.shape == (4096,) and world.on_device(state.qmap)


def test_a_checkpoint_saved_from_the_meta_device_loads_as_fake_tensors_whichever_unpickler(tmp_path):
    from lightning.fabric.utilities.load import _lazy_load

    with torch.device("meta"):
        torch.save({"weight": torch.empty(1 << 16, 1 << 14, dtype=torch.bfloat16), "step": torch.empty(3, dtype=torch.int64)},
                   tmp_path / "shapes.pth")
    world, patches = World("cuda", None), Patches()
    fakes.patch_meta_unpickling(world, patches)
    try:
        loaded, lazy = torch.load(tmp_path / "shapes.pth"), _lazy_load(tmp_path / "shapes.pth")
    finally:
        patches.restore()
    for state in (loaded, lazy):
        weight = state["weight"]
        assert is_fake(weight) and weight.shape == (1 << 16, 1 << 14) and weight.dtype == torch.bfloat16
        assert not world.on_device(weight)  # loaded on the host
        assert state["step"].device.type == "meta"  # no data to give an integer tensor
    assert torch.load(tmp_path / "shapes.pth")["weight"].device.type == "meta"  # after the run


def test_a_params4bit_of_fake_data_quantises_when_moved_to_the_device():
    import bitsandbytes as bnb

    world, patches = World("cuda", None), Patches()
    fakes.patch_params4bit(world, patches)
    try:
        with DeviceRedirect(world):
            weight = torch.zeros(256, 128, dtype=torch.bfloat16, device="cuda")
            param = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=False)
            moved = param.to("cuda")
    finally:
        patches.restore()
    assert isinstance(param, bnb.nn.Params4bit) and is_fake(param) and not param.bnb_quantized
    # 256 x 128 weights, two to a byte; one fp32 absmax per 64-weight block
    assert isinstance(moved, bnb.nn.Params4bit) and moved.bnb_quantized and moved.dtype == torch.uint8
    assert moved.numel() == 256 * 128 // 2 and moved.quant_state.absmax.numel() == 256 * 128 // 64
    assert world.on_device(moved) and moved.quant_state.shape == (256, 128)


def test_a_compiled_function_called_with_a_subclass_of_fake_and_real_tensors_gets_their_fake_copies():
    from torchao.optim.subclass_8bit import OptimState8bit

    from memplan.program.world import compiled_outside_mode

    world, patches = World("cuda", None), Patches()
    redirect = DeviceRedirect(world)
    compiled_outside_mode(redirect, patches)
    codes, scale = world.fake(torch.zeros, 4096, dtype=torch.uint8), world.fake(torch.zeros, 16)
    try:
        torch._dynamo.reset()
        with redirect:
            qmap = torch.tensor(range(256), dtype=torch.float32, device="cuda")  # a lookup table, real
            state = OptimState8bit(codes, scale, qmap, signed=True)
            # torchao's step, compiled: Dynamo refuses a subclass of mixed inner tensors when it wraps one
            dequantized = torch.compile(lambda s: s.float(), backend="eager", fullgraph=True)(state)
    finally:
        patches.restore()
        torch._dynamo.reset()
    assert is_fake(state.qmap) and not is_fake(qmap) and world.compiled_eagerly == {}
    assert is_fake(dequantized) and dequantized.shape == (4096,)
