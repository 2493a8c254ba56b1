"""The fleet at a glance: what `GET /v1/status` answers and `python -m bridge.status` prints.

`fleet_status(db, config, ...)` reads the controller's tables (in the caller's transaction,
under the controller's lock) into one JSON-able dict:

    {"run":     {"step", "policy_version", "staleness_bound", "staleness_now", "spend_usd",
                 "spend_usd_per_hour", "run_over", "workers": {state: count}},
     "workers": [{"worker_id", "name", "identity", "state", "version", "rollouts_per_s",
                  "price_per_hour", "cost_usd", "last_contact_s", "accelerator", "region"}],
     ...the controller's flat stats (fleet/active_workers, groups/buffered, ...)}

`name` is shown only on the rows of the identity that owns it (identity.py), so a worker
cannot pass itself off as a provisioned one. A worker's own view (`only`) is its row.

A worker's state is the first that holds of: `quarantined` (its token was revoked by the
audit), `gone` (left, or silent for longer than `worker_timeout_s`), `standby` (the
activation decision disabled it), `too_slow` (its leases come back too late to be fresh,
bridge/control/leasing/lease_timing.py), `active`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

STATES = ("active", "standby", "too_slow", "quarantined", "gone")


def worker_state(row, now: float, timeout_s: float, too_slow=(), active=None) -> str:
    """`active(worker_id)`: the activation decision (default: the `enabled` column)."""
    if row["token_hash"].startswith("quarantined:"):
        return "quarantined"
    if row["left_at"] is not None or now - row["last_seen"] > timeout_s:
        return "gone"
    if not (active(row["worker_id"]) if active else row["enabled"]):
        return "standby"
    if row["worker_id"] in too_slow:
        return "too_slow"
    return "active"


def fleet_status(
    db,
    config,
    now: float,
    stats: dict,
    *,
    policy_version: int,
    too_slow: Collection[str],
    active: Callable[[str], bool],
    identities: tuple[dict, dict] = ({}, {}),
    only: str | None = None,
) -> dict:
    """The fleet's status from the controller's database `db` (bridge/control/state/db.py) and
    config; `stats` are the controller's flat stats, `too_slow` the workers lease_timing.py
    refused last, `active(worker_id)` the activation decision, `identities` (worker id ->
    identity, name -> identity: identity.py) who registered each worker and owns each name;
    `only`: the rows of that worker alone (the run's totals still count every worker)."""
    c, too_slow = config, set(too_slow)
    by_worker, owners = identities
    # Standby time is billed at a fraction of the price (bridge/control/fleet/fleet_plan.py).
    rows = db.fleet_rows()
    off = 1.0 - c.standby_price_fraction
    workers = []
    for w in db.workers():
        profile = json.loads(w["profile"])
        price = float(profile.get("price_per_hour", 0.0))
        standby_s = rows[w["worker_id"]]["standby_s"] if w["worker_id"] in rows else 0.0
        who, name = by_worker.get(w["worker_id"]), profile.get("name", "")
        if name in owners and owners[name] != who:
            name = ""  # a name another identity owns is not this worker's to show
        workers.append(
            {
                "worker_id": w["worker_id"],
                "name": name,
                "identity": who or "",
                "state": worker_state(w, now, c.worker_timeout_s, too_slow, active),
                "version": w["version"],
                "rollouts_per_s": w["samples_per_s"],
                "price_per_hour": price,
                "cost_usd": price * (w["active_s"] - off * standby_s) / 3600.0,
                "last_contact_s": max(0.0, now - w["last_seen"]),
                "accelerator": profile.get("accelerator", ""),
                "region": profile.get("region", ""),
            }
        )
    step = db.get("next_step", 0)
    oldest = db.oldest_buffered_version()
    counts = {s: sum(1 for w in workers if w["state"] == s) for s in STATES}
    run = {
        "step": step,
        "policy_version": policy_version,
        "staleness_bound": c.staleness,
        # What the oldest waiting group would have if the learner took it now.
        "staleness_now": None if oldest is None else step - oldest,
        "spend_usd": stats.get("cost/usd", 0.0),
        "spend_usd_per_hour": sum(
            w["price_per_hour"] for w in workers if w["state"] not in ("gone", "quarantined")
        ),
        "run_over": db.get("run_over") is not None,
        "workers": counts,
    }
    if only is not None:
        workers = [w for w in workers if w["worker_id"] == only]
    return {**stats, "run": run, "workers": workers}
