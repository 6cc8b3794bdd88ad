"""Bad input the CLI refuses in one line with exit code 2 (nothing on stdout), saying what
is wrong and what would be right."""

import pytest

from memplan import models
from memplan.cli import main


@pytest.fixture
def tiny_gpt2(tmp_path):
    path = tmp_path / "tiny-gpt2.json"
    models.tiny_config("gpt2").to_json_file(str(path))
    return str(path)


@pytest.mark.parametrize(("text", "message"), [
    ('{"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}',
     "model type 'mamba' has no attention heads; memplan builds attention-block language models"),
    ('{"model_type": "llama", "hidden_size": 64}', "lacks num_hidden_layers, num_attention_heads, vocab_size"),
])
def test_a_config_memplan_cannot_build_is_one_line_and_exit_2(capsys, tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    code = main(["estimate", str(path), "--device", "cpu", "--allocator", "none"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


def test_a_lora_target_that_matches_nothing_names_the_modules_that_exist(capsys, tiny_gpt2):
    code = main(["estimate", tiny_gpt2, "--seq", "16", "--device", "cpu", "--allocator", "none", "--lora-rank", "4",
                 "--lora-targets", "c_attn,q_proj"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "LoRA target q_proj matches no module" in err and "c_attn" in err.split("named")[1]


def test_a_misspelt_trainer_key_names_the_closest_known_key(capsys, tmp_path, tiny_gpt2):
    path = tmp_path / "axolotl.yml"
    path.write_text(f"base_model: {tiny_gpt2}\nmicro_batch_sise: 8\n")
    code = main(["estimate", "--from", str(path), "--device", "cpu", "--allocator", "none"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "unknown key 'micro_batch_sise': did you mean 'micro_batch_size'?" in err
