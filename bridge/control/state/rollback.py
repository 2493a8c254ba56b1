"""Undoing what a crashed run did past its last checkpoint, when a rerun resumes from it.

    rollback.roll_back(db, version)   # inside the controller's lock and a transaction

The versions a crashed run published after checkpoint `version` are gone: the rerun
republishes those numbers with other weights (learner_jax/rl/weights.py `open_store` deletes
them from the store). Nothing sampled by them may be trained on, so:
- buffered groups with any token from such a version go back to the queue;
- leases taken at such a version, or held by workers serving one, end (their groups
  requeue) and those workers' versions become unknown (-1) until they report the version
  they swap to;
- the announcement is cleared, so the rerun may announce `version` again.
Groups accepted from versions <= `version` stay buffered and the rerun trains on them:
nothing accepted that is still valid is lost (before this, the whole database was moved
aside; the chaos soak's audit counted the accepted groups that were lost).
"""

from __future__ import annotations

import logging

from bridge.control.protocol import VersionAnnouncement
from bridge.control.state.db import ControllerDB


def roll_back(db: ControllerDB, version: int) -> dict:
    """Undo everything newer than checkpoint `version` (see the module docstring)."""
    requeued = db.buffered_newer_than(version)
    db.requeue(requeued)
    db.incr("groups/rolled_back", len(requeued))
    leases = 0
    for w in db.workers():
        newer = w["version"] > version
        for lease_id in db.active_leases(w["worker_id"]):
            # The lease's own version as well: the worker's row can lag the version it took
            # the lease at (a kill right after the grant). Such a lease, kept, was renewed
            # by the worker's heartbeats although its submission had failed, and held the
            # rerun's admission full until its age cap (a chaos soak hang).
            if newer or db.get(f"lease_version/{lease_id}", -1) > version:
                db.end_lease(lease_id, "rolled_back")
                leases += 1
        if newer:
            db.update_worker(w["worker_id"], version=-1)
    announced = VersionAnnouncement(**db.get("announcement", {"version": -1})).version
    if announced > version:
        db.put("announcement", VersionAnnouncement(version=-1).model_dump())
    out = {"requeued_groups": len(requeued), "ended_leases": leases, "announced": announced}
    if requeued or leases or announced > version:
        logging.warning("rolled back to checkpoint version %d: %s", version, out)
    return out
