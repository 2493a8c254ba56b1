"""Undoing what a crashed run did past its last checkpoint, when a rerun resumes from it.

    rollback.roll_back(db, version)   # inside the controller's lock and a transaction

The versions a crashed run published after checkpoint `version` are gone: the rerun
republishes those numbers with other weights (learner_jax/rl/weights.py `open_store` deletes
them from the store). Nothing sampled by them may be trained on, so:
- buffered groups with any token from such a version go back to the queue;
- leases held by workers serving such a version end (their groups requeue) and those
  workers' versions become unknown (-1) until they report the version they swap to;
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
        if w["version"] > version:
            for lease_id in db.active_leases(w["worker_id"]):
                db.end_lease(lease_id, "rolled_back")
                leases += 1
            db.update_worker(w["worker_id"], version=-1)
    announced = VersionAnnouncement(**db.get("announcement", {"version": -1})).version
    if announced > version:
        db.put("announcement", VersionAnnouncement(version=-1).model_dump())
    out = {"requeued_groups": len(requeued), "ended_leases": leases, "announced": announced}
    if requeued or leases or announced > version:
        logging.warning("rolled back to checkpoint version %d: %s", version, out)
    return out
