"""FLEET.json, the planner's input: schema, defaults and validation.

    {"learner": {"step_s", "rollouts_per_step", "publish_s", "price_per_hour",
                 ["uplink_mb_s"], ["rollouts_per_s"]},
     "model_bytes", ["version_bytes"], "staleness", "publish_every", "steps", ["margin"],
     ["broadcast": "store"|"chain"|"tree"], ["fanout"], ["chunk_mb"],
     "workers": [{"name", "count", "price_per_hour", "rollouts_per_s", "bandwidth_mb_s",
                  ["preempt_per_hour"], ["lease_s"], ["restart_s"]}, ...],
     ["standby_price_fraction"], ["group_size"], ["lease_s"], ["restart_s"],
     ["admission": "held"|"controller"], ["max_version_lag"], ["seed"]}

Units: seconds, bytes for `model_bytes`, MB/s (1e6 bytes) for bandwidths, USD per hour.
`version_bytes` is what one new version puts on each link (delta versions, bridge/weights/:
the run's measured `bridge/version_bytes`; default `model_bytes`); a worker that restarts
or joins still fetches `model_bytes` (an anchor).
`lease_s` is how long one lease (one group of `group_size` rollouts) takes on a worker, the
per-sequence decode latency of a long rollout; a worker with throughput mu then runs
round(mu * lease_s / group_size) leases at once. 0 (the default) means one lease at a time,
which takes group_size / mu. "sources", "notes" and "name" are free text, kept but unused.

Every error names the field (`workers[2].price_per_hour: ...`): a fleet file is written by
hand, and a planner that silently ignores a misspelt key plans for a different fleet.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from bridge.contracts import staleness as staleness_rule


class FleetError(ValueError):
    """An invalid fleet file; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Learner:
    step_s: float  # T: one update
    rollouts_per_step: int  # R
    publish_s: float
    price_per_hour: float
    uplink_mb_s: float = math.inf  # the store's / learner's shared uplink
    rollouts_per_s: float | None = None  # own generation speed, for the centralized baseline


@dataclasses.dataclass(frozen=True)
class WorkerType:
    name: str
    count: int
    price_per_hour: float
    rollouts_per_s: float
    bandwidth_mb_s: float
    preempt_per_hour: float = 0.0
    lease_s: float | None = None  # None: the fleet's lease_s
    restart_s: float | None = None  # None: the fleet's restart_s


@dataclasses.dataclass(frozen=True)
class Fleet:
    learner: Learner
    model_bytes: float
    staleness: int  # S
    publish_every: int  # kappa
    steps: int
    workers: tuple[WorkerType, ...]
    margin: float = 0.1
    broadcast: str = "store"
    fanout: int = 4
    chunk_mb: float = 64.0
    standby_price_fraction: float = 0.0
    group_size: int = 8
    lease_s: float = 0.0
    restart_s: float = 120.0
    admission: str = "held"
    max_version_lag: int = 0
    seed: int = 0
    version_bytes: float | None = None  # None: every version is a full copy (model_bytes)

    @property
    def wire_bytes(self) -> float:
        """Bytes one new version moves over each link (a delta's, or the whole model)."""
        return self.model_bytes if self.version_bytes is None else self.version_bytes

    def replace(self, **kw) -> Fleet:
        return dataclasses.replace(self, **kw)


BROADCAST_MODES = ("store", "chain", "tree")
ADMISSION_MODES = ("held", "controller")
_FREE_TEXT = ("sources", "notes", "name")

# field -> (kind, required); kinds: "num" float >= 0, "pos" float > 0, "int" int >= 0,
# "posint" int >= 1, "str".
_LEARNER = {
    "step_s": ("pos", True),
    "rollouts_per_step": ("posint", True),
    "publish_s": ("num", True),
    "price_per_hour": ("num", True),
    "uplink_mb_s": ("pos", False),
    "rollouts_per_s": ("pos", False),
}
_WORKER = {
    "name": ("str", True),
    "count": ("int", True),
    "price_per_hour": ("num", True),
    "rollouts_per_s": ("pos", True),
    "bandwidth_mb_s": ("pos", True),
    "preempt_per_hour": ("num", False),
    "lease_s": ("num", False),
    "restart_s": ("num", False),
}
_TOP = {
    "model_bytes": ("pos", True),
    "version_bytes": ("pos", False),
    "staleness": ("int", True),
    "publish_every": ("posint", True),
    "steps": ("posint", True),
    "margin": ("num", False),
    "broadcast": ("str", False),
    "fanout": ("posint", False),
    "chunk_mb": ("pos", False),
    "standby_price_fraction": ("num", False),
    "group_size": ("posint", False),
    "lease_s": ("num", False),
    "restart_s": ("num", False),
    "admission": ("str", False),
    "max_version_lag": ("int", False),
    "seed": ("int", False),
}


def _check(obj: Any, schema: dict, where: str) -> dict:
    if not isinstance(obj, dict):
        raise FleetError(f"{where or 'fleet'}: must be a JSON object, got {type(obj).__name__}")
    known = set(schema) | set(_FREE_TEXT) | ({"learner", "workers"} if not where else set())
    unknown = sorted(set(obj) - known)
    if unknown:
        raise FleetError(f"{where or 'fleet'}: unknown key(s) {unknown}; known: {sorted(known)}")
    out = {}
    for key, (kind, required) in schema.items():
        name = f"{where}.{key}" if where else key
        if key not in obj:
            if required:
                raise FleetError(f"{name}: missing (required)")
            continue
        v = obj[key]
        if kind == "str":
            if not isinstance(v, str) or not v:
                raise FleetError(f"{name}: must be a non-empty string, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise FleetError(f"{name}: must be a number, got {v!r}")
        elif not math.isfinite(v):
            raise FleetError(f"{name}: must be finite, got {v!r}")
        elif kind in ("int", "posint") and v != int(v):
            raise FleetError(f"{name}: must be an integer, got {v!r}")
        elif kind in ("num", "int") and v < 0:
            raise FleetError(f"{name}: must be >= 0, got {v!r}")
        elif kind in ("pos", "posint") and v <= 0:
            raise FleetError(f"{name}: must be > 0, got {v!r}")
        out[key] = int(v) if kind in ("int", "posint") else v
    return out


def parse(raw: Any) -> Fleet:
    """A validated Fleet from the decoded JSON; raises FleetError naming the bad field."""
    top = _check(raw, _TOP, "")
    if "learner" not in raw:
        raise FleetError("learner: missing (required)")
    if "workers" not in raw:
        raise FleetError("workers: missing (required)")
    learner = Learner(**_check(raw["learner"], _LEARNER, "learner"))
    if not isinstance(raw["workers"], list) or not raw["workers"]:
        raise FleetError("workers: must be a non-empty list of worker types")
    workers = tuple(
        WorkerType(**_check(w, _WORKER, f"workers[{i}]")) for i, w in enumerate(raw["workers"])
    )
    names = [w.name for w in workers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FleetError(f"workers: duplicate name(s) {dup}")
    if sum(w.count for w in workers) == 0:
        raise FleetError("workers: every count is 0, there is no fleet to plan")
    if top.get("broadcast", "store") not in BROADCAST_MODES:
        raise FleetError(f"broadcast: must be one of {BROADCAST_MODES}, got {top['broadcast']!r}")
    if top.get("admission", "held") not in ADMISSION_MODES:
        raise FleetError(f"admission: must be one of {ADMISSION_MODES}, got {top['admission']!r}")
    error = staleness_rule.schedule_error(top["staleness"], top["publish_every"])
    if error:  # the learner's own check (bridge/contracts/staleness.py)
        raise FleetError(f"staleness: {error}")
    if top.get("standby_price_fraction", 0.0) > 1:
        raise FleetError("standby_price_fraction: must be <= 1")
    return Fleet(learner=learner, workers=workers, **top)


def load(path: str) -> Fleet:
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise FleetError(f"{path}: not valid JSON ({e})") from e
    return parse(raw)
