"""The CLI's job flags are derived from the declaration: what `flags_of` spells, the parser
reads back into the same object, and a UserError's fields are printed as flags."""

import argparse

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.cli import main
from memplan.cli.flags import add_layout_flags, add_setup_flags, layout_from_args, setup_from_args
from memplan.errors import UserError
from memplan.models.fields import flags_of
from memplan.models.setup import (
    ATTENTIONS,
    AUTOCASTS,
    CHECKPOINTINGS,
    COMPILES,
    HEADS,
    OPTIMIZER_IMPLS,
    PRECISIONS,
    ZERO_GRADS,
    TrainingSetup,
)
from memplan.parallel.layout import DeepSpeedConfig, Layout


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_setup_flags(parser)
    add_layout_flags(parser)
    return parser


setups = st.builds(
    TrainingSetup, batch=st.integers(1, 64), seq=st.none() | st.integers(1, 1 << 17),
    precision=st.sampled_from(PRECISIONS), autocast=st.none() | st.sampled_from(AUTOCASTS), optimizer=st.sampled_from(["adamw", "sgd"]),
    optimizer_impl=st.none() | st.sampled_from(OPTIMIZER_IMPLS), checkpointing=st.sampled_from(CHECKPOINTINGS),
    lora_rank=st.integers(0, 64), grad_accum=st.integers(1, 16), attn=st.sampled_from(ATTENTIONS),
    allow_long_seq=st.booleans(), head=st.sampled_from(HEADS), num_labels=st.integers(1, 1000),
    zero_grad=st.sampled_from(ZERO_GRADS), compile=st.sampled_from(COMPILES),
    lora_targets=st.none() | st.lists(st.sampled_from(["q_proj", "v_proj", "c_attn"]), min_size=1).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(setups)
def test_the_flags_of_a_setup_parse_back_into_it(setup):
    assert setup_from_args(_parser().parse_args(flags_of(setup))) == setup


sharded = st.builds(lambda zero, tp, dp, schedule: Layout(world_size=dp * tp, zero=zero, tp=tp),
                    st.sampled_from([0, 3]), st.sampled_from([1, 2]), st.integers(1, 4), st.just("1f1b"))
deepspeed = st.builds(lambda zero, dp, bucket, overlap: Layout(
    world_size=dp, zero=zero, engine="deepspeed", deepspeed=DeepSpeedConfig(reduce_bucket_size=bucket,
                                                                            overlap_comm=overlap)),
    st.sampled_from([1, 2, 3]), st.integers(1, 4), st.integers(0, 10**9), st.booleans())


@settings(max_examples=60, deadline=None)
@given(sharded | deepspeed)
def test_the_flags_of_a_layout_parse_back_into_it(layout):
    assert layout_from_args(_parser().parse_args(flags_of(layout))) == layout


def test_a_deepspeed_size_takes_deepspeeds_own_spelling():
    args = _parser().parse_args(["--zero", "2", "--ds-reduce-bucket-size", "5e8"])
    assert layout_from_args(args).deepspeed.reduce_bucket_size == 500_000_000


def test_the_library_names_a_field_and_the_cli_prints_its_flag(capsys):
    try:
        TrainingSetup(precision="32-true", optimizer_in_backward=True, grad_accum=2)
    except UserError as exc:
        assert "use `grad_accum=1`" in str(exc)
    code = main(["estimate", "gpt2", "--optimizer-in-backward", "--grad-accum", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "use --grad-accum 1" in err and "`" not in err
