"""Make a provisioner's fleet follow a target: the activation decision, or a count.

    status = controller.status()                   # or GET /v1/status
    want = active_names(status, decision.active)   # activation's worker ids -> names
    result = reconcile(prov, want, status["workers"], reason="activation")

`want` is a number of workers, or the set of worker names to keep (the provisioner's
names, which workers report with `--name`; a status row counts for a name only under the
identity the provisioner gave that worker, `handle_states`). One pass:

1. workers that died (`prov.poll()`), and workers the controller reports `gone` or
   `quarantined` (a crashed machine whose launch command said nothing), are released
   and counted dead;
2. a count: start what is missing (replacing the dead), stop the newest extras;
   a set of names: stop every alive worker not in it (standby -> its machine goes back),
   and start one replacement per dead worker that was in it.

Starts go through the provisioner's limits; every start and stop is in its log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from bridge.fleet.provisioner import Provisioner, WorkerHandle

_LOST = ("gone", "quarantined")


@dataclasses.dataclass(frozen=True)
class ReconcileResult:
    started: list[WorkerHandle]
    stopped: list[WorkerHandle]
    dead: list[WorkerHandle]


def active_names(status: dict, worker_ids: Iterable[str]) -> set[str]:
    """The names (`--name`) of the given controller worker ids, from a status dict."""
    ids = set(worker_ids)
    return {w["name"] for w in status["workers"] if w["worker_id"] in ids and w["name"]}


def handle_states(prov: Provisioner, workers: list[dict]) -> dict[str, str]:
    """name -> controller state of each of `prov`'s workers, from status rows. A row counts
    for a handle only with the handle's name AND the identity the provisioner gave it
    (`Provisioner.identity`): a worker that registered one of our names under another
    identity is not ours, and acting on it would stop or keep the wrong machine. A name may
    have registered more than once (a rejoin): its newest row counts."""
    mine = {h.name: prov.identity(h) for h in prov.handles}
    state = {}
    for w in sorted(workers, key=lambda w: -w["last_contact_s"]):
        if w["name"] in mine and w.get("identity") == mine[w["name"]]:
            state[w["name"]] = w["state"]
    return state


def reconcile(
    prov: Provisioner,
    want: int | Iterable[str],
    workers: list[dict] | None = None,
    reason: str = "reconcile",
) -> ReconcileResult:
    """One reconciliation pass (see the module docstring); `workers`: the controller's
    status rows (`status()["workers"]`), to catch deaths the provisioner cannot see."""
    dead = prov.poll()
    if workers:
        state = handle_states(prov, workers)
        for h in prov.alive():
            if state.get(h.name) in _LOST:
                prov.stop(h, f"controller reports it {state[h.name]}")
                dead.append(h)
    started, stopped = [], []
    alive = prov.alive()
    if isinstance(want, int):
        if len(alive) < want:
            why = f"{reason}: replace dead" if dead else f"{reason}: scale up to {want}"
            started = prov.start(want - len(alive), why)
        for h in sorted(alive, key=lambda h: h.started_at)[want:]:
            prov.stop(h, f"{reason}: scale down to {want}")
            stopped.append(h)
    else:
        keep = set(want)
        for h in alive:
            if h.name not in keep:
                prov.stop(h, f"{reason}: standby")
                stopped.append(h)
        lost = sum(1 for h in dead if h.name in keep)
        if lost:
            started = prov.start(lost, f"{reason}: replace dead")
    return ReconcileResult(started, stopped, dead)
