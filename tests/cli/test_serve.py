"""`memplan serve`: the terms on stdout, one JSON object, vLLM's refusal as exit 2."""

import json

from memplan.cli import main


def test_llama_3_1_8b_on_h100_prints_every_term(capsys):
    code = main(["serve", "meta-llama/Llama-3.1-8B-Instruct", "--engine", "vllm", "--gpu", "h100-80gb",
                 "--max-model-len", "32768"])
    out = capsys.readouterr().out
    assert code == 0
    for term in ("weights", "activation peak", "CUDA graphs", "non-torch", "KV cache", "max concurrency",
                 "starts:"):
        assert term in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_json_is_one_object_and_underscore_flags_are_the_engines_spelling(capsys):
    code = main(["serve", "llama-3.2-1b", "--max_model_len", "8192", "--gpu_memory_utilization", "0.5",
                 "--tensor_parallel_size", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["settings"]["max_model_len"] == 8192
    assert result["settings"]["gpu_memory_utilization"] == 0.5 and result["settings"]["tp"] == 2


def test_a_context_that_does_not_fit_exits_2_with_vllms_message_and_the_longest_that_fits(capsys):
    code = main(["serve", "llama-3.1-8b", "--gpu", "l4", "--max-model-len", "131072"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "To serve at least one request with the models's max seq len (131072)" in err
    assert "the longest --max-model-len that starts:" in err
