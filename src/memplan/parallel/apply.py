"""Apply a parallel layout to a plain model, for real (gloo) or on a fake process group.

The same code serves the CPU ground-truth runs (`memplan.parallel.groundtruth`, real
processes with the gloo backend) and the traced estimate (`memplan.parallel.traced`,
one process, fake tensors, PyTorch's fake process group), so what is traced is what runs.

The layouts follow torchtitan's `parallelize_llama` (models know nothing of parallelism;
the layout is applied from outside):

- **TP** (DTensor `parallelize_module` over the "tp" mesh dimension), the Llama plan:
  per block, `q_proj`/`k_proj`/`v_proj`/`gate_proj`/`up_proj` `ColwiseParallel`,
  `o_proj`/`down_proj` `RowwiseParallel`; the token embedding `RowwiseParallel` with a
  replicated input, the LM head `ColwiseParallel` with replicated (all-gathered) logits;
  every other module with parameters (norms) holds them as replicated DTensors
  (`ReplicateParallel`, so that one foreach optimizer can step all parameters). A peft
  LoRA layer's frozen `base_layer` takes the projection's style; its `lora_B` (colwise
  projection) or `lora_A` (rowwise) is split the same way, the other half replicated.
  Tied input/output embeddings (Qwen2.5-0.5B) stay tied: both styles shard the weight
  over the vocabulary (`Shard(0)`), and the head is given the embedding's parameter
  again after both are distributed (`_retie_embeddings`).
  Sequence parallel and loss parallel are *not* applied here: Hugging Face blocks take a
  replicated [B, S, H] input (rotary embeddings, masks), so the traced TP step keeps
  block inputs, norms and logits whole on every rank. Only model families whose blocks
  use these projection names (Llama, Mistral, Qwen2, ...) can be traced with TP.
- **FSDP2** (ZeRO-3): `fully_shard` on every transformer block, then on the root,
  `reshard_after_forward=True`, over the "dp" dimension (HSDP: a ("replicate", "shard")
  mesh of the data-parallel ranks); `layout.fsdp_param_dtype`: torchtitan's
  `MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`.
- **FSDP1** (`--engine fsdp1`, ZeRO-3 `FULL_SHARD`):
  `FullyShardedDataParallel` with the options HF Trainer hands accelerate
  (transformers' `TrainingArguments._process_fsdp_args` for FSDP1: `use_orig_params=True`,
  `backward_prefetch` "NO_PREFETCH", `forward_prefetch=False`; accelerate's
  `FullyShardedDataParallelPlugin`: `limit_all_gathers=True`, the transformer-based auto-wrap
  policy over the model's block class, `MixedPrecision(param_dtype=d, reduce_dtype=d,
  buffer_dtype=d)` for mixed precision `d`), one flat parameter per block and one for the
  root's remaining parameters. On a CPU process group FSDP1 needs `device_id=cpu` (without
  it, `_init_device_handle` asks for an accelerator) and `sync_module_states=False` (its
  broadcast refuses CPU tensors; every rank builds the same seeded weights anyway, what
  the broadcast is for).
- **PP x TP** (traced only): one pipeline stage's modules (`memplan.capture.pipeline`)
  get the TP plan above, cut to those modules (`apply_stage_layout`), over the "tp"
  dimension of a ("pp", "pp_dp", "pp_tp") mesh (`pipeline_mesh`); one data-parallel rank per
  stage (more data-parallel ranks are modelled on that trace: `traced_part`). Under
  PyTorch's multi-stage schedules (`memplan.parallel.schedules`) the rank's two chunks run
  PyTorch's schedule, with or without TP; 1F1B PP without TP stays modelled
  (`memplan.parallel.transform`).
- **CP** (`memplan.parallel.context`): FSDP2 over the data-parallel x CP ranks
  ("dp_shard_cp", flattened from ("dp", "cp")), and the step runs inside PyTorch's
  `context_parallel` per micro-batch.
- **EP** (`layout.ep`, with FSDP2): the routed experts split over EP groups by
  transformers' own EP plan and all-to-all (`memplan.parallel.expert`), before TP; FSDP2
  then shards each experts module over the ranks holding the same experts ("efsdp" of
  the expert mesh, with transformers' gradient divide factor) before the blocks and the
  root over "dp" (`transformers/distributed/fsdp.py`, `apply_fully_sharded_data_parallelism`;
  torchtitan's `apply_fsdp` likewise shards `moe.experts` over its edp mesh first). With
  TP, the attention of Mixtral and Qwen3-MoE takes the Llama plan, the router and the
  norms are replicated, and each TP rank dispatches its slice of the tokens.
- **DDP** (ZeRO-0 with more than one data-parallel rank): `DistributedDataParallel`
  with its defaults (25 MiB buckets, `gradient_as_bucket_view=False`); with TP, over the
  "dp" dimension of the mesh (`device_mesh=mesh["dp"]`: PyTorch's DDP + TP composition,
  which hands DDP the rank's local TP shards).

Assumes `torch.distributed` is initialised with `world_size == layout.world_size` and
that the model is built on cpu (real or fake tensors).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memplan import models
from memplan.capture.step import TrainingStep, make_step
from memplan.errors import UserError
from memplan.models import tracing
from memplan.models.build import TORCH_DTYPES, transformer_blocks, transformer_blocks_path
from memplan.models.moe import experts_of
from memplan.models.setup import TrainingSetup
from memplan.parallel.context import attach_attention_hooks, context_parallel_step
from memplan.parallel.expert import apply_expert_parallel, expert_mesh
from memplan.parallel.layout import MULTI_STAGE_SCHEDULES, Layout

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# MoE families whose attention is Llama's (per-head q/k norms at most): TP there, EP for the experts.
# OLMoE's q/k norms span all heads and gpt-oss's attention sinks are per head, which the plan does not split.
MOE_LLAMA_ATTENTION = ("mixtral", "qwen3_moe")
ROWWISE = ("o_proj", "down_proj")
STAGE_TP = "pp_tp"  # the TP dimension of a pipelined job's mesh (`pipeline_mesh`)
CP_SHARD = "dp_shard_cp"  # torchtitan's name of the data-parallel x CP ranks FSDP2 shards over


def traceable(layout: Layout, config: PretrainedConfig | None = None, setup: TrainingSetup | None = None) -> str | None:
    """Why `layout` cannot be traced on a fake process group (None: it can)."""
    if layout.world_size == 1 and layout.zero_engine != "fsdp2":
        return "one device: nothing to apply"  # FSDP2 on one rank still gathers, casts and reduces
    if layout.pp > 1 and layout.schedule in MULTI_STAGE_SCHEDULES and config is not None and not _llama_like(config):
        return (f"PyTorch's {layout.schedule} schedule is traced over Llama-style decoder chunks, not model type "
                f"{getattr(config, 'model_type', '?')!r}")
    if layout.pp > 1 and layout.tp == 1 and layout.schedule == "1f1b":
        return "1F1B pipeline parallelism without TP is modelled, not traced"
    if layout.pp > 1 and layout.dp > 1:
        return "PP is traced with one data-parallel rank per stage; with more it is modelled"
    if layout.zero_engine == "deepspeed" and layout.dp > 1:
        return "DeepSpeed's ZeRO optimizers are modelled, not traced"
    if layout.zero == 0 and layout.dp > 1:
        return "DDP's reducer cannot run on a fake process group (its hook gets no tensor back): modelled"
    if layout.cp > 1 and config is not None and not _llama_like(config):
        return (f"context parallelism is applied to Llama-style decoders (rotary embeddings from position ids, "
                f"`self_attn` modules), not model type {getattr(config, 'model_type', '?')!r}")
    if layout.tp > 1:
        return _tensor_parallel_refusal(config, layout)
    return None


def traced_part(layout: Layout, config: PretrainedConfig | None = None,
                setup: TrainingSetup | None = None) -> Layout | None:
    """The part of `layout` that is traced on a fake process group: the whole layout
    where `traceable` accepts it; else its TP (x PP) or multi-stage PP part alone, one
    data-parallel rank per stage, whose trace the data-parallel rules then reshape
    (`memplan.parallel.transform.data_parallel_trace`); None where nothing is traced (no
    TP and no multi-stage schedule, or a model this plan cannot apply to)."""
    if traceable(layout, config, setup) is None:
        return layout
    scheduled = layout.pp > 1 and layout.schedule in MULTI_STAGE_SCHEDULES
    if (layout.tp == 1 and not scheduled) or _tensor_parallel_refusal(config, layout) is not None:
        return None
    if layout.pp == 1 and layout.zero == 0:
        return layout  # DDP + TP: traced with DDP's parameter transform, without its reducer
    return replace(layout, world_size=layout.tp * layout.pp, zero=0, shard_size=None)


# A -mixed precision's half dtype.
MIXED_HALF = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


def traced_precision(setup: TrainingSetup, layout: Layout, config: PretrainedConfig | None = None,
                     parallel_tracing: bool = True) -> tuple[TrainingSetup, Layout, str]:
    """The setup and layout a precision is traced with under sharding, and the sentence that
    says so. A -mixed precision (fp32 weights, half-precision compute) runs as the sharding
    library's own mixed precision where it has one:

    - FSDP2 / FSDP1 traced on a fake process group: the sharded fp32 weights are the master
      weights and FSDP casts them for compute, FSDP2's `MixedPrecisionPolicy(param_dtype=half,
      reduce_dtype=fp32)` without autocast, as torchtitan applies it (torchtitan at commit
      6404b93: torchtitan/models/llama3/infra/parallelize.py `apply_fsdp` builds the policy from
      `training.mixed_precision_param` and `mixed_precision_reduce`; torchtitan/distributed/utils.py
      `maybe_enable_amp` returns no autocast when FSDP is on, "Mixed precision training is handled
      by fully_shard"); FSDP1 `MixedPrecision` as accelerate builds it (`apply_fsdp1`);
    - DeepSpeed: its bf16 / fp16 mode, half-precision weights with the fp32 master partition
      in its optimizer (`memplan.parallel.deepspeed`), so the step is traced -true;
    - FSDP where it is modelled (`--modelled-layout`, with pipeline parallelism): autocast over
      the fp32 weights, as on one GPU.

    An explicit `autocast`, a `fsdp_param_dtype` already set, and the -true precisions are
    traced as they are."""
    half = MIXED_HALF.get(setup.precision)
    if half is None or setup.autocast is not None or layout.fsdp_param_dtype is not None:
        return setup, layout, _precision_said(setup)
    engine = layout.zero_engine
    if engine == "deepspeed":
        return (replace(setup, precision=f"{'bf16' if half == 'bf16' else '16'}-true"), layout,
                f"{setup.precision}: DeepSpeed's {half} mode, {half} weights and gradients with an fp32 master "
                "partition")
    if engine in ("fsdp2", "fsdp1") and parallel_tracing and traced_part(layout, config, setup) == layout:
        policy = (f"MixedPrecisionPolicy(param_dtype={half}, reduce_dtype=fp32)" if engine == "fsdp2"
                  else f"MixedPrecision({half})")
        return (replace(setup, autocast="none"), replace(layout, fsdp_param_dtype=half),
                f"{setup.precision}: fp32 sharded weights and gradients, {engine} {policy} casts them for "
                "compute, no autocast (as torchtitan)")
    return setup, layout, _precision_said(setup)


def _precision_said(setup: TrainingSetup) -> str:
    """A precision in words: the weights' dtype and the forward's autocast."""
    autocast = setup.autocast_dtype
    return (f"{setup.precision}{'' if setup.autocast is None else f' + autocast {setup.autocast}'}: {setup.dtype} "
            f"weights and gradients, {f'{autocast} autocast' if autocast != 'none' else 'no autocast'}")


def modelled_rest(layout: Layout, part: Layout | None) -> bool:
    """Whether tracing `part` (`traced_part(layout)`) leaves some of `layout` to the
    modelled rules: what a smaller traced layout left out (DDP, ZeRO-1/2, data
    parallelism across pipeline stages), or DDP's buckets when DDP + TP is traced whole."""
    return part is not None and (part != layout or (layout.dp > 1 and layout.zero == 0))


def _tensor_parallel_refusal(config: PretrainedConfig | None, layout: Layout | None = None) -> str | None:
    if config is None:
        return None
    model_type = getattr(config, "model_type", "?")
    if experts_of(config) is not None:
        if layout is None or layout.ep == 1:
            return (f"the routed experts of {model_type!r} are split by expert parallelism, not by the Llama TP "
                    "plan: add `ep`")
        if model_type not in MOE_LLAMA_ATTENTION:
            return (f"the Llama TP plan fits the attention of {', '.join(MOE_LLAMA_ATTENTION)} only, not "
                    f"{model_type!r}'s")
        return None
    if not _llama_like(config):
        return (f"the Llama TP plan needs separate q/k/v and gate/up nn.Linear projections, which "
                f"model type {model_type!r} does not have")
    return None


def untraceable_tensor_parallel(layout: Layout, config: PretrainedConfig | None = None,
                                setup: TrainingSetup | None = None) -> str | None:
    """Why `memplan estimate` refuses `layout`'s TP (None: it does not).

    TP is only estimated where its TP part is traced (`traced_part`): the modelled TP
    rule (`memplan.parallel.transform`) describes Megatron-style TP with sequence and
    loss parallel, which this plan does not apply, and was 31% low against a real TP run
    (Qwen2.5, docs/estimation.md). `memplan fit` still searches with it
    (`parallel_tracing=False`)."""
    if layout.tp == 1:
        return None
    refusal = _tensor_parallel_refusal(config, layout)
    if refusal is None and layout.dp > 1 and layout.zero == 0 and setup is not None and \
            getattr(setup, "lora_rank", 0):
        refusal = ("PyTorch's DDP + TP composition makes frozen parameters trainable again (it re-wraps every "
                   "DTensor parameter in a new nn.Parameter, requires_grad=True), so LoRA's base weights would "
                   "train: use `zero=3` (FSDP2) with `tp` and `lora_rank`")
    if refusal is None and layout.dp > 1 and layout.zero == 0 and \
            config is not None and getattr(config, "tie_word_embeddings", False):
        refusal = ("PyTorch's DDP + TP composition fails on tied input/output embeddings (DDP localises the "
                   "shared weight once, and the LM head keeps a DTensor): use `zero=3` (FSDP2) with `tp`")
    return None if refusal is None else f"cannot estimate `tp={layout.tp}`: {refusal}"


def _llama_like(config: PretrainedConfig) -> bool:
    return getattr(config, "model_type", "") in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
                                                  "olmo", "olmo2", "granite", "smollm3")


def device_mesh(layout: Layout, device: str = "cpu") -> DeviceMesh:
    """The job's device mesh: ("dp", "tp"), or ("replicate", "shard", "tp") for HSDP; with
    CP, ("dp", "cp", "tp") (torchtitan's order)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.shard_size is not None:
        return init_device_mesh(device, (layout.dp // layout.shard_size, layout.shard_size, layout.tp),
                                mesh_dim_names=("replicate", "shard", "tp"))
    if layout.cp > 1:
        return init_device_mesh(device, (layout.dp, layout.cp, layout.tp), mesh_dim_names=("dp", "cp", "tp"))
    return init_device_mesh(device, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))


def fsdp_mesh(layout: Layout, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the data-parallel dimension ("dp", or HSDP's
    ("replicate", "shard")); with CP the data-parallel x CP ranks, ("dp", "cp") flattened
    into torchtitan's "dp_shard_cp"."""
    if layout.cp > 1:
        return mesh["dp", "cp"]._flatten(CP_SHARD)
    return mesh["replicate", "shard"] if layout.shard_size is not None else mesh["dp"]


def tensor_parallel_plan(model: nn.Module, blocks_path: str) -> dict[str, Any]:
    """torchtitan's Llama plan over the module names of a Hugging Face causal LM."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    prefix = blocks_path + "."
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if not name.startswith(prefix) or leaf not in COLWISE + ROWWISE:
            continue
        colwise = leaf in COLWISE
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            # a peft LoRA layer: its frozen base gets the projection's style; of the
            # adapter, the half that touches the sharded dimension is sharded the same
            # way (lora_B colwise: its output columns; lora_A rowwise: its input rows,
            # all-reduced to the replicated [.., r] output); the other half stays
            # replicated (`_replicate_the_rest`)
            plan[name + ".base_layer"] = ColwiseParallel() if colwise else RowwiseParallel()
            for adapter in module.lora_A:
                if colwise:
                    plan[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
                else:
                    plan[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
        else:
            plan[name] = ColwiseParallel() if colwise else RowwiseParallel()
    if not plan:
        raise UserError("the Llama TP plan matched no projection of this model")
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    if embed is not None:
        plan[names[id(embed)]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if head is not None:
        plan[names[id(head)]] = ColwiseParallel(output_layouts=Replicate())
    return plan


def tied_embeddings(model: nn.Module) -> bool:
    """Whether the LM head's weight is the token embedding's (Qwen2.5-0.5B, Gemma, GPT-2)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return embed is not None and head is not None and head.weight is embed.weight


def _retie_embeddings(model: nn.Module) -> None:
    """Tie the LM head to the token embedding again after both were distributed.

    Both plans shard the [vocab, hidden] weight the same way, `Shard(0)` over the vocabulary
    (the embedding `RowwiseParallel`, the head `ColwiseParallel`), as Megatron-LM's
    vocabulary-parallel embedding shares its weight with the output layer; but each
    `parallelize_module` style registers a new parameter, which would untie them (two
    copies, two gradients, two sets of optimizer states)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head.weight = embed.weight


class ReplicateParallel:
    """Hold a module's parameters as replicated DTensors; inputs and outputs stay local."""

    def apply(self, module: nn.Module, mesh: Any) -> None:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        def to_replicated(_mod: nn.Module, inputs: Any, device_mesh: Any) -> Any:
            return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(_mod: nn.Module, outputs: Any, _device_mesh: Any) -> Any:
            # every output, tuples included (a MoE router returns logits, weights and expert ids)
            from torch.utils._pytree import tree_map

            return tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, outputs)

        distribute_module(module, mesh, input_fn=to_replicated, output_fn=to_local)


def _replicate_the_rest(model: nn.Module, mesh: Any, modules: list[nn.Module] | None = None) -> None:
    from torch.distributed.tensor import DTensor

    candidates = model.modules() if modules is None else (m for top in modules for m in top.modules())
    owners = [m for m in candidates
              if any(not isinstance(p, DTensor) for p in m.parameters(recurse=False))]
    for module in owners:
        ReplicateParallel().apply(module, mesh)


def apply_layout(model: nn.Module, layout: Layout, blocks_path: str, mesh: DeviceMesh | None = None, *,
                 reducer: bool = True, offload_params: bool = False) -> nn.Module:
    """`model` with `layout` applied (TP, then FSDP2 or DDP); returns the module to train.
    `reducer=False` (a fake process group, where DDP's reducer cannot run): DDP + TP gets
    only DDP's parameter transform (the DTensor parameters become rank-local leaves, as
    under DDP), and DDP alone nothing; the caller models the reducer's buckets.
    `offload_params`: FSDP2 with `CPUOffloadPolicy()` (pinned host shards; call it inside
    `memplan.models.tracing.host_placement`, which serves the pinning on a CPU-only host)."""
    if layout.pp > 1 or (layout.zero_engine == "deepspeed" and layout.dp > 1):
        raise UserError("only DDP, FSDP2 (zero 3), FSDP1, TP, DDP + TP and FSDP2 + TP can be applied to a model")
    mesh = mesh if mesh is not None else device_mesh(layout)
    if layout.dp > 1 and layout.zero_engine == "fsdp1":
        return apply_fsdp1(model, layout, mesh["dp"])
    experts = []
    if layout.ep > 1:  # before TP, whose replication of the rest then leaves the (sharded) experts alone
        efsdp_ep = expert_mesh(layout.dp, layout.tp, layout.ep)
        experts = apply_expert_parallel(model, efsdp_ep["ep"], mesh["tp"])
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        tied = tied_embeddings(model)
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, blocks_path))
        if tied:
            _retie_embeddings(model)
        _replicate_the_rest(model, mesh["tp"])
    if layout.zero == 3 and (layout.shard_degree > 1 or layout.world_size == 1):
        from torch.distributed.fsdp import fully_shard

        dp_mesh = fsdp_mesh(layout, mesh)
        options: dict[str, Any] = {}
        if getattr(layout, "fsdp_param_dtype", None) is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[layout.fsdp_param_dtype],
                                                        reduce_dtype=torch.float32)
        if offload_params:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy()
        for module in experts:
            _shard_experts(module, efsdp_ep["efsdp"], layout, options)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=True, **options)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=True, **options)
        return model
    if layout.dp > 1:
        from torch.nn.parallel import DistributedDataParallel

        if not reducer:
            if layout.tp > 1:
                from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

                _pre_dp_module_transform(model)
            return model
        if layout.tp > 1:
            # a 1-D "dp" slice of the 2-D mesh: DDP localises the DTensor parameters
            # (torch.distributed.tensor.parallel.ddp._pre_dp_module_transform) and buckets
            # the rank's TP shards of the gradients
            return DistributedDataParallel(model, device_mesh=mesh["dp"])
        return DistributedDataParallel(model)
    return model


def apply_fsdp1(model: nn.Module, layout: Layout, mesh: DeviceMesh) -> nn.Module:
    """`model` under `FullyShardedDataParallel` as HF Trainer and accelerate set it up
    (module docstring): a flat parameter per transformer block and one for the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mixed = None
    if layout.fsdp_param_dtype is not None:
        dtype = TORCH_DTYPES[layout.fsdp_param_dtype]
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    strategy = ShardingStrategy.FULL_SHARD
    device = next(model.parameters()).device
    return FullyShardedDataParallel(
        model, process_group=mesh.get_group(), sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({type(transformer_blocks(model)[0])}), backward_prefetch=None,
        forward_prefetch=False, limit_all_gathers=True, use_orig_params=True, sync_module_states=False,
        mixed_precision=mixed, device_id=torch.device(device.type))


def _shard_experts(module: nn.Module, efsdp_mesh: DeviceMesh, layout: Layout, options: dict[str, Any]) -> None:
    """FSDP2 on one experts module over the ranks that hold the same experts, as
    transformers' `apply_fully_sharded_data_parallelism` does: its gradients cover the
    batches of all dp ranks, so they are divided by dp, summed over efsdp and divided
    locally where efsdp > 1."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=efsdp_mesh, reshard_after_forward=True, **options)
    module.set_gradient_divide_factor(float(layout.dp))
    if layout.efsdp > 1:
        module.set_force_sum_reduction_for_comms(True)


def pipeline_mesh(layout: Layout, device: str = "cpu") -> DeviceMesh:
    """The device mesh of a pipeline-parallel job: ("pp", "pp_dp", "pp_tp"), pp outermost
    (torchtitan's order). Its TP dimension is named apart from the non-pipelined mesh's
    "tp": DTensor caches sharding decisions keyed by mesh *value* (ranks, layout, names),
    and a cached decision holds the mesh, with its process-group names, of the first
    trace; a pipelined trace after a non-pipelined one in the same process would
    otherwise be handed the earlier, destroyed group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "pp_dp", STAGE_TP))


def apply_stage_layout(model: nn.Module, layout: Layout, blocks_path: str, owned: list[nn.Module],
                       mesh: DeviceMesh) -> None:
    """Apply `layout`'s TP to the modules of one pipeline stage (`owned`: its blocks, plus
    the embedding on the first stage, the final norm and LM head on the last), in place.

    The plan is `tensor_parallel_plan` cut to the stage's modules, so each block of the
    stage is distributed exactly as in the non-pipelined TP step; the other stages'
    modules stay plain tensors (they live on other GPUs and never run here). `mesh` is
    `pipeline_mesh`'s."""
    from torch.distributed.tensor.parallel import parallelize_module

    if layout.tp == 1:
        return
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = [names[id(m)] for m in owned]
    plan = {name: style for name, style in tensor_parallel_plan(model, blocks_path).items()
            if any(name == p or name.startswith(p + ".") for p in prefixes)}
    tied = tied_embeddings(model)
    parallelize_module(model, mesh[STAGE_TP], plan)
    if tied and any(m is model.get_input_embeddings() for m in owned) and \
            any(m is model.get_output_embeddings() for m in owned):
        _retie_embeddings(model)
    _replicate_the_rest(model, mesh[STAGE_TP], owned)


def build_parallel_step(config: PretrainedConfig, setup: TrainingSetup, layout: Layout, *,
                        target_device: str = "cpu", mesh: DeviceMesh | None = None) -> TrainingStep:
    """A `TrainingStep` of `config` under `setup` with `layout` applied, on cpu tensors
    (real or, inside a FakeTensorMode, fake). `torch.distributed` must be initialised.
    The same step runs on real gloo ranks (`memplan.parallel.groundtruth`) and on a fake
    process group (`memplan.parallel.traced`)."""
    if not models.is_fake_mode_active():
        torch.manual_seed(setup.seed)  # identical weights on every rank, as a checkpoint load gives
        if mesh is None:
            mesh = device_mesh(layout)
    model = models.build_model(config, setup, device="cpu")
    layers, blocks_path = len(transformer_blocks(model)), transformer_blocks_path(model)
    offload = setup.cpu_offload == "params"
    placement = tracing.host_placement() if offload else contextlib.nullcontext()
    if layout.cp > 1:
        attach_attention_hooks(model)
    if models.is_fake_mode_active():
        # the wrappers' set-up computes device-mesh coordinates and checks parameter
        # shapes with small real tensors; everything made from the (fake) parameters
        # stays fake
        with unset_fake_temporarily(), placement:
            trained = apply_layout(model, layout, blocks_path, mesh, reducer=False, offload_params=offload)
    else:
        with placement:
            trained = apply_layout(model, layout, blocks_path, mesh, offload_params=offload)
    optimizer = models.build_optimizer(trained, setup, device=target_device)
    batches = [models.make_batch(model, setup, device="cpu", seed=setup.seed + mb) for mb in range(setup.grad_accum)]
    meta = {"model": type(model).__name__, "setup": setup.to_dict(), "device": target_device,
            "parameters": models.count_parameters(config), "blocks_path": blocks_path,
            "layers": layers}
    cuda_kernels = target_device == "cuda" and models.is_fake_mode_active()
    meta["attention_kernels"] = "cuda" if cuda_kernels else "cpu"
    if layout.cp > 1:
        run = context_parallel_step(trained, optimizer, batches, setup, mesh["cp"], cuda_kernels=cuda_kernels)
    else:
        run = make_step(trained, optimizer, batches, setup, "cpu", cuda_kernels=cuda_kernels)
    return TrainingStep(trained, optimizer, batches, run, meta)
