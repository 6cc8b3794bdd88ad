"""One transformers `generate()` call, traced: the model's own code on fake tensors, prefill then
N decode steps, with the cache class transformers 5.23 builds for the call.

What runs is `model.generate(input_ids, attention_mask, max_new_tokens=N, min_new_tokens=N,
...)` itself (transformers `generation/utils.py`): the prefill (`_prefill`), the decode loop of
`_sample` or `_beam_search`, the logits processors, the cache `_prepare_cache_for_generation`
makes, and the model's forward with `logits_to_keep=1` where the model takes it (`generate`
sets it: only the last position's logits are computed). The call is fixed-shape: every prompt
is `input_len` tokens and every sequence gets exactly N new tokens
(`memplan.inference.gen_fixed` answers the data-dependent questions accordingly).

Under the recorder (`memplan.capture.capture`) each forward of the model is one iteration of
the trace: 0 is the prefill, i the i-th decode step. The cache's buffers are noted as such
(`memplan.inference.gen_caches.cache_buffers`). A CUDA job runs CUDA's SDPA kernels
(`memplan.capture.cuda_kernels`) and the offloaded cache's moves as on CUDA
(`gen_caches.offloaded_as_on_cuda`); HQQ's quantised cache is modelled (`gen_caches`).

The same `build_generation_model`, `generation_inputs` and `run_generate` run the real CPU call
the tests measure with torch.profiler.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.capture.api import capture
from memplan.capture.cuda_kernels import kernels_as_on_cuda
from memplan.capture.recorder import Recorder
from memplan.errors import UserError
from memplan.inference import gen_caches, gen_parallel
from memplan.inference.gen_fixed import FixedShapeAnswers
from memplan.inference.gen_setup import (  # noqa: F401 - the call's names, where it is traced
    CACHE_IMPLEMENTATIONS,
    CACHES,
    GenerationSetup,
)
from memplan.models.build import autocast, build_model, transformer_blocks, transformer_blocks_path
from memplan.models.quant import weight_count
from memplan.models.setup import TrainingSetup
from memplan.parallel.traced import DistributedRecorder
from memplan.trace.model import Trace

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

def model_setup(setup: TrainingSetup | dict[str, Any] | None) -> TrainingSetup:
    """The fields of `setup` that build the model for inference: its dtype, attention, quantised
    base (bitsandbytes, as `from_pretrained` with a `BitsAndBytesConfig` loads it: no k-bit
    training preparation), routing and the autocast its forward runs under (a model trained
    with mixed precision generates under it, `build_generation_model`); training fields are
    left at their defaults. A dict names those fields (`{"dtype": "bf16", "quant": "nf4"}`: the
    weights' dtype, fp32 when left out, with no autocast unless `autocast` is named)."""
    if isinstance(setup, dict):  # the weights' dtype (fp32 unless given), no autocast unless given
        setup = TrainingSetup.from_dict({"dtype": "fp32", **setup, "frozen_base": setup.get("quant", "none") != "none"})
    setup = setup if setup is not None else TrainingSetup(precision="32-true")
    if setup.impl != "hf":
        raise UserError("memplan generate traces transformers' generate(): use --impl hf")
    return TrainingSetup(precision=setup.precision, attn=setup.attn, quant=setup.quant, double_quant=setup.double_quant,
                         quant_storage=setup.quant_storage, compute_dtype=setup.compute_dtype,
                         kbit_prep=False, frozen_base=setup.quant != "none", routing=setup.routing,
                         autocast=setup.autocast, seq=setup.seq, allow_long_seq=setup.allow_long_seq, seed=setup.seed)


def check_generation(config: PretrainedConfig, setup: TrainingSetup, gen: GenerationSetup, device: str) -> None:
    """`UserError` for a call transformers (or memplan's trace of it) cannot make."""
    if setup.quant == "int8" and device == "cuda":
        raise UserError("--quant int8 is estimated for --device cpu only: bitsandbytes' CUDA int8 matmul "
                        "(LLM.int8 outlier columns) has data-dependent shapes; use --quant nf4 or fp4")
    if gen.cache == "offloaded" and device != "cuda":
        raise UserError("--cache offloaded moves each layer between the GPU and the host: use --device cuda")
    sliding = has_sliding_layers(config)
    if gen.cache == "sliding" and not sliding:
        raise UserError(f"--cache sliding is a static cache with sliding-window layers; "
                        f"{getattr(config, 'model_type', 'this model')} has none: use --cache static")
    if gen.cache.startswith("quantized") and sliding:
        raise UserError("transformers' QuantizedCache takes full-attention layers only, and this model has "
                        "sliding-window layers: use --cache dynamic or static")
    if gen.cache == "quantized:int4":
        from transformers.utils import is_optimum_quanto_available

        if not is_optimum_quanto_available():
            raise UserError("--cache quantized:int4 runs transformers' quanto backend, which needs optimum-quanto: "
                            "pip install optimum-quanto==0.2.7")


def has_sliding_layers(config: PretrainedConfig) -> bool:
    """Whether the decoder has sliding-window layers (transformers' `get_layer_types_and_kwargs`:
    `layer_types`, else a `sliding_window` in the config)."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    if types is not None:
        return any("sliding" in t for t in types)
    return getattr(text, "sliding_window", None) is not None


def build_generation_model(config: PretrainedConfig, setup: TrainingSetup, device: str = "cpu") -> torch.nn.Module:
    """The model `generate()` runs on, in eval mode (on fake tensors under a `FakeTensorMode`);
    with `setup.autocast`, its forward wrapped as accelerate wraps a mixed-precision model's
    (`autocast_forward`)."""
    model = build_model(config, setup, device=device)
    model.eval()
    model.config.use_cache = True
    if setup.autocast != "none":
        model.forward = autocast_forward(model.forward, setup)
    return model


def autocast_forward(forward: Any, setup: TrainingSetup) -> Any:
    """`forward` under `torch.autocast` to the setup's dtype, its 16-bit outputs made fp32:
    what `Accelerator.prepare_model` does to a model under native mixed precision
    (accelerate 1.15 `accelerator.py` L1824-1835: `convert_outputs_to_fp32(autocast_context(
    forward))`; `utils/operations.py` L889-910 `convert_to_fp32`). Each forward enters and
    leaves the autocast, so its cache of casted weights lives for one forward. The autocast
    is the cpu one the fake tensors live on (under `kernels_as_on_cuda` a CUDA job takes
    CUDA's op lists). `functools.wraps` keeps the signature `generate()` inspects
    (`logits_to_keep`), as accelerate's wrappers do."""
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with autocast(setup, "cpu"):
            out = forward(*args, **kwargs)
        for key, value in list(out.items()) if hasattr(out, "items") else []:
            if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
                out[key] = value.float()
        return out

    return wrapped


def generation_inputs(config: PretrainedConfig, gen: GenerationSetup, device: str = "cpu",
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """`batch` prompts of `input_len` token ids and their all-ones attention mask (a tokenizer's
    output for unpadded prompts); seeded on real tensors, any values on fake ones."""
    shape = (gen.batch, gen.input_len)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    if torch._guards.detect_fake_mode() is not None:
        ids = torch.randint(0, vocab, shape, device=device)
    else:
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def run_generate(model: torch.nn.Module, inputs: dict[str, torch.Tensor], gen: GenerationSetup) -> torch.Tensor:
    """`model.generate(**inputs, ...)` for `gen` under `torch.no_grad()`, as a real run makes it;
    on fake tensors, a quantised cache built by `gen_caches.hqq_modelled` for HQQ and quanto's
    codes packed by `gen_caches.quanto_packs_fake_codes`."""
    kwargs = gen.generate_kwargs()
    fake = torch._guards.detect_fake_mode() is not None
    backend = kwargs.get("cache_config", {}).get("backend") if fake else None
    fixes = {"hqq": gen_caches.hqq_modelled, "quanto": gen_caches.quanto_packs_fake_codes}
    with torch.no_grad(), fixes[backend]() if backend in fixes else contextlib.nullcontext():
        return model.generate(**inputs, **kwargs)


@dataclass
class GenerationTrace:
    """A traced `generate()` call: the trace (iteration 0 the prefill, i the i-th decode step),
    the buffers that are KV cache, where the blocks are, the model's weights, and which
    data-dependent questions the fixed-shape rule answered (site -> times)."""

    trace: Trace
    kv_buffers: list[int]
    blocks_path: str
    layers: int
    parameters: int
    answered: dict[str, int] = field(default_factory=dict)


def capture_generation(config: PretrainedConfig, setup: TrainingSetup, gen: GenerationSetup,
                       device: str = "cuda", tp: int = 1) -> GenerationTrace:
    """The `generate()` call of `gen` on `config` under the model fields of `setup`, traced on
    fake tensors for `device` (module docstring); with `tp` > 1, rank 0 of transformers'
    tensor-parallel model on a fake process group (`memplan.inference.gen_parallel`)."""
    with gen_parallel.tensor_parallel_rank0(tp), FakeTensorMode(allow_non_fake_inputs=True):
        model = build_generation_model(config, setup)
        if tp > 1:
            model = gen_parallel.tensor_parallel_model(model, tp)
        inputs = generation_inputs(config, gen)
        rec = DistributedRecorder(record_flops=True) if tp > 1 else Recorder(record_flops=True)
        kv: set[int] = set()
        answers = FixedShapeAnswers(gen.total_len)
        forwards = [0]

        def count_forward(_module: torch.nn.Module, _args: Any) -> None:
            rec.iteration = forwards[0]
            forwards[0] += 1

        hook = model.register_forward_pre_hook(count_forward)

        def call() -> None:
            with contextlib.ExitStack() as stack:
                stack.enter_context(answers)
                stack.enter_context(gen_caches.cache_buffers(rec, kv))
                if device == "cuda":
                    stack.enter_context(kernels_as_on_cuda())
                    stack.enter_context(gen_caches.offloaded_as_on_cuda())
                run_generate(model, inputs, gen)

        try:
            trace = capture(call, model=model, inputs=inputs, recorder=rec,
                            meta={"generation": gen.to_dict(), "setup": setup.to_dict(), "device": device,
                                  "fake": True, "fixed_shape": True, "tp": tp,
                                  "logits_to_keep": bool(model._supports_logits_to_keep())})
        finally:
            hook.remove()
        parameters = int(sum(weight_count(p) for p in model.parameters()))
        blocks_path = transformer_blocks_path(model)
        layers = len(transformer_blocks(model))
    if device == "cuda":
        trace.devices = ["cuda:0" if name == "cpu" else name for name in trace.devices]
    return GenerationTrace(trace, sorted(kv), blocks_path, layers, parameters, dict(answers.answered))
