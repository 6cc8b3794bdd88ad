"""Every estimate says back what it assumed (memplan.estimation.assumptions): the precision
and how it was traced, where the weights and optimizer states live and in which dtype, each
default filled in, and the large terms people do not expect."""

import json

from memplan import models
from memplan.cli import main
from memplan.estimation import estimate
from memplan.estimation.assumptions import surprising_terms
from memplan.models.registry import load_config
from memplan.parallel import Layout

TINY = models.tiny_config("llama-2-7b")


def test_bf16_mixed_under_zero_3_on_one_gpu_is_fsdp2_traced_on_one_rank():
    setup = models.TrainingSetup(batch=2, seq=32)
    result = estimate(TINY, setup, Layout(world_size=1, zero=3), device="cpu", allocator="none")
    assert result.parallel == "traced" and result.setup["precision"] == "bf16-mixed"
    assert "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" in result.assumptions["precision"]
    plain = estimate(TINY, setup, Layout(), device="cpu", allocator="none")
    assert plain.parallel == "single device" and "bf16 autocast" in plain.assumptions["precision"]


def test_the_cli_prints_the_precision_the_optimizer_states_and_each_default_it_filled(capsys, tmp_path):
    config = tmp_path / "tiny.json"
    TINY.to_json_file(str(config))
    assert main(["estimate", str(config), "--batch", "2", "--device", "cpu", "--allocator", "none"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "assumed: bf16-mixed: fp32 weights and gradients, bf16 autocast" in out
    assert "optimizer states: adamw: 2 fp32 states per trainable parameter" in out
    defaults = out.split("defaults filled (give the flag to change one): ")[1]
    assert defaults.startswith("--seq 256 (the model's max positions), --precision bf16-mixed, --optimizer adamw")
    assert "--batch" not in defaults  # given on the command line
    assert main(["estimate", str(config), "--batch", "2", "--device", "cpu", "--allocator", "none", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["assumptions"]["defaults"]["precision"] == "bf16-mixed" and "seq" in doc["assumptions"]["defaults"]


def test_peft_s_kbit_preparation_and_the_fp32_logits_are_explained_with_their_size():
    config = load_config("llama-3.1-8b")  # 128,256 x 4,096 embedding and LM head, untied
    qlora = models.TrainingSetup(quant="nf4", lora_rank=16, seq=2048)
    notes = surprising_terms(config, qlora, Layout())
    # 2 x 128,256 x 4,096 x 4 B = 4,202,692,608 B
    assert any("casts the unquantised embedding and LM head to fp32: 3.91 GiB" in n for n in notes)
    # 1 x 2,048 x 128,256 x 4 B = 1,050,673,152 B
    assert any("logits to fp32: 1002 MiB" in n for n in notes)
    assert surprising_terms(config, models.TrainingSetup(seq=2048, loss="chunked"), Layout()) == []
