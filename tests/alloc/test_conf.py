"""Parsing PYTORCH_CUDA_ALLOC_CONF as PyTorch does, refusing what PyTorch refuses."""

from __future__ import annotations

import pytest

from memplan.alloc import AllocConf
from memplan.alloc.conf import UNLIMITED, roundup_power2_next_division
from memplan.errors import UserError

MiB = 1 << 20


def test_empty_conf_gives_the_defaults() -> None:
    conf = AllocConf.parse(None)
    assert conf == AllocConf.parse("") == AllocConf()
    assert conf.max_split_size_bytes == UNLIMITED
    assert conf.max_non_split_rounding_bytes == 20 * MiB
    assert conf.roundup_power2_divisions == (0,) * 16
    assert not conf.expandable_segments and conf.garbage_collection_threshold == 0.0


def test_all_options_parse_with_spaces() -> None:
    conf = AllocConf.parse(
        "max_split_size_mb:128, max_non_split_rounding_mb:64,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:4,expandable_segments:True,release_lock_on_cudamalloc:False"
    )
    assert conf.max_split_size_bytes == 128 * MiB
    assert conf.max_non_split_rounding_bytes == 64 * MiB
    assert conf.garbage_collection_threshold == 0.6
    assert conf.roundup_power2_divisions == (4,) * 16
    assert conf.expandable_segments


def test_bracket_divisions_fill_below_the_first_interval_and_from_the_last_with_gt() -> None:
    conf = AllocConf.parse("roundup_power2_divisions:[64:8,256:4,>:1]")
    # 64 MiB is interval 6, 256 MiB interval 8; '>' fills from interval 8 on (as upstream).
    assert conf.roundup_power2_divisions == (8,) * 7 + (0,) + (1,) * 8


def test_bracket_divisions_without_gt_leave_later_intervals_alone() -> None:
    conf = AllocConf.parse("roundup_power2_divisions:[1:2,4:8]")
    assert conf.roundup_power2_divisions[:3] == (2, 0, 8)
    assert conf.roundup_power2_divisions[3:] == (0,) * 13


def test_next_division_examples() -> None:
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(1024, 4) == 1024
    assert roundup_power2_next_division(1280, 4) == 1280


@pytest.mark.parametrize(
    "text",
    [
        "max_split_size_mb:10",
        "max_split_size_mb:abc",
        "max_split_size_mb",
        "max_non_split_rounding_mb:19",
        "garbage_collection_threshold:1.0",
        "garbage_collection_threshold:0",
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:[64:3]",
        "roundup_power2_divisions:[63:4]",
        "roundup_power2_divisions:[64:4",
        "expandable_segments:yes",
        "backend:cudaMallocAsync",
        "no_such_option:1",
        "max_split_size_mb:128 expandable_segments:True",
    ],
)
def test_values_pytorch_refuses_are_user_errors(text: str) -> None:
    with pytest.raises(UserError, match="alloc-conf"):
        AllocConf.parse(text)


def test_error_names_the_minimum_of_max_split_size() -> None:
    with pytest.raises(UserError, match="must be >= 20"):
        AllocConf.parse("max_split_size_mb:10")
