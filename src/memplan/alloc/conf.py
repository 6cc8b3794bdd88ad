"""`PYTORCH_CUDA_ALLOC_CONF` as the caching allocator reads it, and its size rounding.

Follows PyTorch's own parser (`c10/core/AllocatorConfig.cpp`, `parseArgs` and the
`parse*` helpers): the string is split into tokens at `,` `:` `[` `]` (spaces
dropped), options are `name:value` pairs separated by commas, and every value
PyTorch would refuse is refused here too, as a `UserError` naming the option:
`max_split_size_mb` and `max_non_split_rounding_mb` below 20, a
`garbage_collection_threshold` outside (0, 1), `roundup_power2_divisions` that are
not powers of two, an `expandable_segments` value other than `True`/`False`, an
unknown option.

Options that change nothing a trace replay can see (`release_lock_on_cudamalloc`,
the `pinned_*` host-memory options, `backend:native`) are accepted and ignored;
`backend:cudaMallocAsync` is refused because that allocator is not modelled.

Also here, as the one owner of the allocator's size rounding (`c10/cuda/
CUDACachingAllocator.cpp`: `kMinBlockSize`, `round_size`,
`roundup_power2_next_division`): `AllocConf.round_size` (512-byte multiples, or
power-of-two divisions, since it depends on the configuration), `round_size_plain`
(the same without divisions) and `align_up_to_min_block` (an offset or size up to the
next 512-byte boundary). Every other part of `memplan.alloc` rounds through these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memplan.errors import UserError

MiB = 1024 * 1024
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded to a multiple of this, at least one
K_LARGE_BUFFER = 20 * MiB  # minimum of max_split_size_mb and max_non_split_rounding_mb
NUM_ROUNDUP_INTERVALS = 16  # power-of-two intervals from 1 MiB up to 64 GiB
ROUNDUP_START_LOG2 = 20  # the first interval is [1 MiB, 2 MiB)
UNLIMITED = 2**63 - 1  # "no max_split_size": PyTorch uses SIZE_MAX


@dataclass(frozen=True)
class AllocConf:
    """The allocator settings a `PYTORCH_CUDA_ALLOC_CONF` string selects.

    `roundup_power2_divisions[i]` is the number of divisions for request sizes in
    [2**(20+i), 2**(21+i)) bytes; the first entry also applies below 1 MiB and the
    last one above 64 GiB, as in PyTorch. 0 (or 1) means plain 512-byte rounding.
    """

    max_split_size_bytes: int = UNLIMITED
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * NUM_ROUNDUP_INTERVALS)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False

    @classmethod
    def parse(cls, text: str | None) -> AllocConf:
        """Parse a `PYTORCH_CUDA_ALLOC_CONF` string; `None` or "" gives the defaults."""
        if not text:
            return cls()
        return _Parser(text).parse()

    def divisions_for(self, nbytes: int) -> int:
        """Power-of-two divisions that apply to a request of `nbytes` (0: none)."""
        index = max(nbytes, 1).bit_length() - 1 - ROUNDUP_START_LOG2
        index = min(max(index, 0), NUM_ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    def round_size(self, nbytes: int) -> int:
        """The block size the caching allocator reserves for a request of `nbytes`."""
        if nbytes < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        divisions = self.divisions_for(nbytes)
        if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
            return roundup_power2_next_division(nbytes, divisions)
        return align_up_to_min_block(nbytes)


def align_up_to_min_block(nbytes: int) -> int:
    """The smallest multiple of K_MIN_BLOCK_SIZE that is >= `nbytes` (0 stays 0)."""
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def round_size_plain(nbytes: int) -> int:
    """`round_size` with no roundup_power2_divisions: at least K_MIN_BLOCK_SIZE, in its multiples."""
    return K_MIN_BLOCK_SIZE if nbytes < K_MIN_BLOCK_SIZE else align_up_to_min_block(nbytes)


def roundup_power2_next_division(nbytes: int, divisions: int) -> int:
    """Round up to the next of `divisions` equal steps between two powers of two.

    1200 with 4 divisions lies in [1024, 2048), whose steps are 1024, 1280, 1536,
    1792: the answer is 1280. Powers of two are returned unchanged.
    """
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    power2_floor = 1 << (nbytes.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = nbytes & ~(step - 1)
    return nbytes if floor == nbytes else floor + step


def _is_power_of_2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class _Parser:
    """Token-by-token reading of one configuration string, as AllocatorConfig::parseArgs."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        buf = ""
        for ch in text:
            if ch in ",:[]":
                if buf:
                    self.tokens.append(buf)
                    buf = ""
                self.tokens.append(ch)
            elif ch != " ":
                buf += ch
        if buf:
            self.tokens.append(buf)
        self.i = 0

    def fail(self, why: str) -> UserError:
        return UserError(f"alloc-conf {self.text!r}: {why} (PyTorch would refuse it)")

    def expect(self, token: str) -> None:
        if self.i >= len(self.tokens) or self.tokens[self.i] != token:
            got = self.tokens[self.i] if self.i < len(self.tokens) else "end of string"
            raise self.fail(f"expected '{token}' but found '{got}'")
        self.i += 1

    def value(self, option: str) -> str:
        self.expect(":")
        if self.i >= len(self.tokens) or self.tokens[self.i] in ",:[]":
            raise self.fail(f"expecting a value for {option}")
        self.i += 1
        return self.tokens[self.i - 1]

    def integer(self, option: str, token: str) -> int:
        try:
            return int(token)
        except ValueError:
            raise self.fail(f"{option} needs an integer, not '{token}'") from None

    def parse(self) -> AllocConf:
        settings: dict[str, object] = {}
        while self.i < len(self.tokens):
            option = self.tokens[self.i]
            self.i += 1
            if option in ("max_split_size_mb", "max_non_split_rounding_mb"):
                mb = self.integer(option, self.value(option))
                if mb < K_LARGE_BUFFER // MiB:
                    raise self.fail(f"{option} is {mb}, it must be >= {K_LARGE_BUFFER // MiB}")
                key = "max_split_size_bytes" if option == "max_split_size_mb" else "max_non_split_rounding_bytes"
                settings[key] = min(mb * MiB, UNLIMITED)
            elif option == "garbage_collection_threshold":
                token = self.value(option)
                try:
                    threshold = float(token)
                except ValueError:
                    raise self.fail(f"{option} needs a number, not '{token}'") from None
                if not (0.0 < threshold < 1.0) or math.isnan(threshold):
                    raise self.fail(f"{option} is {token}, it must be in (0.0, 1.0)")
                settings["garbage_collection_threshold"] = threshold
            elif option == "roundup_power2_divisions":
                settings["roundup_power2_divisions"] = self.roundup_divisions()
            elif option == "expandable_segments":
                token = self.value(option)
                if token not in ("True", "False"):
                    raise self.fail(f"expandable_segments must be True or False, not '{token}'")
                settings["expandable_segments"] = token == "True"
            elif option == "backend":
                token = self.value(option)
                if token == "cudaMallocAsync":
                    raise self.fail("backend:cudaMallocAsync is not modelled; use backend:native")
                if token != "native":
                    raise self.fail(f"unknown allocator backend '{token}': options are native and cudaMallocAsync")
            elif option in ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                            "pinned_use_background_threads"):
                token = self.value(option)
                if token not in ("True", "False"):
                    raise self.fail(f"{option} must be True or False, not '{token}'")
            elif option == "pinned_num_register_threads":
                threads = self.integer(option, self.value(option))
                if not _is_power_of_2(threads):
                    raise self.fail(f"{option} must be a power of 2, not {threads}")
            else:
                raise self.fail(f"unrecognized option '{option}'")
            if self.i < len(self.tokens):
                self.expect(",")
        return AllocConf(**settings)  # type: ignore[arg-type]

    def roundup_divisions(self) -> tuple[int, ...]:
        option = "roundup_power2_divisions"
        self.expect(":")
        if self.i >= len(self.tokens):
            raise self.fail(f"expecting a value for {option}")
        if self.tokens[self.i] != "[":
            divisions = self.integer(option, self.tokens[self.i])
            self.i += 1
            if not _is_power_of_2(divisions):
                raise self.fail(f"{option} must be a power of 2, not {divisions}")
            return (divisions,) * NUM_ROUNDUP_INTERVALS
        # Bracket syntax [64:8,256:4,>:1]: interval starts in MiB (powers of two) -> divisions.
        table = [0] * NUM_ROUNDUP_INTERVALS
        self.i += 1
        first = True
        last_index = 0
        while True:
            if self.i >= len(self.tokens):
                raise self.fail(f"{option} list is missing its closing ']'")
            key = self.tokens[self.i]
            if key == "]":
                self.i += 1
                break
            self.i += 1
            token = self.value(option)
            divisions = self.integer(option, token)
            if divisions != 0 and not _is_power_of_2(divisions):
                raise self.fail(f"{option} divisions must be a power of 2 or 0, not {divisions}")
            if key == ">":
                # As upstream: '>' fills from the last listed interval onwards, that one included.
                for j in range(last_index, NUM_ROUNDUP_INTERVALS):
                    table[j] = divisions
            else:
                start_mb = self.integer(option, key)
                if not _is_power_of_2(start_mb):
                    raise self.fail(f"{option} interval '{key}' must be a power of 2 (in MiB)")
                index = min(start_mb.bit_length() - 1, NUM_ROUNDUP_INTERVALS - 1)
                if first:
                    for j in range(index):
                        table[j] = divisions
                    first = False
                table[index] = divisions
                last_index = index
            if self.i < len(self.tokens) and self.tokens[self.i] != "]":
                self.expect(",")
        return tuple(table)
