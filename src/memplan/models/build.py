"""Builders: a model and an input batch for one `TrainingSetup` (its optimizer: `memplan.models.optimizers`).

The models are the plain Hugging Face classes (no memplan code inside them, as in
torchtitan, where parallelism and checkpointing are applied from outside the network):

- the class a config's `architectures` field names when it is a language-model head
  (`*ForCausalLM`, `*LMHeadModel`, `*ForMaskedLM`), else `AutoModelForCausalLM`, else
  `AutoModelForMaskedLM`, so every model returns a loss. With `setup.head="seq-cls"`,
  `AutoModelForSequenceClassification` with `setup.num_labels` classes instead, what an HF
  Trainer classification fine-tune builds (HF's pooled or last-token classifier and its
  loss: cross-entropy, or mean-squared error for one label); a config without a pad token
  gets its end-of-sequence token (else 0) as one, as fine-tuning recipes set it, because
  the last-token classifiers (GPT-2, Llama, ...) refuse batches above 1 without it;
- in the setup's dtype, training mode, `use_cache=False`;
- attention: `eager` and `sdpa` are HF's implementations. `flash` builds HF's `sdpa`
  path too — on CPU, and under fake tensors, PyTorch's SDPA dispatches to the flash
  kernel (`_scaled_dot_product_flash_attention_for_cpu`) whenever there is no explicit
  mask, which is what the causal batches of `make_batch` give — and records
  `model.memplan_attention = "flash"` so the estimator can model the CUDA flash kernels.
  `model.memplan_attn_implementation` is the HF implementation actually built (models
  without SDPA support fall back to eager);
- activation checkpointing, non-reentrant (`use_reentrant=False`): `full` is HF's
  `activation_checkpointing_enable` (`gradient_checkpointing_enable` before 5.x) (every transformer block is recomputed in backward);
  `selective` checkpoints only the attention submodule of each block, following the
  selective recomputation of Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models", arXiv 2205.05198), which recomputes attention because its
  activations are large and cheap to recompute — at HF module granularity, so the Q/K/V/O
  projections inside the attention module are recomputed too;
- LoRA through peft when `lora_rank > 0`, on peft's default targets for the family
  (the attention projections; `query_key_value` for BLOOM, `c_attn` for GPT-2);
- torch.compile last, after checkpointing and LoRA, as torchtitan applies it after
  activation checkpointing (`compile_model`): `model` compiles the whole model in place,
  `blocks` each transformer block and the loss on its own (Inductor's default backend;
  what the compiled step allocates is recorded by `memplan.capture.compiled`);
- a mixture-of-experts model routes by `setup.routing` (`memplan.models.moe`: the stated
  assignment replaces the router's expert ids as they enter the experts);
- weights: under `FakeTensorMode` (or on the meta device) weight init is skipped
  (`transformers.initialization.no_init_weights`), so a 70B model builds in about a second
  with no memory; on real tensors init is seeded by `setup.seed` without touching the
  global RNG.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memplan.errors import UserError
from memplan.models import litgpt, quant
from memplan.models.dtypes import TORCH_DTYPES
from memplan.models.moe import apply_routing, check_routing
from memplan.models.packages import require
from memplan.models.registry import FactorySpec, as_config, load_config, uses_remote_code
from memplan.models.setup import ALL_LINEAR, DEFAULT_MAX_SEQ, TrainingSetup

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

LM_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForMaskedLM")

# LoRA targets for families peft's default table lacks.
EXTRA_LORA_TARGETS = {"phi3": ["qkv_proj"]}

# Fraction of tokens a masked-LM batch asks the model to predict (BERT's 15%).
MLM_PROBABILITY = 0.15

# Names of learned absolute position-embedding modules (GPT-2, OPT, BERT, RoBERTa):
# these cannot run past their table, even with `allow_long_seq`.
LEARNED_POSITION_MODULES = ("wpe", "embed_positions", "position_embeddings")


def is_fake_mode_active() -> bool:
    """Whether a `FakeTensorMode` is active on this thread."""
    return torch._guards.detect_fake_mode() is not None


# The Auto classes a repository's own code can name in its `auto_map`, per task head.
REMOTE_HEAD_CLASSES = {"lm": ("AutoModelForCausalLM", "AutoModelForMaskedLM"),
                       "seq-cls": ("AutoModelForSequenceClassification",)}


def model_class(config: PretrainedConfig, head: str = "lm") -> type[nn.Module]:
    """The Hugging Face class `build_model` builds for a config and task head."""
    import transformers

    if uses_remote_code(config):
        return _remote_model_class(config, head)
    if head == "seq-cls":
        from transformers import AutoModelForSequenceClassification
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        )

        if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
            raise UserError(f"model type '{config.model_type}' has no sequence-classification class in "
                            "transformers: use `head=lm`")
        return AutoModelForSequenceClassification
    if head != "lm":
        raise UserError(f"head must be one of lm, seq-cls, not '{head}'")

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None and name.endswith(LM_HEAD_SUFFIXES):
            return cls
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return AutoModelForMaskedLM
    raise UserError(f"model type '{config.model_type}' has no causal or masked language-model class in transformers")


def _remote_model_class(config: PretrainedConfig, head: str) -> type[nn.Module]:
    """The Auto class whose `from_config(..., trust_remote_code=True)` builds the model class
    of a config loaded with its repository's code (its `auto_map` names the class)."""
    import transformers

    auto_map = getattr(config, "auto_map", None) or {}
    for name in REMOTE_HEAD_CLASSES.get(head, ()):
        if name in auto_map:
            return getattr(transformers, name)
    wanted = " or ".join(REMOTE_HEAD_CLASSES.get(head, ("a known head",)))
    raise UserError(f"{config.name_or_path or config.model_type}'s auto_map names no {wanted} class for `head={head}`")


def instantiate(cls: type[nn.Module], config: PretrainedConfig, **kwargs: Any) -> nn.Module:
    """`cls` built from `config` (Auto classes via `from_config`, concrete ones `_from_config`);
    a config from a repository's own code builds that code's model class."""
    if cls.__name__.startswith("AutoModel"):
        if uses_remote_code(config):
            kwargs["trust_remote_code"] = True
        return cls.from_config(config, **kwargs)
    return cls._from_config(config, **kwargs)


def is_masked_lm(model_or_config: nn.Module | PretrainedConfig) -> bool:
    """True for BERT-style models trained with a masked-LM loss."""
    if isinstance(model_or_config, nn.Module):
        names = [cls.__name__ for cls in type(_base_model(model_or_config)).__mro__]
        return any(name.endswith("ForMaskedLM") for name in names)
    cls = model_class(model_or_config)
    return getattr(cls, "__name__", "").endswith("ForMaskedLM")


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def max_positions(config: PretrainedConfig) -> int | None:
    """Longest sequence the config's position encoding covers (None when unbounded)."""
    value = getattr(config, "max_position_embeddings", None)
    if value is None:
        return None
    if getattr(config, "model_type", "") == "roberta":
        return value - (config.pad_token_id + 1)  # positions start after padding_idx
    return int(value)


def sequence_length(setup: TrainingSetup, model_or_config: nn.Module | PretrainedConfig) -> int:
    """The setup's sequence length, resolving `seq=None` to min(max positions, 1024)."""
    if setup.seq is not None:
        return setup.seq
    config = getattr(model_or_config, "config", model_or_config)
    limit = max_positions(config) if config is not None else None
    return DEFAULT_MAX_SEQ if limit is None else min(limit, DEFAULT_MAX_SEQ)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_model(spec: str | PretrainedConfig | FactorySpec, setup: TrainingSetup, device: str = "cpu") -> nn.Module:
    """Build the model a spec names, ready for one training step of `setup`.

    `spec` is a registry name, a config.json path, `package.module:factory`, a
    `PretrainedConfig` or a `FactorySpec`. Works on real tensors and inside
    `FakeTensorMode` (on fake `cpu` or fake `cuda`). Raises `UserError` for impossible
    setups (sequence longer than the model allows, LoRA targets that match nothing, ...).
    """
    setup.check()
    if setup.quant == "int8" and setup.dora:
        # peft's DoRA re-wraps the int8 weight of a CPU layer on every forward
        # (utils/integrations.py, dequantize_module_weight: `module.weight.to(device)`), which
        # leaves Linear8bitLt without its row scales, and the next forward fails
        raise UserError("`dora` with `quant=int8` fails in peft + bitsandbytes on CPU, the one device int8 is "
                        "estimated for: use `quant=nf4` or fp4")
    if setup.quant != "none":
        require("bitsandbytes", f"--quant {setup.quant}")
    if isinstance(spec, str):
        spec = load_config(spec)
    check_routing(spec, setup.routing, fake=is_fake_mode_active())
    skip_init = is_fake_mode_active() or torch.device(device).type == "meta"
    init = contextlib.nullcontext() if skip_init else _seeded(setup.seed)
    with init:
        if isinstance(spec, FactorySpec):
            if setup.head != "lm" or setup.impl != "hf":
                flag = f"`head={setup.head}`" if setup.head != "lm" else f"`impl={setup.impl}`"
                raise UserError(f"{flag} builds a model from a Hugging Face config; the factory "
                                f"'{spec.spec}' builds its own model: leave it out")
            model = _build_from_factory(spec, setup, device)
        elif setup.impl == "litgpt":
            model = _build_litgpt(copy.deepcopy(spec), setup, device)
        else:
            model = _build_from_config(copy.deepcopy(spec), setup, device, skip_init)
        _check_sequence(model, setup)
        apply_routing(model, getattr(model, "config", None), setup.routing)
        model.train()
        if setup.lora_rank > 0 and setup.impl == "hf":
            _check_lora_targets(model, setup)
        if setup.quant != "none":
            _apply_quant(model, setup, spec, fake=skip_init)
        if setup.impl == "litgpt" and setup.checkpointing == "full":
            litgpt.checkpoint_blocks(model)
        else:
            _apply_checkpointing(model, setup)
        if setup.lora_rank > 0 and setup.impl == "hf":
            model = _apply_lora(model, setup)
        elif setup.frozen_base:
            quant.train_unquantised(model)
        compile_model(model, setup)
    model.memplan_attention = setup.attn
    return model


def _apply_quant(model: nn.Module, setup: TrainingSetup, spec: PretrainedConfig | FactorySpec, fake: bool) -> None:
    """The quantised base of `setup.quant` (`memplan.models.quant`), then peft's k-bit
    preparation when `setup.kbit_prep`."""
    if isinstance(spec, FactorySpec):
        raise UserError(f"`quant` quantises a Hugging Face model as transformers loads it; the factory "
                        f"'{spec.spec}' builds its own: pass a registry name or a config.json")
    if torch.device(next(model.parameters()).device).type == "meta":
        raise UserError("`quant` needs real or fake tensors, not the meta device")
    quant.quantise_base(model, setup, fake=fake)
    if setup.kbit_prep:
        quant.prepare_for_kbit_training(model)


def _build_litgpt(config: PretrainedConfig, setup: TrainingSetup, device: str) -> nn.Module:
    """LitGPT's `GPT` for `config` and the loss of its fine-tuning loop (`memplan.models.litgpt`)."""
    if setup.head != "lm":
        raise UserError(f"`impl=litgpt` builds LitGPT's language model; `head={setup.head}` is a Hugging Face head: "
                        "use `impl=hf`")
    if setup.attn == "eager":
        raise UserError("LitGPT's attention always calls scaled_dot_product_attention: use `attn=sdpa` with "
                        "`impl=litgpt`")
    if getattr(config, "num_local_experts", None) and is_fake_mode_active():
        raise UserError("LitGPT's LLaMAMoE routes tokens with torch.where (data-dependent shapes), which fake "
                        "tensors cannot trace: use `impl=hf` for a mixture-of-experts model")
    model = litgpt.build_litgpt_model(config, setup, sequence_length(setup, config), TORCH_DTYPES[setup.dtype],
                                      device)
    model.memplan_attn_implementation = "sdpa"
    return model


def carried_between_steps(model: nn.Module) -> dict[str, Any]:
    """What the model's training loop keeps alive from one micro-batch (and step) to the
    next, for the capture to count from the start (LitGPT's loop keeps the previous
    logits: `memplan.models.litgpt`); empty for the other models."""
    return getattr(model, "carried", {})


def _build_from_config(config: PretrainedConfig, setup: TrainingSetup, device: str, skip_init: bool) -> nn.Module:
    from transformers.initialization import no_init_weights

    cls = model_class(config, setup.head)
    if setup.head == "seq-cls":
        config = copy.deepcopy(config)  # the classifier's width and pad token are this build's, not the caller's
        config.num_labels = setup.num_labels
        if getattr(config, "pad_token_id", None) is None:
            eos = getattr(config, "eos_token_id", None)
            config.pad_token_id = (eos[0] if isinstance(eos, list) and eos else eos) if eos is not None else 0
    config.use_cache = False
    dtype = TORCH_DTYPES[setup.dtype]
    wanted = "eager" if setup.attn == "eager" else "sdpa"
    no_init = no_init_weights() if skip_init else contextlib.nullcontext()
    with torch.device(device), no_init:
        try:
            model = instantiate(cls, config, dtype=dtype, attn_implementation=wanted)
        except ValueError as exc:
            if wanted != "sdpa":
                raise UserError(f"cannot build {config.model_type}: {str(exc).splitlines()[0]}") from exc
            wanted = "eager"  # this family has no SDPA path in transformers (e.g. BLOOM)
            try:
                model = instantiate(cls, config, dtype=dtype, attn_implementation=wanted)
            except ValueError as exc2:
                raise UserError(f"cannot build {config.model_type}: {str(exc2).splitlines()[0]}") from exc2
    if skip_init:
        # no_init_weights also skips tying: tie input and output embeddings as the real
        # build does, or a fake model counts a tied lm_head twice
        model.tie_weights()
    model.memplan_attn_implementation = wanted
    return model


def _build_from_factory(spec: FactorySpec, setup: TrainingSetup, device: str) -> nn.Module:
    factory = spec.resolve()
    try:
        takes_setup = len(inspect.signature(factory).parameters) >= 1
    except (TypeError, ValueError):
        takes_setup = False
    with torch.device(device):
        model = factory(setup) if takes_setup else factory()
    if not isinstance(model, nn.Module):
        raise UserError(f"factory '{spec.spec}' returned {type(model).__name__}, not a torch.nn.Module")
    dtype = TORCH_DTYPES[setup.dtype]
    tensors = [*model.parameters(), *model.buffers()]
    # `.to` on fake tensors fails for some modules (Conv2d): skip it when it would not move anything
    if any(t.device != torch.device(device) or (t.is_floating_point() and t.dtype != dtype) for t in tensors):
        model.to(device=device, dtype=dtype)
    model.memplan_attn_implementation = "model"
    return model


def _check_sequence(model: nn.Module, setup: TrainingSetup) -> None:
    config = getattr(model, "config", None)
    seq = sequence_length(setup, model)
    limit = max_positions(config) if config is not None else None
    if limit is None or seq <= limit:
        return
    learned = [name for name, module in model.named_modules()
               if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in LEARNED_POSITION_MODULES]
    if not setup.allow_long_seq or learned:
        why = ("its learned position table ends there" if learned
               else "pass allow_long_seq=True to run past it anyway")
        raise UserError(f"sequence length {seq} exceeds the model's maximum of {limit} positions ({why}); use `seq={limit}` or less")


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks: the longest `ModuleList` of same-class modules."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if len({type(child) for child in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    if best is None:
        raise UserError(f"{type(model).__name__} has no repeated blocks (nn.ModuleList) to checkpoint")
    return best


def transformer_blocks_path(model: nn.Module) -> str:
    """The qualified module name of `model`'s repeated blocks (`transformer_blocks`)."""
    blocks = transformer_blocks(model)
    return next(name for name, mod in model.named_modules() if mod is blocks)


def op_sac_context() -> Any:
    """The `context_fn` of one checkpointed block under torchtitan's op-level selective
    activation checkpointing (`--activation_checkpoint.selective_ac_option op`,
    torchtitan/models/llama3/infra/parallelize.py): the outputs of the attention kernels,
    of reduce-scatters, of `max` and of every other matmul are saved; everything else in
    the block is recomputed in backward."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops
    mm = ops.aten.mm.default
    save = {mm, ops.aten._scaled_dot_product_efficient_attention.default,
            ops.aten._scaled_dot_product_flash_attention.default,
            ops._c10d_functional.reduce_scatter_tensor.default, ops.aten.max.default}
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[key] += 1
        keep = func in save and not (func == mm and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_forward(module: nn.Module, op_level: bool = False) -> None:
    """Make `module` recompute its forward in backward (non-reentrant checkpoint);
    `op_level`: torchtitan's op-level selective policy (`op_sac_context`), which, like
    torchtitan, does not preserve the RNG state."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward
    options: dict[str, Any] = {"context_fn": op_sac_context, "preserve_rng_state": False} if op_level else {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **options, **kwargs)

    module.forward = forward
    module.memplan_checkpointed = True


def _apply_checkpointing(model: nn.Module, setup: TrainingSetup) -> None:
    if setup.checkpointing == "none":
        return
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # as transformers' models do under gradient checkpointing (e.g. GPT2Model.forward:
        # "`use_cache=True` is incompatible with gradient checkpointing"): a recomputed block
        # would append to the KV cache again
        config.use_cache = False
    if setup.checkpointing == "full":
        if getattr(model, "supports_gradient_checkpointing", False):
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            for block in transformer_blocks(model):
                _checkpoint_forward(block)
        return
    if setup.checkpointing == "selective-op":
        for block in transformer_blocks(model):
            _checkpoint_forward(block, op_level=True)
        return
    attention = []
    for block in transformer_blocks(model):
        found = [child for child in block.children() if "attention" in type(child).__name__.lower()]
        if not found:
            raise UserError(f"selective checkpointing: block {type(block).__name__} has no attention submodule")
        attention.extend(found)
    for module in attention:
        _checkpoint_forward(module)


def _graph_breaker(setup: TrainingSetup) -> str | None:
    """The setup's technique that Dynamo cannot put in one graph with a block (None: none):
    bitsandbytes' quantised layers and peft's DoRA (graph breaks in their Python), and the
    optimizer offload's dispatch mode (Dynamo does not trace under a non-infra mode)."""
    if setup.quant != "none":
        return f"`quant={setup.quant}`"
    if setup.dora:
        return "`dora`"
    if setup.cpu_offload != "none":
        return f"`cpu_offload={setup.cpu_offload}`"
    return None


def compile_model(model: nn.Module, setup: TrainingSetup) -> None:
    """Apply `setup.compile` to `model` (in place; compilation itself happens at the first call):

    - `model`: the whole model, `nn.Module.compile()` (`torch.compile` of its call); Hugging
      Face computes the loss inside `forward`, so the loss is compiled with it;
    - `blocks`: each transformer block replaced in its `ModuleList` by
      `torch.compile(block, fullgraph=True)`, as torchtitan's `apply_compile` does
      (torchtitan/models/llama3/infra/parallelize.py: after activation checkpointing, so a
      checkpointed block is recomputed inside its compiled graph), and the loss compiled on
      its own as torchtitan's `build_cross_entropy_loss` does (torchtitan/components/loss.py,
      `torch.compile(loss_fn)`): here the model's `loss_function` (transformers'
      `ForCausalLMLoss`, ...). A model whose `forward` computes its loss inline (BERT, the
      GPT-2 classifier) has no loss to compile apart and is refused (`UserError`).
    """
    if setup.compile == "none":
        return
    if setup.compile == "model":
        model.compile()
        return
    breaker = _graph_breaker(setup)
    if breaker is not None:
        raise UserError(f"`compile=blocks` compiles each block as one graph (fullgraph=True, as torchtitan does) and "
                        f"{breaker} breaks that graph: use `compile=model`")
    base = _base_model(model)
    forward = type(base).forward
    try:
        calls_loss_function = "self.loss_function" in inspect.getsource(forward)
    except (OSError, TypeError):
        calls_loss_function = False
    if not hasattr(base, "loss_function") or not calls_loss_function:
        raise UserError(f"`compile=blocks` compiles the loss apart through the model's loss_function, which "
                        f"{type(base).__name__}.forward does not call: use `compile=model`")
    blocks = transformer_blocks(model)
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, torch.compile(block, fullgraph=True))
    base.loss_function = torch.compile(base.loss_function)


def lora_targets(model: nn.Module, setup: TrainingSetup) -> list[str] | str:
    """Module-name suffixes LoRA adapts: the setup's, else peft's default for the family;
    `"all-linear"` as peft spells it (every linear layer but the output head)."""
    if setup.lora_targets == (ALL_LINEAR,):
        return ALL_LINEAR
    if setup.lora_targets:
        return list(setup.lora_targets)
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    targets = defaults.get(model_type) or EXTRA_LORA_TARGETS.get(model_type)
    if not targets:
        raise UserError(f"no default LoRA targets for model type '{model_type}': set TrainingSetup.lora_targets")
    return list(targets)


def _check_lora_targets(model: nn.Module, setup: TrainingSetup) -> None:
    """`UserError` when a LoRA target names no module of `model`, each target checked alone
    (peft adapts what the others match and drops it silently), with the names that exist;
    before anything is quantised or adapted (peft checks `all-linear` itself)."""
    targets = lora_targets(model, setup)
    if targets == ALL_LINEAR:
        return
    names = [name for name, _ in model.named_modules()]
    unmatched = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
    if unmatched:
        leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if name and not list(module.children()) and not name.rsplit(".", 1)[-1].isdigit()})
        raise UserError(f"LoRA target{'s' if len(unmatched) > 1 else ''} {', '.join(unmatched)} match"
                        f"{'' if len(unmatched) > 1 else 'es'} no module of {type(model).__name__}; its modules are "
                        f"named {', '.join(leaves)} (or give `lora_targets=all-linear`)")


def _apply_lora(model: nn.Module, setup: TrainingSetup) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, setup)
    # A classification head is new, so peft trains it in full (task_type SEQ_CLS, as HF's
    # LoRA classification recipes set it): peft keeps a trainable copy of the classifier.
    task = {"task_type": "SEQ_CLS"} if setup.head == "seq-cls" else {}
    alpha = setup.lora_alpha if setup.lora_alpha is not None else 2 * setup.lora_rank
    config = LoraConfig(r=setup.lora_rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                        bias="none", use_dora=setup.dora, **task)
    fake = is_fake_mode_active()
    # Under FakeTensorMode, `Module.to` on fake parameters fails (torch swaps fake
    # parameters and the swap refuses tensors with weak references), and peft moves every
    # new adapter with `.to` unless it is on the meta device. So the adapters are made on
    # meta and then given fake storage on the model's device.
    device = next(model.parameters()).device
    try:
        with torch.device("meta") if fake else contextlib.nullcontext():
            peft_model = get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"LoRA: {str(exc).splitlines()[0]}") from exc
    if fake:
        _materialize_meta_parameters(peft_model, device)
    peft_model.memplan_attn_implementation = getattr(model, "memplan_attn_implementation", None)
    return peft_model


def _materialize_meta_parameters(model: nn.Module, device: torch.device) -> None:
    """Give meta parameters (fresh, untied LoRA adapters) storage on `device`."""
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                storage = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[key] = nn.Parameter(storage, requires_grad=param.requires_grad)


def make_batch(model_or_config: nn.Module | PretrainedConfig, setup: TrainingSetup, device: str = "cpu",
               seed: int = 0) -> dict[str, torch.Tensor]:
    """One micro-batch (`setup.batch` x sequence length) that makes the model return a loss.

    Causal LMs get `input_ids` and `labels` (the model shifts labels itself); masked LMs
    get `labels` that ask for 15% of the tokens and ignore the rest (-100); a `seq-cls`
    head gets one class index per sequence (`[batch]` int64 below `num_labels`), or one
    float target per sequence for `num_labels=1` (regression). No attention
    mask: every token is real, so SDPA can take its causal fast path. A factory model with
    a `make_batch(setup, device, seed)` method supplies its own batch. Works inside
    `FakeTensorMode` (the values are then meaningless, the shapes are right).
    """
    own = getattr(model_or_config, "make_batch", None)
    if isinstance(model_or_config, nn.Module) and callable(own):
        return own(setup, device, seed)
    config = getattr(model_or_config, "config", model_or_config)
    if isinstance(model_or_config, str):
        config = load_config(model_or_config)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise UserError("cannot make a batch: the model has no config.vocab_size and no make_batch(setup, device, seed) method")
    seq = sequence_length(setup, config)
    shape = (setup.batch, seq)
    if setup.head == "seq-cls":
        return _classification_batch(vocab, shape, setup.num_labels, device, seed)
    if isinstance(model_or_config, nn.Module):
        masked = is_masked_lm(model_or_config)
    else:
        masked = hasattr(config, "model_type") and is_masked_lm(config)
    if is_fake_mode_active():
        # Values do not matter; make them straight on the (fake) device, since a fake
        # copy from cpu to cuda fails on a CPU-only build.
        input_ids = torch.randint(0, vocab, shape, device=device)
        chosen = torch.rand(shape, device=device) < MLM_PROBABILITY if masked else None
    else:  # seeded on the CPU so every device gets the same tokens
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab, shape, generator=generator).to(device)
        chosen = (torch.rand(shape, generator=generator) < MLM_PROBABILITY).to(device) if masked else None
    if chosen is None:
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    return {"input_ids": input_ids, "labels": labels}


def _classification_batch(vocab: int, shape: tuple[int, int], num_labels: int, device: str,
                          seed: int) -> dict[str, torch.Tensor]:
    """Token ids and one label per sequence, as an HF Trainer classification batch."""
    batch = shape[0]
    if is_fake_mode_active():
        input_ids = torch.randint(0, vocab, shape, device=device)
        labels = (torch.rand(batch, device=device) if num_labels == 1
                  else torch.randint(0, num_labels, (batch,), device=device))
    else:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab, shape, generator=generator).to(device)
        labels = (torch.rand(batch, generator=generator) if num_labels == 1
                  else torch.randint(0, num_labels, (batch,), generator=generator)).to(device)
    return {"input_ids": input_ids, "labels": labels}


def forward_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run `model(**batch)` and return its scalar loss (`.loss`, `["loss"]` or a tensor)."""
    output = model(**batch)
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None:
        raise UserError(f"{type(model).__name__}.forward returned {type(output).__name__} with no loss")
    return loss


def autocast(setup: TrainingSetup, device: str = "cpu") -> contextlib.AbstractContextManager:
    """`torch.autocast` for the setup's autocast dtype, or a no-op where it has none."""
    if setup.autocast_dtype == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=TORCH_DTYPES[setup.autocast_dtype])


def count_parameters(spec: str | PretrainedConfig | FactorySpec) -> int:
    """Number of parameters of the model a spec builds (tied weights counted once).

    Builds on the meta device: no memory, a fraction of a second even for 70B models.
    """
    config = as_config(spec)
    with torch.device("meta"):
        model = instantiate(model_class(config), config)
    return sum(p.numel() for p in model.parameters())
