"""The sampling seed of each leased group: fresh per lease, unpredictable, recomputable.

seed = HMAC-SHA256(run secret, "lease_id/group_id") truncated to 62 bits. The lease id is
a fresh uuid4, so a group leased again gets a new seed; the secret never leaves the
trusted side, so no worker can predict a seed before its lease, and the controller needs
no table of seeds: the learner's batch recomputes each group's seed from the lease that
delivered it (bridge/control/learner_api.py) and checks every sampled token against it
(bridge/contracts/gumbel.py, learner_jax/rl/exact_check.py). The secret lives in the
controller's database, so a restarted controller gives the same seeds to the leases it
resumes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from bridge.contracts.gumbel import SEED_LIMIT

_KEY = "sampling_secret"


class SamplingSeeds:
    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError("a sampling secret needs at least 16 bytes")
        self._secret = secret

    @classmethod
    def for_db(cls, db) -> SamplingSeeds:
        """The run's secret from the controller database's kv table (made on first use)."""
        hexed = db.get(_KEY)
        if hexed is None:
            hexed = secrets.token_hex(32)
            with db.tx():
                db.put(_KEY, hexed)
        return cls(bytes.fromhex(hexed))

    def seed(self, lease_id: str, group_id: int) -> int:
        mac = hmac.new(self._secret, f"{lease_id}/{int(group_id)}".encode(), hashlib.sha256)
        return int.from_bytes(mac.digest()[:8], "big") % SEED_LIMIT
