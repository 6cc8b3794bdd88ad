"""An offload plan as data: its transfers, its figures, and the JSON file it travels as.

`planner.plan_offload` makes an `OffloadPlan`; `simulate.simulate_offload_plan` runs one;
`save_offload_plan` writes one (`memplan offload --plan-output`, `memplan.watch`'s automatic
plan) and `load_offload_plan` reads it back, e.g. for `memplan.offload.run` in the training job
(docs/offload.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memplan.errors import UserError
from memplan.offload.schedule import TensorSchedule
from memplan.trace.io import atomic_write


@dataclass(frozen=True)
class Transfer:
    """One buffer leaving device memory after op `after_op` and (maybe) coming back.

    Op indices >= num_ops are in the next iteration. Device memory is free over ops
    [done_op, return_op): from the first op after the offload completes to the op at
    whose start the prefetch is issued (or, when `use_op` is None, the op that frees it).
    """

    buffer: int
    nbytes: int
    category: str
    tier: str  # "ssd" or "host"
    after_op: int
    done_op: int
    return_op: int
    use_op: int | None  # the op that needs it back; None: freed while away
    urgent: bool
    offload_start_s: float
    offload_end_s: float
    prefetch_start_s: float | None
    prefetch_end_s: float | None


@dataclass
class OffloadPlan:
    """A validated offload schedule for one trace and budget."""

    transfers: list[Transfer]
    budget_bytes: int
    num_ops: int
    ideal_step_s: float
    peak_bytes_before: int
    peak_bytes_after: int  # planned device peak, op-level
    feasible: bool  # peak_bytes_after <= budget_bytes
    plan_elapsed_s: float
    hardware: dict[str, Any] = field(default_factory=dict)
    planned_stall_s: float = 0.0  # seconds added to the op timeline the transfer times refer to
    rounds: list[dict[str, float]] = field(default_factory=list)  # per planning round: stall, urgent, simulated step
    tensors: TensorSchedule = field(default_factory=TensorSchedule)  # what `memplan.offload.run` applies

    @property
    def offloaded_bytes(self) -> int:
        """Bytes written out per iteration (one buffer may leave several times)."""
        return int(sum(t.nbytes for t in self.transfers))

    def to_json(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "num_ops": self.num_ops,
            "ideal_step_s": self.ideal_step_s,
            "peak_bytes_before": self.peak_bytes_before,
            "peak_bytes_after": self.peak_bytes_after,
            "feasible": self.feasible,
            "plan_elapsed_s": self.plan_elapsed_s,
            "offloaded_bytes": self.offloaded_bytes,
            "planned_stall_s": self.planned_stall_s,
            "rounds": self.rounds,
            "hardware": self.hardware,
            "tensors": self.tensors.to_json(),
            "transfers": [asdict(t) for t in self.transfers],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> OffloadPlan:
        """The plan `to_json` wrote (as `memplan offload --plan-output` does), e.g. to apply it
        with `memplan.offload.run` in another process. Checked for shape here; the runtime
        checks it against the live step (names and saved storages)."""
        try:
            tensors = doc.get("tensors") or {}
            schedule = TensorSchedule(
                moved={str(k): int(v) for k, v in (tensors.get("moved") or {}).items()},
                saved_nbytes=[int(x) for x in tensors.get("saved_nbytes") or []],
                saved_moved=[bool(x) for x in tensors.get("saved_moved") or []],
                unnamed={str(k): int(v) for k, v in (tensors.get("unnamed") or {}).items()},
            )
            if len(schedule.saved_nbytes) != len(schedule.saved_moved):
                raise ValueError("tensors.saved_nbytes and tensors.saved_moved differ in length")
            fields = {f for f in Transfer.__dataclass_fields__}
            transfers = []
            for t in doc["transfers"]:
                if set(t) != fields:
                    raise ValueError(f"a transfer has keys {sorted(t)}, not {sorted(fields)}")
                transfers.append(Transfer(**t))
            return cls(
                transfers=transfers,
                budget_bytes=int(doc["budget_bytes"]),
                num_ops=int(doc["num_ops"]),
                ideal_step_s=float(doc["ideal_step_s"]),
                peak_bytes_before=int(doc["peak_bytes_before"]),
                peak_bytes_after=int(doc["peak_bytes_after"]),
                feasible=bool(doc["feasible"]),
                plan_elapsed_s=float(doc["plan_elapsed_s"]),
                hardware=dict(doc.get("hardware") or {}),
                planned_stall_s=float(doc.get("planned_stall_s", 0.0)),
                rounds=list(doc.get("rounds") or []),
                tensors=schedule,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise UserError(f"not an offload plan ({what}): write one with memplan offload --plan-output") from None


def save_offload_plan(plan: OffloadPlan, path: str | Path) -> None:
    """Write `plan` as the JSON file `load_offload_plan` reads (atomically: a reader never sees half)."""
    doc = json.dumps(plan.to_json()).encode()
    atomic_write(path, lambda f: f.write(doc))


def load_offload_plan(path: str | Path) -> OffloadPlan:
    """Read a plan written by `memplan offload --plan-output` (JSON)."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"cannot read the plan {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UserError(f"{path} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not an offload plan: write one with memplan offload --plan-output")
    return OffloadPlan.from_json(doc)
