"""The job's declaration (memplan.models.fields): each field's flag, type, choices and default
come from the dataclasses themselves, and library errors name fields the CLI spells as flags."""

from dataclasses import dataclass
from typing import Literal

import pytest

from memplan.errors import UserError
from memplan.models.fields import check_choices, declared, flags_in_message, flags_of, option
from memplan.models.setup import PRECISIONS, TrainingSetup
from memplan.parallel.layout import DeepSpeedConfig, Layout


@dataclass
class Inner:
    size: int = option(10, "a size", "deepspeed", flag="--in-size")


@dataclass
class Job:
    colour: Literal["red", "blue"] = option("red", "a colour", "model")
    names: tuple[str, ...] | None = option(None, "names", "adapters")
    keep: bool = option(True, "keep it", "optimizer")
    inner: Inner = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.inner = self.inner or Inner()


def test_a_declared_field_takes_its_type_choices_default_and_flag_from_the_dataclass():
    colour, names, keep, size = declared(Job)
    assert (colour.flag, colour.choices, colour.default, colour.section) == ("--colour", ("red", "blue"), "red", "model")
    assert (names.kind, names.optional, names.parse("a, b")) == (tuple, True, ("a", "b"))
    assert keep.flag == "--no-keep"  # a field on by default is turned off by its flag
    assert (size.dotted, size.flag, size.dest) == ("inner.size", "--in-size", "in_size")


def test_flags_of_spells_only_the_fields_that_differ_from_their_defaults():
    job = Job(colour="blue", names=("a", "b"), keep=False, inner=Inner(5))
    assert flags_of(job) == ["--colour", "blue", "--names", "a,b", "--no-keep", "--in-size", "5"]
    assert flags_of(Job()) == []


def test_a_value_outside_its_literal_choices_is_a_user_error_naming_the_field():
    with pytest.raises(UserError, match="`colour` must be one of red, blue, not 'green'"):
        check_choices(Job(colour="green"))  # type: ignore[arg-type]


def test_the_setup_s_choices_are_its_literal_types():
    precision = next(f for f in declared(TrainingSetup) if f.name == "precision")
    assert precision.choices == PRECISIONS and precision.default == "bf16-mixed"


def test_deepspeed_knobs_are_a_nested_section_of_the_layout_with_their_ds_flags():
    knobs = [f for f in declared(Layout) if f.path[0] == "deepspeed"]
    assert [f.flag for f in knobs] == ["--ds-reduce-bucket-size", "--ds-prefetch-bucket-size",
                                       "--ds-param-persistence-threshold", "--ds-max-live-parameters",
                                       "--ds-overlap-comm"]
    layout = Layout(world_size=2, zero=2, deepspeed=DeepSpeedConfig(reduce_bucket_size=1000, overlap_comm=True))
    assert flags_of(layout) == ["--world-size", "2", "--zero", "2", "--ds-reduce-bucket-size", "1000",
                                "--ds-overlap-comm"]


def test_a_library_error_names_fields_and_the_cli_spells_them_as_flags():
    message = "use `grad_accum=1`, add `lora_rank=R`, `frozen_base=True` or `kbit_prep=False`; leave `tp` out"
    assert flags_in_message(message, TrainingSetup, Layout) == \
        "use --grad-accum 1, add --lora-rank R, --frozen-base or --no-kbit-prep; leave --tp out"
    assert flags_in_message("`deepspeed.overlap_comm` and `nothing`", Layout) == "--ds-overlap-comm and `nothing`"
