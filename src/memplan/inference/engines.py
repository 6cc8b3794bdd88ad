"""Per-engine, per-version rules of vLLM and SGLang: defaults and the KV budget formula.

vLLM (`vllm_rules`): what `gpu_memory_utilization` has meant, by version, and the
defaults the engine fills in. The code read for each rule is vLLM 0.11.0 and 0.21.0
(their wheels' sources); the boundaries between eras come from the pull requests that
changed the rule (docs/serving.md cites each):

- before 0.2.5: the KV cache is `total x util - torch peak` (weights included); memory
  outside PyTorch (NCCL, the CUDA context) is not counted (vllm-project/vllm PR 2031
  added it);
- 0.2.5 to 0.6.4 (V0): `total x util - (torch peak + memory used outside PyTorch)`,
  measured on the whole device, so the CUDA context and NCCL buffers count against the
  budget (PR 10511, released in 0.6.5, made the budget per instance);
- 0.6.5 to 0.8.x (V0): per instance, `total x util - (weights + activation peak + rise of
  non-torch memory since the start-up snapshot)`;
- 0.8 to 0.9.1 (V1's first releases): the device-wide form again (PRs 18974 and 19312,
  June 2025, restored the per-instance one);
- 0.9.2 to 0.20.x: per instance (`vllm/v1/worker/gpu_worker.py` `determine_available_memory`,
  L222-302 at 0.11.0); CUDA graphs are captured after the KV cache, outside the budget;
- 0.21.0 and later: the CUDA-graph memory estimate is subtracted too, and the default
  utilisation is 0.92 (`gpu_worker.py` L385-447 and `vllm/config/cache.py` at 0.21.0).

The V1 defaults of `max_num_batched_tokens` / `max_num_seqs` (`EngineArgs._set_default_args`,
`vllm/engine/arg_utils.py` L1594-1680 at 0.11.0): on a GPU of >= 70 GiB that is not an
A100, 16384 / 1024 for the `LLM` class and 8192 / 1024 for the OpenAI server; otherwise
8192 / 256 and 2048 / 256; `max_num_seqs` at most `max_num_batched_tokens`. V0 without
chunked prefill batches `max(max_model_len, 2048)` tokens over 256 sequences. CUDA-graph
capture sizes: `[1, 2, 4] + range(8, max + 1, 8)` up to `min(2 x max_num_seqs, 512)`
(`vllm/config/__init__.py` L590-610, `vllm/config/scheduler.py` L222-227 at 0.11.0), from
0.21.0 `range(8, 256, 8) + range(256, max + 1, 16)` (`vllm/config/vllm.py` L1482-1540).

SGLang (`sglang_rules`, sglang 0.5.3 `python/sglang/srt/server_args.py`
`_handle_gpu_memory_settings` L542-676): `chunked_prefill_size` and `cuda_graph_max_bs` by
GPU memory (the `nvidia-smi` total in MiB), then `mem_fraction_static =
(gpu_mem - reserved) / gpu_mem` with `reserved = 512 + 1.5 x max(chunked_prefill_size, 2048)
+ 2 x cuda_graph_max_bs + tp x pp / 8 x 1024` MiB, at least 10 GiB above 60 GiB of memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from memplan.errors import UserError

ENGINES = ("vllm", "sglang")
DEFAULT_VERSIONS = {"vllm": "0.11.0", "sglang": "0.5.3"}  # the versions whose code the rules were read from
GIB = 1 << 30
MIB = 1 << 20

VLLM_ERAS = (  # (first version, budget form, what it means)
    ((0, 0, 0), "torch-only", "total x util - torch peak (weights included); non-torch memory not counted"),
    ((0, 2, 5), "device", "total x util - (torch peak + non-torch memory of the whole device)"),
    ((0, 6, 5), "instance", "total x util - (weights + activation peak + non-torch rise since start-up)"),
    ((0, 8, 0), "device", "total x util - (torch peak + non-torch memory of the whole device) (early V1)"),
    ((0, 9, 2), "instance", "total x util - (weights + activation peak + non-torch rise since start-up)"),
    ((0, 21, 0), "instance+graphs",
     "total x util - (weights + activation peak + non-torch rise + CUDA-graph estimate)"),
)


def parse_version(text: str) -> tuple[int, int, int]:
    """`0.11.0`, `v0.9.2`, `0.10.1.1`, `0.6.6.post1` as (major, minor, patch)."""
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text).strip())
    if match is None:
        raise UserError(f"--engine-version {text!r} is not a version: write it like 0.11.0")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


@dataclass(frozen=True)
class VllmRules:
    """What one vLLM version does at start-up."""

    version: str
    budget: str  # torch-only | device | instance | instance+graphs
    budget_rule: str
    v1: bool
    default_utilization: float
    capture_step_above_256: int  # capture sizes step by 8 up to 256, then by this

    @property
    def context_in_budget(self) -> bool:
        """Whether the CUDA context and NCCL buffers count against `total x util`."""
        return self.budget == "device"

    @property
    def non_torch_counted(self) -> bool:
        return self.budget != "torch-only"

    @property
    def graphs_in_budget(self) -> bool:
        return self.budget == "instance+graphs"

    def batch_defaults(self, capacity_bytes: int, gpu_name: str, entry: str, max_model_len: int) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs) the engine fills in when not given."""
        if not self.v1:
            return max(max_model_len, 2048), 256
        big = capacity_bytes >= 70 * GIB and "a100" not in gpu_name.lower()
        tokens = {("llm", True): 16384, ("server", True): 8192, ("llm", False): 8192, ("server", False): 2048}
        return tokens[(entry, big)], 1024 if big else 256

    def capture_sizes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
        """The batch sizes CUDA graphs are captured for (none when eager)."""
        largest = min(2 * max_num_seqs, 512)
        sizes = [1, 2, 4] + list(range(8, min(largest, 256) + 1, 8))
        sizes += list(range(256 + self.capture_step_above_256, largest + 1, self.capture_step_above_256))
        return [s for s in sorted(set(sizes)) if s <= min(largest, max_num_batched_tokens)]


def vllm_rules(version: str | None) -> VllmRules:
    """The rules of vLLM `version` (default: DEFAULT_VERSIONS["vllm"])."""
    text = version or DEFAULT_VERSIONS["vllm"]
    v = parse_version(text)
    era = [e for e in VLLM_ERAS if v >= e[0]][-1]
    return VllmRules(version=text, budget=era[1], budget_rule=era[2], v1=v >= (0, 8, 0),
                     default_utilization=0.92 if v >= (0, 21, 0) else 0.9,
                     capture_step_above_256=16 if v >= (0, 21, 0) else 8)


@dataclass(frozen=True)
class SglangRules:
    """What SGLang fills in at start-up on one GPU."""

    version: str
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    mem_fraction_static: float
    reserved_mib: float


def sglang_gpu_tier(gpu_mem_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by the GPU's memory in MiB."""
    if gpu_mem_mib < 20 * 1024:
        return 2048, 8
    if gpu_mem_mib < 35 * 1024:
        return 2048, 16 if tp < 4 else 80
    if gpu_mem_mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def sglang_rules(version: str | None, gpu_mem_mib: float, tp: int, pp: int, *, chunked_prefill_size: int | None = None,
                 cuda_graph_max_bs: int | None = None, mem_fraction_static: float | None = None) -> SglangRules:
    """SGLang's defaults on a GPU of `gpu_mem_mib` MiB (nvidia-smi's total), flags given win."""
    text = version or DEFAULT_VERSIONS["sglang"]
    if parse_version(text) < (0, 4, 0):
        raise UserError(f"SGLang {text} is not modelled: memplan reads the rules of SGLang 0.4 and later")
    tier_chunk, tier_bs = sglang_gpu_tier(gpu_mem_mib, tp)
    chunk = chunked_prefill_size or tier_chunk
    graphs = cuda_graph_max_bs or tier_bs
    reserved = 512 + max(chunk, 2048) * 1.5 + graphs * 2 + tp * pp / 8 * 1024
    if gpu_mem_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = mem_fraction_static if mem_fraction_static is not None else round(
        (gpu_mem_mib - reserved) / gpu_mem_mib, 3)
    return SglangRules(text, chunk, graphs, fraction, reserved)


def rules_to_json(rules: VllmRules | SglangRules) -> dict[str, Any]:
    """The rules as the `--json` object's `engine_rules`."""
    if isinstance(rules, VllmRules):
        return {"version": rules.version, "budget": rules.budget, "budget_rule": rules.budget_rule, "v1": rules.v1,
                "default_gpu_memory_utilization": rules.default_utilization,
                "context_in_budget": rules.context_in_budget, "graphs_in_budget": rules.graphs_in_budget}
    return {"version": rules.version, "chunked_prefill_size": rules.chunked_prefill_size,
            "cuda_graph_max_bs": rules.cuda_graph_max_bs, "mem_fraction_static": rules.mem_fraction_static,
            "reserved_mib": rules.reserved_mib}
