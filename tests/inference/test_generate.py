"""`memplan.estimate_generation`: a transformers generate() call traced on fake tensors.

The CPU ground truth: a real `generate()` call with min_new_tokens = max_new_tokens (the
fixed-shape rule) on the host's CPU, measured by torch.profiler's memory timeline, against
`estimate_generation(..., device="cpu", allocator="none")`, within 1%: a dense GQA model, a
sliding-window model, two mixtures of experts, an MLA model, each cache class that runs on
a CPU, beams, sampling, and a bitsandbytes 4-bit base.
"""

import json

import pytest

import memplan
from memplan import models
from memplan.capture.groundtruth import profiler_peak_bytes
from memplan.cli import main
from memplan.errors import UserError
from memplan.inference.gen_capture import (
    GenerationSetup,
    build_generation_model,
    generation_inputs,
    model_setup,
    run_generate,
)
from memplan.inference.gen_fixed import FixedShapeAnswers
from memplan.inference.generate import estimate_generation

SHORT = {"batch": 2, "input_len": 16, "new_tokens": 4}
# with a 12-token sliding window, 16 + 4 tokens run past it
WINDOW = {"sliding_window": 12}

CASES = [
    ("llama-2-7b", SHORT, {}, {}),
    ("llama-2-7b", {**SHORT, "cache": "static"}, {}, {}),
    ("llama-2-7b", {**SHORT, "beams": 3, "num_return_sequences": 2}, {}, {}),
    ("llama-2-7b", {**SHORT, "num_return_sequences": 3}, {}, {}),
    ("llama-2-7b", {**SHORT, "cache": "quantized:fp8"}, {}, {}),
    ("llama-2-7b", {**SHORT, "cache": "quantized:int4"}, {}, {}),
    ("llama-2-7b", SHORT, {"quant": "nf4", "dtype": "bf16"}, {}),
    ("mistral-7b", SHORT, {}, WINDOW),
    ("mistral-7b", {**SHORT, "cache": "sliding"}, {}, WINDOW),
    ("qwen3-30b-a3b", SHORT, {}, {}),
    ("deepseek-v2-lite", SHORT, {}, {}),
]


@pytest.mark.parametrize(("family", "call", "fields", "overrides"), CASES)
def test_cpu_generation_estimate_matches_the_profiler_peak_of_a_real_generate_call_within_one_percent(
        family, call, fields, overrides):
    config = models.tiny_config(family, **overrides)
    generation = GenerationSetup(**call)
    model = build_generation_model(config, model_setup(fields))
    inputs = generation_inputs(config, generation)
    run_generate(model, inputs, generation)  # warm-up, as a served model has run before
    truth = profiler_peak_bytes(lambda: run_generate(model, inputs, generation))
    predicted = estimate_generation(config, generation, fields, device="cpu", allocator="none").peak_allocated_bytes
    assert abs(predicted - truth) / truth <= 0.01, f"estimate {predicted} vs profiler {truth}"


def test_the_offloaded_cache_keeps_one_of_two_layers_in_pinned_host_memory_at_the_final_length():
    config = models.tiny_config("llama-2-7b")  # 2 layers, 4 KV heads of 16, fp32
    generation = GenerationSetup(batch=2, input_len=32, new_tokens=8, cache="offloaded")
    result = estimate_generation(config, generation, allocator="none")
    keys_and_values = 2 * 2 * 4 * (32 + 8 - 1) * 16 * 4  # K and V, batch 2, 4 heads, 39 tokens, head dim 16, fp32
    assert result.host.pinned_bytes == result.host.peak_bytes == keys_and_values


def test_the_offloaded_cache_holds_less_kv_cache_on_the_gpu_than_the_dynamic_one():
    config = models.tiny_config("llama-2-7b")
    dynamic, offloaded = (estimate_generation(config, GenerationSetup(batch=2, input_len=32, new_tokens=8, cache=c),
                                              allocator="none") for c in ("dynamic", "offloaded"))
    assert offloaded.breakdown["kv_cache"] < dynamic.breakdown["kv_cache"]


def test_the_static_cache_holds_batch_times_beams_rows_of_the_whole_length_from_the_prefill():
    config = models.tiny_config("llama-2-7b")
    generation = GenerationSetup(batch=2, input_len=16, new_tokens=4, cache="static", beams=3)
    result = estimate_generation(config, generation, device="cpu", allocator="none")
    # 2 layers x K and V x (2 x 3) rows x 4 heads x (16 + 4 - 1) positions x 16 x fp32
    assert result.breakdown["kv_cache"] == 2 * 2 * 6 * 4 * 19 * 16 * 4


def test_the_int4_cache_holds_its_codes_two_to_a_byte_with_a_scale_and_a_shift_per_group_of_64():
    config = models.tiny_config("llama-2-7b")  # 2 layers, 4 KV heads of 16, fp32
    result = estimate_generation(config, GenerationSetup(**SHORT, cache="quantized:int4"), device="cpu",
                                 allocator="none")
    assert result.peak_phase == "prefill"  # the prompt quantised, no token yet in the full-precision window
    values = 2 * 4 * 16 * 16  # batch 2 x 4 heads x 16 prompt tokens x head dim 16, per layer's keys or values
    per_tensor = values // 2 + 2 * (values // 64) * 4  # packed codes, then fp32 scale and shift per group
    assert result.breakdown["kv_cache"] == 2 * 2 * per_tensor  # 2 layers x keys and values


def test_the_block_extrapolation_of_a_deep_model_matches_its_full_depth_trace():
    config = models.tiny_config("llama-2-7b", num_hidden_layers=6)
    generation = GenerationSetup(batch=2, input_len=64, new_tokens=4)
    full, extrapolated = (estimate_generation(config, generation, {"dtype": "bf16"}, gpu="h100-80gb", extrapolate=e)
                          for e in (False, True))
    assert extrapolated.method == "extrapolated" and full.method == "full"
    assert abs(extrapolated.peak_allocated_bytes - full.peak_allocated_bytes) <= 0.001 * full.peak_allocated_bytes


def test_a_data_dependent_question_from_outside_transformers_is_refused():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), FixedShapeAnswers(max_length=8):
        flag = torch.ones(2).sum() > 0
        with pytest.raises(UserError, match="outside transformers' code"):
            bool(flag)


def test_estimate_generation_is_exported_from_memplan():
    assert memplan.estimate_generation is estimate_generation


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_is_one_object_whose_breakdown_adds_up_to_the_peak(capsys):
    code, out, _ = run_cli(capsys, "generate", "gpt2", "--input-len", "32", "--new-tokens", "4", "--gpu", "t4",
                           "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data["breakdown"]) == {"weights", "kv_cache", "activations", "other"}
    assert sum(data["breakdown"].values()) == data["peak_allocated_bytes"]
    assert data["peak_allocated_bytes"] <= data["peak_reserved_bytes"] < data["device_used_bytes"]
    assert data["fits"] is True and data["margin_bytes"] == data["capacity_bytes"] - data["device_used_bytes"]
    assert data["peak_phase"] == "prefill" or data["peak_phase"].startswith("decode step ")
    assert any("min_new_tokens = max_new_tokens" in a for a in data["assumptions"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--cache", "offloaded", "--device", "cpu"], "use --device cuda"),
    (["--cache", "sliding"], "has none: use --cache static"),
    (["--beams", "2", "--num-return-sequences", "2"], "not allowed with argument"),
    (["--tp", "2"], "no tensor-parallel plan for model type 'gpt2'"),
])
def test_generate_refuses_what_it_cannot_estimate_in_one_line(capsys, argv, message):
    try:
        code = main(["generate", "gpt2", "--input-len", "8", "--new-tokens", "2", *argv])
    except SystemExit as exit_info:  # argparse's own usage errors
        code = exit_info.code
    assert code == 2
    assert message in capsys.readouterr().err
