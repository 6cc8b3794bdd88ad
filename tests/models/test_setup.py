"""TrainingSetup: defaults, validation, command-line flags, metadata round trip."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memplan.cli.flags import add_setup_flags, setup_from_args
from memplan.errors import UserError
from memplan.models import TrainingSetup
from memplan.models.setup import (
    ATTENTIONS,
    AUTOCASTS,
    CHECKPOINTINGS,
    HEADS,
    OPTIMIZER_IMPLS,
    PRECISIONS,
    TORCH_OPTIMIZERS,
    ZERO_GRADS,
)


def parse(argv: list[str]) -> TrainingSetup:
    parser = argparse.ArgumentParser()
    add_setup_flags(parser)
    return setup_from_args(parser.parse_args(argv))


def test_defaults_are_what_pytorch_and_hf_do_unasked():
    setup = TrainingSetup()
    assert (setup.batch, setup.seq, setup.grad_accum) == (1, None, 1)
    assert (setup.precision, setup.dtype, setup.autocast_dtype) == ("bf16-mixed", "fp32", "bf16")
    assert (setup.optimizer, setup.optimizer_impl) == ("adamw", None)
    assert (setup.checkpointing, setup.lora_rank, setup.attn) == ("none", 0, "sdpa")
    assert setup.zero_grad == "none"  # set_to_none=True, PyTorch >= 2.0


def test_no_flags_give_the_dataclass_defaults():
    assert parse([]) == TrainingSetup()


@pytest.mark.parametrize(("precision", "dtype", "autocast"), [
    ("32-true", "fp32", "none"), ("bf16-mixed", "fp32", "bf16"), ("16-mixed", "fp32", "fp16"),
    ("bf16-true", "bf16", "none"), ("16-true", "fp16", "none"),
])
def test_a_precision_is_lightnings_weights_dtype_and_autocast(precision, dtype, autocast):
    setup = TrainingSetup(precision=precision)
    assert (setup.dtype, setup.autocast_dtype) == (dtype, autocast)
    assert TrainingSetup.from_dtypes(dtype, autocast) == setup


def test_half_weights_under_autocast_are_a_true_precision_with_an_autocast():
    # axolotl's bf16: true and TRL's torch_dtype=bfloat16 with bf16=True: bf16 weights, bf16 autocast
    setup = TrainingSetup.from_dtypes("bf16", "bf16")
    assert (setup.precision, setup.autocast, setup.dtype, setup.autocast_dtype) == ("bf16-true", "bf16", "bf16", "bf16")


def test_a_setup_recorded_before_precisions_reads_as_its_precision():
    old = {**TrainingSetup().to_dict(), "dtype": "fp32", "autocast": "none"}
    del old["precision"]
    assert TrainingSetup.from_dict(old).precision == "32-true"


def test_every_flag_parses_into_the_setup():
    setup = parse(["--batch", "4", "--seq", "2048", "--precision", "bf16-true", "--autocast", "fp16",
                   "--optimizer", "adafactor", "--optimizer-impl", "foreach",
                   "--checkpointing", "selective", "--lora-rank", "8", "--grad-accum", "3",
                   "--attn", "flash", "--zero-grad", "zeros"])
    assert setup == TrainingSetup(batch=4, seq=2048, precision="bf16-true", autocast="fp16",
                                  optimizer="adafactor", optimizer_impl="foreach",
                                  checkpointing="selective", lora_rank=8, grad_accum=3, attn="flash",
                                  zero_grad="zeros")


def test_a_flag_value_outside_its_choices_exits_with_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        parse(["--precision", "fp8"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--grad-accum", "0"], ["--seq", "-5"],
                                  ["--lora-rank", "-1"]])
def test_impossible_numbers_are_user_errors(argv):
    with pytest.raises(UserError, match=">="):
        parse(argv)


def test_fused_adafactor_is_a_user_error():
    with pytest.raises(UserError, match="Adafactor has no fused"):
        TrainingSetup(precision="32-true", optimizer="adafactor", optimizer_impl="fused")


def test_unknown_precision_is_a_user_error():
    with pytest.raises(UserError, match="`precision` must be one of bf16-mixed, 32-true"):
        TrainingSetup(precision="float32")


def test_optimizer_impl_defaults_to_foreach_on_cuda_and_loop_elsewhere():
    setup = TrainingSetup(precision="32-true")
    assert setup.resolved_optimizer_impl("cuda") == "foreach"
    assert setup.resolved_optimizer_impl("cuda:3") == "foreach"
    assert setup.resolved_optimizer_impl("cpu") == "loop"
    assert TrainingSetup(precision="32-true", optimizer_impl="fused").resolved_optimizer_impl("cpu") == "fused"


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(UserError, match="unknown training setup field.*bacth"):
        TrainingSetup.from_dict({"bacth": 2})


setups = st.builds(
    TrainingSetup,
    batch=st.integers(1, 64),
    seq=st.none() | st.integers(1, 1 << 17),
    precision=st.sampled_from(PRECISIONS),
    autocast=st.none() | st.sampled_from(AUTOCASTS),
    optimizer=st.sampled_from([o for o in TORCH_OPTIMIZERS if o != "adafactor"]),
    optimizer_impl=st.none() | st.sampled_from(OPTIMIZER_IMPLS),
    checkpointing=st.sampled_from(CHECKPOINTINGS),
    lora_rank=st.integers(0, 64),
    grad_accum=st.integers(1, 16),
    attn=st.sampled_from(ATTENTIONS),
    allow_long_seq=st.booleans(),
    lora_targets=st.none() | st.lists(st.sampled_from(["q_proj", "v_proj", "c_attn"]), min_size=1).map(tuple),
    head=st.sampled_from(HEADS),
    num_labels=st.integers(1, 1000),
    zero_grad=st.sampled_from(ZERO_GRADS),
)


@given(setups)
def test_to_dict_and_from_dict_round_trip(setup):
    import json

    assert TrainingSetup.from_dict(json.loads(json.dumps(setup.to_dict()))) == setup


@pytest.mark.parametrize(("fields", "message"), [
    ({"quant": "nf4"}, "full fine-tuning cannot train nf4-quantised weights"),
    ({"double_quant": True}, "describe a quantised base"),
    ({"quant": "int8", "lora_rank": 8, "double_quant": True}, "4-bit options"),
    ({"optimizer_in_backward": True, "grad_accum": 4}, "use `grad_accum=1`"),
    ({"loss": "fused-linear", "head": "seq-cls"}, "use `loss=full`"),
    ({"dora": True}, "add `lora_rank=R`"),
    ({"lora_rank": 4, "lora_targets": ("all-linear", "lm_head")}, "stands alone"),
    ({"optimizer": "adamw8bit", "optimizer_impl": "fused"}, "leave `optimizer_impl` out"),
    ({"loss": "chunked:0"}, "chunked:N"),
    ({"cpu_offload": "optimizer", "optimizer": "adamw8bit"}, "use `optimizer=adamw or adam` with `cpu_offload`"),
    ({"cpu_offload": "params", "optimizer_in_backward": True}, "use one of them"),
    ({"cpu_offload": "optimizer", "zero_grad": "zeros"}, "use `zero_grad=none`"),
])
def test_techniques_that_do_not_go_together_are_user_errors(fields, message):
    with pytest.raises(UserError, match=message):
        TrainingSetup(**fields)


def test_a_chunked_loss_has_torchtunes_eight_chunks_unless_told():
    assert TrainingSetup(precision="32-true", loss="chunked").loss_chunks() == 8
    assert TrainingSetup(precision="32-true", loss="chunked:16").loss_chunks() == 16
    assert TrainingSetup(precision="32-true", loss="fused-linear").loss_chunks() == 1


def test_technique_flags_parse_into_the_setup():
    setup = parse(["--quant", "nf4", "--double-quant", "--lora-rank", "16", "--lora-targets", "all-linear",
                   "--compile", "--activation-offload", "--loss", "chunked:4", "--dora", "--lora-alpha", "8"])
    assert (setup.quant, setup.double_quant, setup.lora_targets) == ("nf4", True, ("all-linear",))
    assert (setup.compile, setup.activation_offload, setup.loss) == ("blocks", "torchtune", "chunked:4")
    assert (setup.dora, setup.lora_alpha) == (True, 8.0)
