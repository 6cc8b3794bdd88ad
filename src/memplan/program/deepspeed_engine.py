"""DeepSpeed in a program run: its accelerator, its communication backend, its module state.

A program that calls `deepspeed.initialize` (under `deepspeed ...`, `torchrun`, `accelerate
launch`, a Hugging Face `Trainer` with a DeepSpeed config) runs DeepSpeed's own engine and ZeRO
optimizers on memplan's world (memplan.program.world) and fake process group
(memplan.program.distributed). What DeepSpeed adds to what the world covers (DeepSpeed 0.19.8):

- **The accelerator.** DeepSpeed picks one per process (`get_accelerator`,
  deepspeed/accelerator/real_accelerator.py: `DS_ACCELERATOR`, else CUDA when `torch.cuda`
  reports a device, else the CPU) and keeps it in `ds_accelerator`. The run sets it:
  `CUDA_Accelerator` for a cuda run (memplan's fake cuda answers its queries, its tensors for
  `cuda:N` are the world's fake device tensors, its backend is NCCL, which joins the fake
  group), `CPU_Accelerator` for a cpu run (gloo).
- **The shared-memory all-reduce op.** On the CPU accelerator DeepSpeed's `TorchBackend`
  (deepspeed/comm/torch.py:204-223) JIT-builds a C++ op (`build_shm_op`) and initialises it
  for the world, waiting for every peer process to map its shared memory: in the run no peer
  runs, and the op serves only DeepSpeed's inference all-reduce (`inference_all_reduce`,
  deepspeed/comm/torch.py:292-306; ZeRO's collectives are torch.distributed's), with shared
  memory outside PyTorch's allocator. It is not built (`build_shm_op` gives None, as DeepSpeed
  does where the op is incompatible, deepspeed/comm/torch.py:47-53), here and in the ground
  truth (memplan.program.groundtruth), where the build alone takes minutes in a fresh checkout
  (measured: 3 min 50 s on 2 loaded cores) and every backend builds it, the program's own
  `init_process_group("gloo")` first or not (deepspeed/comm/comm.py:874-910).
- **Cross-rank checks.** ZeRO-3 checks that every rank gathers and orders the same parameters
  (`assert_ints_same_as_other_ranks`, deepspeed/runtime/zero/utils.py: each rank compares its
  list with rank 0's, broadcast from rank 0; called by `partitioned_param_coordinator.py`
  when a module trace completes, and in safe mode and sanity checks). On the fake group a
  broadcast moves no value, so a rank other than 0 would read its own `-1` placeholder and
  raise; the ranks of the run are one program, and the check is skipped (each rank's lists
  are its own, as they are in the real run where the check passes).
- **Module state.** DeepSpeed keeps its backend (`deepspeed.comm.comm.cdb`), its process groups
  (`deepspeed.utils.groups`), its accelerator and ZeRO-3's bookkeeping in module globals, set
  on the first rank's fake group. Every module-level name of DeepSpeed's modules is bound again
  as it was when the module was first seen (imported, or loaded before the rank) when a rank
  ends, so the next rank starts anew; a name the run added is removed (submodules stay).
  Containers changed in place (`groups._EXPERT_PARALLEL_GROUP`, MoE's) are not restored.
  `zero.Init` also replaces `torch.nn.functional.linear` by ZeRO-3's `zero3_linear_wrap` for
  the rest of the process (`Init._enable_mem_efficient_linear`,
  deepspeed/runtime/zero/partition_parameters.py:412-419: "This will persist unless manually
  reset"): torch's own is put back when the rank ends, or a later run in the same process
  would trace every linear layer through ZeRO-3's autograd function.

- **Its device state.** DeepSpeed makes its buffers and partitions with factories for
  `get_accelerator().current_device_name()` (`torch.empty(n, device=...)`, `torch.zeros`),
  some outside any module's forward, backward or optimizer step: `DeepSpeedEngine.__init__`
  (the ZeRO optimizer's flat parameter groups, fp32 partitions, gradient buffers), the
  epilogue of `DeepSpeedEngine.backward` after autograd's engine has returned (ZeRO-1/2's
  gradient partitions, `stage_1_and_2.py` `independent_gradient_partition_epilogue`),
  `DeepSpeedEngine.step`, and the whole `with deepspeed.zero.Init(...):` block (its post-init
  hook partitions each module as it is built: ZeRO-3's `ds_tensor` partitions, the
  `param.data = torch.empty(0)` of each freed parameter), and the entry and exit of
  `deepspeed.zero.GatheredParameters` (deepspeed/runtime/zero/partition_parameters.py:2465-2569:
  its all-gather buffers, which `param.data` is bound to, and the partitions made again at its
  exit; transformers loads a checkpoint into a ZeRO-3 model inside it, module by module,
  `_load_state_dict_into_zero3_model`, transformers/integrations/deepspeed.py:455-524, transformers
  5.23). In a cpu run those factories name the CPU, which the world keeps
  real outside the model's code (data); DeepSpeed's code is the model's code for the world
  (`World.engine_depth`), so what it makes is fake, at any size, as on a GPU.

ZeRO's own memory needs nothing more: its flat buffers and partitions are tensors it makes
for its device (fake device tensors), ZeRO-3's gathered parameters are views of an all-gather
output that DeepSpeed frees by rebinding `param.data` to an empty tensor
(`partition_parameters.free_param`): the last reference to the gathered storage dies, which
the recorder sees as its free, as it sees every tensor's.
"""

from __future__ import annotations

import functools
import sys
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch

from memplan.program.patches import Patches, in_package
from memplan.program.world import World

PACKAGE = "deepspeed"
ENGINE_METHODS = ("__init__", "backward", "step")  # deepspeed/runtime/engine.py, DeepSpeedEngine


class ModuleGlobals:
    """The module-level bindings of a package's modules, put back at `restore()` (module docstring)."""

    def __init__(self) -> None:
        self._saved: dict[str, tuple[ModuleType, dict[str, Any]]] = {}

    def keep(self, module: ModuleType) -> None:
        if module.__name__ not in self._saved:
            self._saved[module.__name__] = (module, dict(vars(module)))

    def restore(self) -> None:
        for module, namespace in self._saved.values():
            current = vars(module)
            for name in [n for n in current if n not in namespace and not isinstance(current[n], ModuleType)]:
                del current[name]
            for name, value in namespace.items():
                if current.get(name, namespace) is not value:
                    current[name] = value
        self._saved.clear()


def no_shm_comm_op(patches: Patches) -> None:
    """DeepSpeed's shared-memory all-reduce op is not built (module docstring)."""

    def patch(module: ModuleType) -> None:
        if module.__name__ == "deepspeed.comm.torch":
            patches.set(module, "build_shm_op", lambda: None)

    patches.on_import(PACKAGE + ".comm.torch", patch)


def _counted_as_engine_code(world: World, method: Any) -> Any:
    """`method`, with the world counting its calls as the model's code (module docstring)."""

    @functools.wraps(method)
    def inside(*args: Any, **kwargs: Any) -> Any:
        world.engine_depth += 1
        try:
            return method(*args, **kwargs)
        finally:
            world.engine_depth -= 1

    return inside


def no_cross_rank_checks(patches: Patches) -> None:
    """ZeRO-3's cross-rank consistency checks are skipped (module docstring)."""
    state: dict[str, Any] = {}

    def patch(module: ModuleType) -> None:
        utils = sys.modules.get(PACKAGE + ".runtime.zero.utils")  # loaded before any module that binds it
        if "original" not in state and hasattr(utils, "assert_ints_same_as_other_ranks"):
            state["original"] = utils.assert_ints_same_as_other_ranks
        original = state.get("original")
        if original is not None and getattr(module, "assert_ints_same_as_other_ranks", None) is original:
            patches.set(module, "assert_ints_same_as_other_ranks", lambda ints: None)

    patches.on_import(PACKAGE + ".runtime.zero", patch)


def _zero_init_block_counted(world: World, patches: Patches, init: type[AbstractContextManager]) -> None:
    """The whole `with deepspeed.zero.Init(...):` block is engine code: the modules built in
    it are partitioned by its post-init hook as they are made (module docstring)."""
    enter, leave = init.__enter__, init.__exit__

    def __enter__(self: Any) -> Any:
        world.engine_depth += 1
        try:
            return enter(self)
        except BaseException:
            world.engine_depth -= 1
            raise

    def __exit__(self: Any, *exc: Any) -> Any:
        try:
            return leave(self, *exc)
        finally:
            world.engine_depth -= 1

    patches.set(init, "__enter__", __enter__)
    patches.set(init, "__exit__", __exit__)


def engine_code(world: World, patches: Patches) -> None:
    """DeepSpeed's engine and `zero.Init` make device state (module docstring)."""

    def patch(module: ModuleType) -> None:
        if module.__name__ == "deepspeed.runtime.engine":
            for name in ENGINE_METHODS:
                patches.set(module.DeepSpeedEngine, name,
                            _counted_as_engine_code(world, getattr(module.DeepSpeedEngine, name)))
        elif module.__name__ == "deepspeed.runtime.zero.partition_parameters":
            patches.set(torch.nn.functional, "linear", torch.nn.functional.linear)  # put back at the end (above)
            patches.set(module.Init, "__init__", _counted_as_engine_code(world, module.Init.__init__))
            _zero_init_block_counted(world, patches, module.Init)
            for name in ("__enter__", "__exit__"):
                patches.set(module.GatheredParameters, name,
                            _counted_as_engine_code(world, getattr(module.GatheredParameters, name)))

    patches.on_import(PACKAGE + ".runtime", patch)


def install(world: World, patches: Patches) -> None:
    """DeepSpeed on the run's world, if the program imports it (module docstring)."""
    saved = ModuleGlobals()
    patches.on_restore(saved.restore)
    patches.on_import(PACKAGE, saved.keep)
    no_shm_comm_op(patches)
    engine_code(world, patches)
    no_cross_rank_checks(patches)

    def accelerator(module: Any) -> None:  # real_accelerator: its global `ds_accelerator` is set
        if module.__name__ != "deepspeed.accelerator.real_accelerator":
            return
        if world.cuda:
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

            module.ds_accelerator = CUDA_Accelerator()
        else:
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            module.ds_accelerator = CPU_Accelerator()

    patches.on_import(PACKAGE + ".accelerator.real_accelerator", accelerator)


def wraps_a_model(models: list[Any]) -> bool:
    """Whether one of the program's models is a DeepSpeed engine: ZeRO's partitions are its
    own flat tensors, not DTensors, so which ranks hold the same bytes is not read from rank
    0 (memplan.program.distributed.distinct_ranks) and every rank is traced."""
    return any(in_package(type(m).__module__, PACKAGE) for m in models)
