"""The one owner of a rollout worker's weight versions: which version the controller
announced, which the engine serves, which the relay is fetching, which failed to load, and
when to swap.

The newest announced version, seen from the worker (`WeightVersions.state()`):

    NONE        nothing announced yet: no work.
    LOADED      the engine serves it.
    FETCHING    the relay fetches it in the background (peer_swap.PeerSwap.prefetch); the
                worker keeps generating on its loaded version and says so in its lease
                requests (`fetching_version`). Waiting instead idled the worker for its
                whole broadcast hop.
    SWAP_READY  load it now, between leases: the route is the store, the relay's copy is
                in, or the controller refused the fetching claim (too far behind).
    REFUSED     it failed verification or loading: retried after 5 s, doubling to 60 s,
                rather than re-read at every poll; meanwhile the worker generates on its
                loaded version and reports it (`unloadable_version`), and the learner
                publishes it again (bridge/control/leasing/liveness.py). A refusal holds for the
                announcement it refused: the same version announced again (a later
                `published_at`) is another copy in the store, tried at once and read and
                verified afresh, also after a failed canary (`EngineVersion.bad_versions`).

Transitions: `hear` / `note` (a controller reply's route and announcement: NONE or LOADED
-> FETCHING or SWAP_READY), `behind` (a lease refused as behind although the request
claimed the fetch: FETCHING -> SWAP_READY), `ensure` (SWAP_READY -> LOADED or REFUSED;
the backoff's end: REFUSED -> SWAP_READY). Workers swap between leases, so all tokens
of a lease carry the version that generated them; with partial rollouts also mid-lease
(rollout_gpu/worker.py), each token tagged with its own version.

Whatever store the version is read from (the announced one, or the relay's copy), its
manifest must have the SHA-256 the announcement names (`AnnouncedStore`), else the load is
refused before anything is read or swapped.

`hear` and `note` run on the heartbeat thread as well as the main one: they only replace
the announcement (one reference assignment) and start a relay fetch (PeerSwap locks its own
state); everything else runs on the worker's main thread.
"""

from __future__ import annotations

import enum
import hashlib
import time

from absl import logging

from bridge.control.protocol import VersionAnnouncement
from rollout_gpu.engine import RolloutEngine
from rollout_gpu.weight_swap import EngineVersion, WeightSwapError, load_version


class AnnouncedStore:
    """`store` as load_version reads it, the announced version's manifest checked against
    the announced SHA-256 (the bytes checked are the bytes parsed: one read)."""

    def __init__(self, store, ann: VersionAnnouncement):
        self.store, self.ann = store, ann

    def manifest(self, version: int):
        if version != self.ann.version or not self.ann.manifest_sha256:
            return self.store.manifest(version)
        from bridge.store.layout import LAYOUT
        from bridge.store.manifest import Manifest, VersionNotFoundError

        kv = getattr(self.store, "kv", None) or self.store.store.kv  # a _ReportingStore
        r = kv.read(LAYOUT.manifest_key(version)).result()
        if r.state != "value":
            raise VersionNotFoundError(f"version {version} has no manifest")
        got = hashlib.sha256(r.value).hexdigest()
        if got != self.ann.manifest_sha256:
            raise WeightSwapError(
                f"version {version}: the manifest read has sha256 {got}, not the announced "
                f"{self.ann.manifest_sha256}; refused, nothing loaded"
            )
        return Manifest.model_validate_json(r.value)

    def __getattr__(self, name):
        return getattr(self.store, name)


class VersionState(enum.Enum):
    NONE = "none"
    LOADED = "loaded"
    FETCHING = "fetching"
    SWAP_READY = "swap-ready"
    REFUSED = "refused"


class WeightVersions:
    def __init__(self, peers=None, clock=time.monotonic):
        """`peers`: the worker's `PeerSwap` (relay + route), or None to read the store."""
        self.peers, self.clock = peers, clock
        self.announced = VersionAnnouncement(version=-1)
        self.current = EngineVersion()  # what the engine serves, and how to roll back to it
        if peers is not None:  # the base a relay fetches a delta version's patches against
            peers.have = lambda: self.current.version
        # version -> (backoff, retry at, published_at of the announcement refused)
        self._refused: dict[int, tuple[float, float, float]] = {}
        self._swap_now = False  # the controller refused the fetching claim
        self._heard_at = float("-inf")  # clock() of the last controller reply heard

    @property
    def loaded(self) -> int:
        """The version the engine serves; -1 = none yet."""
        return -1 if self.current.version is None else self.current.version

    # -- news ------------------------------------------------------------------------------
    def hear(self, reply) -> None:
        """A heartbeat, lease or submit reply: its route first, so the relay's fetch of a new
        version is under way before the main loop sees the announcement, then the
        announcement."""
        if self.peers is not None:
            self.peers.note_route(reply)
        self.note(reply.announcement)

    def news_age(self) -> float:
        """Seconds since a controller reply last said which version is newest."""
        return self.clock() - self._heard_at

    def note(self, announcement: VersionAnnouncement) -> None:
        self._heard_at = self.clock()
        # Newest by publication time, not by number: a learner rerun after a crash republishes
        # from its checkpoint, so a LOWER number announced later replaces a rolled-back one.
        if (announcement.published_at, announcement.version) >= (
            self.announced.published_at,
            self.announced.version,
        ):
            self.announced = announcement

    def reset(self, announcement: VersionAnnouncement) -> None:
        """A registration's announcement is authoritative, even if older (a new controller)."""
        self._heard_at = self.clock()
        self.announced = announcement

    def behind(self, claimed_fetching: bool) -> None:
        """A lease refused as "behind". With a fetching claim, the controller will not wait
        for the fetch: swap as soon as it is in. Without one it only brought news."""
        self._swap_now = claimed_fetching

    # -- state -----------------------------------------------------------------------------
    def state(self) -> VersionState:
        ann = self.announced
        if ann.version < 0:
            return VersionState.NONE
        if ann.version == self.current.version:
            return VersionState.LOADED
        refused = self._refusal(ann)
        if refused is not None and self.clock() < refused[1]:
            return VersionState.REFUSED
        if self._fetching(ann.version) and not self._swap_now:
            return VersionState.FETCHING
        return VersionState.SWAP_READY

    def _refusal(self, ann: VersionAnnouncement) -> tuple[float, float, float] | None:
        """The refusal of this very announcement; one of an earlier announcement of the same
        version does not count (the learner published it again)."""
        refused = self._refused.get(ann.version)
        return refused if refused is not None and refused[2] == ann.published_at else None

    def _fetching(self, version: int) -> bool:
        """`version` is being fetched in the background while the engine serves another."""
        return (
            self.peers is not None
            and self.current.version is not None
            and self.peers.fetching(version)
        )

    def lease_claims(self) -> dict:
        """The LeaseRequest fields that say which version this worker's work will carry."""
        newest = self.announced.version
        fetching = newest != self.loaded and self._fetching(newest)
        return dict(
            worker_version=self.loaded,
            unloadable_version=newest if self._refusal(self.announced) is not None else -1,
            fetching_version=newest if fetching else -1,
        )

    # -- swap ------------------------------------------------------------------------------
    def ensure(self, engine: RolloutEngine) -> bool:
        """Swap to the newest announced version if it is SWAP_READY; True if the worker can
        take work: LOADED, or FETCHING / REFUSED with a version loaded to generate on."""
        from bridge.store.weight_store import WeightStore

        ann, state = self.announced, self.state()
        if state is VersionState.NONE:
            return False
        if state is VersionState.LOADED:
            self._swap_now = False
            return True
        if ann.store is None:
            logging.error("version %d is announced without a weight store", ann.version)
            return False
        if state is VersionState.REFUSED:
            return self.current.version is not None
        if self.peers is not None and self.current.version is not None:
            self.peers.prefetch(ann)  # heard of it in a submit reply: no fetch under way yet
            state = self.state()
        if state is VersionState.FETCHING:
            return True
        self._swap_now = False
        failed = self._refusal(ann)
        if failed is None:  # announced again: its canary failure was another copy's
            self.current.bad_versions.discard(ann.version)
        t0 = self.clock()
        try:
            # Through the peer relay when the controller routes one (rollout_gpu/peer_swap.py).
            store = self.peers.store_for(ann) if self.peers else WeightStore(ann.store)
            canary = load_version(engine, AnnouncedStore(store, ann), ann.version, self.current)
        except Exception as e:  # noqa: BLE001 - the engine keeps serving the previous version
            wait = min(60.0, 2 * failed[0]) if failed else 5.0
            self._refused = {ann.version: (wait, self.clock() + wait, ann.published_at)}
            logging.error(
                "could not load version %d: %s: %s (retry in %.0f s; generating on version %s "
                "meanwhile)",
                ann.version,
                type(e).__name__,
                e,
                wait,
                self.current.version,
            )
            return self.current.version is not None
        self._refused = {}
        logging.info(
            "now serving version %d (swap %.2fs%s)",
            ann.version,
            self.clock() - t0,
            f", canary {canary.detail}" if canary else "",
        )
        return True
