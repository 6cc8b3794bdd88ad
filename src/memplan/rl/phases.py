"""The phases of one RL step on one GPU, each with what holds memory and which allocator
holds it.

The memory of an RL step is not one peak but a sequence of phases on the same GPU, each
with its own residents (docs/rl.md). `assemble_phases` lays them out in the trainer's
order from figures computed once (`StepFigures`: the traced training step, the traced
no-gradient passes, the engine's start-up sizing), so that the knobs that only move
memory between phases (utilisation, sleep level, reference placement) are re-assembled
without tracing again.

Allocators (`Item.allocator`):

- `torch`: PyTorch's caching allocator: the trainer's tensors, the engine's activations
  (the engine runs in the trainer's process), and without sleep mode the engine's weights
  and KV cache; what it keeps reserved after a phase stays reserved (`cached`) until
  `torch.cuda.empty_cache()`;
- `cumem`: vLLM's sleep-mode pool (`CuMemAllocator`), weights and KV cache, mapped at
  wake-up and released at sleep; it cannot use memory PyTorch's cache holds, and
  PyTorch's cache cannot use it: a wake-up finds only the memory neither holds;
- `outside`: what neither allocator counts: the CUDA context, NCCL's buffers, the memory
  rising outside PyTorch in the engine's first forward, the CUDA-graph pool (a private
  pool sleep mode does not release).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALLOCATORS = ("torch", "cumem", "outside")


@dataclass(frozen=True)
class Item:
    """One holder of memory in a phase."""

    label: str
    allocator: str  # one of ALLOCATORS
    kind: str  # resident | transient | cached
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "allocator": self.allocator, "kind": self.kind, "bytes": int(self.bytes)}


@dataclass
class Phase:
    """One phase: its holders and what sets its peak."""

    name: str
    items: list[Item]
    note: str = ""
    fails: str | None = None  # the engine's own refusal, where the phase cannot run
    cache_blocks: bool = False  # the CuMem pool maps memory here: PyTorch's free cache is in its way

    @property
    def device_used_bytes(self) -> int:
        """What the device holds in the phase (as nvidia-smi shows it)."""
        return int(sum(i.bytes for i in self.items))

    @property
    def needed_bytes(self) -> int:
        """What must fit for the phase to run: PyTorch gives its free cache back and retries
        before it reports an out-of-memory error, so the cache only counts where the CuMem
        pool allocates (a wake-up), which cannot use it."""
        return self.device_used_bytes - (0 if self.cache_blocks else self.cached_bytes)

    @property
    def cached_bytes(self) -> int:
        return int(sum(i.bytes for i in self.items if i.kind == "cached"))

    def allocator_bytes(self, allocator: str) -> int:
        return int(sum(i.bytes for i in self.items if i.allocator == allocator))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "device_used_bytes": self.device_used_bytes, "needed_bytes": self.needed_bytes,
                "by_allocator": {a: self.allocator_bytes(a) for a in ALLOCATORS},
                "items": [i.to_json() for i in self.items if i.bytes], "note": self.note, "fails": self.fails}


@dataclass
class EngineFigures:
    """A colocated engine's memory (bytes per GPU), from `memplan.inference.estimate_serving`."""

    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    graphs_bytes: int
    non_torch_bytes: int
    nccl_bytes: int
    refusal: str | None
    serving: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepFigures:
    """What the phases are assembled from, bytes per GPU."""

    outside_bytes: int  # the trainer process's CUDA context and NCCL buffers
    extra_contexts: dict[str, int]  # models in processes of their own: their CUDA contexts
    policy_bytes: int  # the policy's parameters resident on the rank
    optimizer_bytes: int  # its optimizer state (after the first step)
    reference_bytes: int  # a reference copy's parameters (0: none)
    critic_bytes: int  # a critic's parameters and optimizer state
    reward_bytes: int  # a reward model's parameters
    train_allocated_bytes: int  # the training step's allocated peak (its residents included)
    train_reserved_bytes: int
    logprob_transient_bytes: int  # the old policy's no-gradient pass above the parameters
    reference_transient_bytes: int  # the reference's
    logprob_cached_bytes: int
    reward_transient_bytes: int
    critic_train_extra_bytes: int  # the critic's step above its residents
    sync_gather_bytes: int  # full parameters gathered at once during the weight sync
    engine: EngineFigures | None
    generation_transient_bytes: int = 0  # a transformers rollout's generate() above the full weights
    generation_cached_bytes: int = 0  # what the caching allocator keeps reserved above its peak
    generation_gather_bytes: int = 0  # full parameters gathered beyond the shards while generating


@dataclass(frozen=True)
class PhaseOptions:
    """The knobs `assemble_phases` reads."""

    rollout: str  # hf | vllm-colocate | vllm-server
    sleep_level: int  # 0: sleep mode off
    empty_cache_before_wake: bool
    old_logprobs: bool
    reference_logprobs: bool
    algo: str
    caching: bool = True  # a CUDA job: PyTorch's caching allocator keeps what it reserved
    params_on_host: bool = False  # the policy's parameters on the host between phases (verl's param_offload)
    optimizer_on_host: bool = False  # its optimizer state on the host but for the update (verl, OpenRLHF)
    empty_cache_after_update: bool = False  # the trainer's offload after the update empties PyTorch's cache


def _trainer_residents(f: StepFigures, *, optimizer: bool = True, params: bool = True,
                       policy_optimizer: bool = True) -> list[Item]:
    """What the trainer keeps on the GPU in a phase: the contexts, the other models, the
    policy's parameters (`params`: not on the host) and optimizer state (`policy_optimizer`:
    not on the host); `optimizer=False` is the first step, before any optimizer state exists."""
    items = [Item("CUDA context + NCCL", "outside", "resident", f.outside_bytes),
             Item("policy parameters", "torch", "resident", f.policy_bytes if params else 0)]
    if optimizer:
        items.append(Item("optimizer state", "torch", "resident", f.optimizer_bytes if policy_optimizer else 0))
    items.append(Item("reference parameters", "torch", "resident", f.reference_bytes))
    items.append(Item("critic parameters + optimizer", "torch", "resident", f.critic_bytes if optimizer else 0))
    items.append(Item("reward model parameters", "torch", "resident", f.reward_bytes))
    items += [Item(f"{name} process CUDA context", "outside", "resident", b) for name, b in f.extra_contexts.items()]
    return items


def _engine_items(e: EngineFigures, *, weights: bool, kv: bool, sleeping: bool) -> list[Item]:
    """The engine's holders: weights and KV in the CuMem pool under sleep mode (in
    PyTorch's allocator without it), the graph pool and non-torch memory always."""
    pool = "cumem" if sleeping else "torch"
    return [Item("engine weights", pool, "resident", e.weights_bytes if weights else 0),
            Item("engine KV cache", pool, "resident", e.kv_bytes if kv else 0),
            Item("engine CUDA graphs", "outside", "resident", e.graphs_bytes),
            Item("engine non-torch + NCCL", "outside", "resident", e.non_torch_bytes + e.nccl_bytes)]


def _torch_resident(items: list[Item]) -> int:
    return sum(i.bytes for i in items if i.allocator == "torch" and i.kind == "resident")


class _Cache:
    """PyTorch's reserved memory carried from phase to phase: a phase reserves at least
    what it needs and keeps what an earlier phase reserved, until `empty_cache()`."""

    def __init__(self, reserved: int, caching: bool) -> None:
        self.reserved = reserved if caching else 0
        self.caching = caching

    def add(self, items: list[Item], needed_reserved: int) -> list[Item]:
        """`items` plus what the cache holds free on top of the torch bytes they list
        (nothing on a cpu job: its allocator returns what is freed)."""
        if not self.caching:
            return items
        self.reserved = max(self.reserved, needed_reserved)
        held = sum(i.bytes for i in items if i.allocator == "torch")
        return items + [Item("PyTorch cache (free)", "torch", "cached", max(self.reserved - held, 0))]

    def empty(self, items: list[Item]) -> None:
        self.reserved = sum(i.bytes for i in items if i.allocator == "torch")


def assemble_phases(f: StepFigures, o: PhaseOptions) -> list[Phase]:
    """The phases of the trainer's step (module docstring), in order: engine start (step 1,
    before any optimizer state exists), then step 2's weight sync, rollout, log-probability
    passes and training step, when every resident of a later step is there."""
    phases: list[Phase] = []
    e = f.engine
    colocated = o.rollout == "vllm-colocate" and e is not None
    sleeping = colocated and o.sleep_level > 0
    if colocated:
        start = _trainer_residents(f, optimizer=False, params=not o.params_on_host) \
            + _engine_items(e, weights=True, kv=True, sleeping=sleeping)
        start.append(Item("profile-run activations", "torch", "transient", e.activation_bytes))
        phases.append(Phase("engine start (step 1)", start, "sized before any optimizer state exists", e.refusal))
    cache = _Cache(f.train_reserved_bytes + f.reference_bytes + f.critic_bytes + f.reward_bytes
                   + (e.weights_bytes + e.kv_bytes if colocated and not sleeping else 0), o.caching)
    residue = _engine_items(e, weights=o.sleep_level == 0, kv=o.sleep_level == 0, sleeping=sleeping) if colocated \
        else []
    if o.empty_cache_after_update:  # what step 1's update left on the GPU, the rest given back
        cache.empty(_trainer_residents(f, policy_optimizer=not o.optimizer_on_host, params=not o.params_on_host)
                    + residue)
    if o.algo != "dpo":
        phases += _rollout_phases(f, o, cache, sleeping)
    base = _trainer_residents(f, policy_optimizer=not o.optimizer_on_host) + residue
    for wanted, label, transient in ((o.old_logprobs, "policy log-probs", f.logprob_transient_bytes),
                                     (o.reference_logprobs, "reference log-probs", f.reference_transient_bytes),
                                     (f.reward_bytes > 0, "reward model scores", f.reward_transient_bytes)):
        if wanted:
            held = base if label != "reward model scores" or not o.params_on_host else \
                _trainer_residents(f, policy_optimizer=not o.optimizer_on_host, params=False) + residue
            items = held + [Item("activations + scoring", "torch", "transient", transient)]
            needed = _torch_resident(items) + transient + f.logprob_cached_bytes
            phases.append(Phase(label, cache.add(items, needed), "forward without gradients, one micro-batch"))
            if o.params_on_host:  # verl offloads the parameters after the pass and empties the cache
                cache.empty(_trainer_residents(f, policy_optimizer=not o.optimizer_on_host, params=False) + residue)
    train = [i for i in base if not (i.allocator == "torch" and i.label in ("policy parameters", "optimizer state"))]
    extra = f.train_allocated_bytes - f.policy_bytes - f.optimizer_bytes + f.critic_train_extra_bytes
    train += [Item("policy parameters", "torch", "resident", f.policy_bytes),
              Item("optimizer state", "torch", "resident", f.optimizer_bytes),
              Item("activations, gradients, temporaries", "torch", "transient", max(extra, 0))]
    needed = f.train_reserved_bytes + _torch_resident(train) - f.policy_bytes - f.optimizer_bytes \
        + f.critic_train_extra_bytes
    phases.append(Phase("training step", cache.add(train, needed), "forward, backward and optimizer step"))
    return phases


def _rollout_phases(f: StepFigures, o: PhaseOptions, cache: _Cache, sleeping: bool) -> list[Phase]:
    """Weight sync and generation of step 2."""
    e = f.engine
    residents = _trainer_residents(f, policy_optimizer=not o.optimizer_on_host)
    if o.rollout == "hf":
        items = residents + [Item("gathered parameters", "torch", "transient", f.generation_gather_bytes),
                             Item("generate(): KV cache, activations, logits", "torch", "transient",
                                  f.generation_transient_bytes)]
        needed = _torch_resident(items) + f.generation_gather_bytes + f.generation_transient_bytes \
            + f.generation_cached_bytes
        return [Phase("rollout (transformers generate)", cache.add(items, needed),
                      "the policy generates: no gradients, gradient checkpointing off")]
    if o.rollout == "vllm-server":
        items = residents + [Item("gathered parameters", "torch", "transient", f.sync_gather_bytes)]
        return [Phase("weight sync (to a server)", cache.add(items, _torch_resident(items)
                                                                     + f.sync_gather_bytes),
                      "the engine runs on GPUs of its own")]
    if sleeping and o.empty_cache_before_wake:
        cache.empty(residents)
    sync = residents + _engine_items(e, weights=True, kv=not sleeping, sleeping=sleeping)
    sync.append(Item("gathered parameters", "torch", "transient", f.sync_gather_bytes))
    phases = [Phase("weight sync", cache.add(sync, _torch_resident(sync) + f.sync_gather_bytes),
                    "engine weights awake, KV cache asleep" if sleeping else "", cache_blocks=sleeping)]
    # the parameters taken for the sync are gone by now where they live on the host
    gen = _trainer_residents(f, policy_optimizer=not o.optimizer_on_host, params=not o.params_on_host) \
        + _engine_items(e, weights=True, kv=True, sleeping=sleeping)
    gen.append(Item("engine activations", "torch", "transient", e.activation_bytes))
    phases.append(Phase("rollout (vLLM generate)", cache.add(gen, _torch_resident(gen) + e.activation_bytes), "",
                        cache_blocks=sleeping))
    return phases
