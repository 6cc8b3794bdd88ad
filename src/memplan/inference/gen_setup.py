"""One `generate()` call as memplan asks it: the prompts, the tokens generated, the cache and
beam search or sampling (`GenerationSetup`), and the cache names memplan takes with the
`cache_implementation` transformers 5.23 builds for each (`generation/configuration_utils.py`,
`ALL_CACHE_IMPLEMENTATIONS`). No torch: the command line parses with these alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memplan.errors import UserError

HQQ_INT8_BITS = 8  # HQQ's quantised cache at 8 bits (transformers' QuantizedCache, backend hqq)
CACHES = ("dynamic", "static", "sliding", "offloaded", "quantized:int4", "quantized:int8", "quantized:fp8")
# cache -> (transformers' cache_implementation, its cache_config)
CACHE_IMPLEMENTATIONS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "dynamic": ("dynamic", None),
    "static": ("static", None),
    "sliding": ("sliding_window", None),  # 5.23's (deprecated) name of a static cache with sliding layers
    "offloaded": ("offloaded", None),
    "quantized:int4": ("quantized", {"backend": "quanto", "nbits": 4}),
    "quantized:int8": ("quantized", {"backend": "hqq", "nbits": HQQ_INT8_BITS}),
    "quantized:fp8": ("quantized", {"backend": "fp8"}),
}


@dataclass
class GenerationSetup:
    """One `generate()` call: `batch` prompts of `input_len` tokens, `new_tokens` generated for
    each, the `cache`, and beam search (`beams` > 1, returning `num_return_sequences` of them)
    or, with `num_return_sequences` > 1 and one beam, sampling that many sequences per prompt."""

    batch: int = 1
    input_len: int = 128
    new_tokens: int = 128
    cache: str = "dynamic"
    beams: int = 1
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        for name in ("batch", "input_len", "new_tokens", "beams", "num_return_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name.replace('_', '-')} must be a whole number >= 1, not {value!r}")
        if self.cache not in CACHES:
            raise UserError(f"cache must be one of {', '.join(CACHES)}, not {self.cache!r}")
        if self.beams > 1 and self.num_return_sequences > self.beams:
            raise UserError(f"beam search returns at most its {self.beams} beams: use --num-return-sequences "
                            f"{self.beams} or fewer")

    @property
    def sampling(self) -> bool:
        """Several sequences per prompt without beams: multinomial sampling."""
        return self.beams == 1 and self.num_return_sequences > 1

    @property
    def total_len(self) -> int:
        return self.input_len + self.new_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the `generate()` call (fixed-shape: min = max new tokens)."""
        implementation, cache_config = CACHE_IMPLEMENTATIONS[self.cache]
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.new_tokens, "min_new_tokens": self.new_tokens, "do_sample": self.sampling,
            "num_beams": self.beams, "num_return_sequences": self.num_return_sequences, "use_cache": True,
            "cache_implementation": implementation,
        }
        if cache_config is not None:
            kwargs["cache_config"] = dict(cache_config)
        return kwargs
