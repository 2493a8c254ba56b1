"""Who registered a worker, so that a quarantine sticks to the party, not only to its id.

The join secret is shared: a registration with it cannot say who presents it, so a
quarantined worker could register again under a new id and start from zero evidence (issue
23 item 11). Three identities, from strongest to weakest:

- `cred:<name>`: a per-worker credential the operator mints from the join secret and hands
  to one remote worker instead of the secret itself (the worker passes it like the secret,
  `--join_secret` or `--token_file`):

      python -m bridge.control.trust.identity NAME --token_file=<workdir>/join_token

  It is `w1.<name>.<HMAC-SHA256(secret, name)>`: the controller checks it against every
  accepted secret (a rotation retires the credentials of the old one after its grace), and
  holding one does not let anyone mint another. A credential holds at most one live
  registration: a new one supersedes the previous (that one leaves: its leases are released,
  its token dies), so one credential cannot mint a fleet of ids. Once any worker of a
  credential is quarantined, the credential registers no more (403), restarts included.
- `host:<ip>`: the shared secret itself presented from a non-loopback address. A quarantine
  bans the address: the shared secret registers no more from that host (other workers
  already registered there keep running and are audited on their own). An attacker who
  changes address gets in again, which is why remote workers should get credentials.
- `local`: the shared secret from loopback, i.e. the operator's own machine (the training
  binary's local workers, which rejoin after a restart). Never banned.

What an identity may do besides (workers.py, limits.py): a `host:` identity holds at most
`max_live_workers_per_address` live workers (a credential holds one, above), and every
identity but `local` registers at most `register_identity_burst` at once, then
`register_identity_rate_per_s`.

Names: a worker's `--name` (what provisioners and the fleet follower know their workers by)
is bound to the identity that first registered it (`name/<name>` in `kv`); another identity
cannot register under it (409), so a worker cannot take a provisioned or live worker's
name, and the status table shows a name only on the rows of its owner. Two identities may
take a name over: `local` (the operator's own machine: the binary's provisioned workers)
and the credential of that very name (`cred:<name>`, which only the operator can mint), so
a name squatted before its worker started is taken back.

The binding is two keys of the controller's `kv` table (`identity/<worker_id>` and
`identity_live/<identity>`), and the ban is derived from the `quarantine` table, so both
survive a controller restart without state of their own. Workers registered before this
existed have no identity and are banned by nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import re

from bridge.broadcast.relay_address import is_loopback

_PREFIX = "w1"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAC_HEX = 64
LOCAL = "local"


def _mac(secret: str, name: str) -> str:
    return hmac.new(
        secret.encode(), b"echo2 worker credential\0" + name.encode(), hashlib.sha256
    ).hexdigest()


def mint_credential(secret: str, name: str) -> str:
    """The credential of worker `name` under the join secret `secret`."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"credential name {name!r}: 1-64 of A-Z a-z 0-9 _ -")
    return f"{_PREFIX}.{name}.{_mac(secret, name)}"


def identity_of(presented: str, accepted_secrets: list[str], caller_ip: str | None) -> str | None:
    """The identity a registration presenting `presented` from `caller_ip` gets, or None
    when it is neither an accepted secret nor a credential minted from one. Every
    comparison is constant-time and none exits early."""
    got = presented.encode()
    shared = False
    for s in accepted_secrets:
        shared |= hmac.compare_digest(got, s.encode())
    if shared:
        return LOCAL if is_loopback(caller_ip) else f"host:{caller_ip}"
    prefix, _, rest = presented.partition(".")
    name, _, mac = rest.rpartition(".")
    if prefix != _PREFIX or not _NAME.fullmatch(name) or len(mac) != _MAC_HEX:
        return None
    ok = False
    for s in accepted_secrets:
        ok |= hmac.compare_digest(mac.encode(), _mac(s, name).encode())
    return f"cred:{name}" if ok else None


class IdentityBook:
    """Binds worker ids to identities in the controller's database (the caller holds its
    transaction) and says which identities may not register any more."""

    def __init__(self, db):
        self.db = db

    def refused(self, identity: str | None) -> str | None:
        """Why `identity` may not register (a worker of it was quarantined), else None."""
        if not identity or identity == LOCAL:
            return None
        for worker_id in self.db.quarantined():
            if self.db.get(f"identity/{worker_id}") == identity:
                return f"{identity} is quarantined (worker {worker_id}); it cannot register again"
        return None

    def bind(self, worker_id: str, identity: str | None) -> str | None:
        """Record `worker_id` as registered by `identity`; returns the worker a credential
        registered before (to be superseded), else None."""
        if not identity:
            return None
        self.db.put(f"identity/{worker_id}", identity)
        if not identity.startswith("cred:"):
            return None
        previous = self.db.get(f"identity_live/{identity}")
        self.db.put(f"identity_live/{identity}", worker_id)
        return previous

    def of(self, worker_id: str) -> str | None:
        return self.db.get(f"identity/{worker_id}")

    def name_refused(self, name: str, identity: str | None) -> str | None:
        """Why `identity` may not register as `name` (another identity holds it), else None."""
        if not name or identity is None:  # no name; an in-process caller (tests, benches)
            return None
        owner = self.db.get(f"name/{name}")
        if owner in (None, identity) or identity in (LOCAL, f"cred:{name}"):
            return None
        return f"the name {name!r} belongs to another worker; choose another --name"

    def bind_name(self, name: str, identity: str | None) -> None:
        if name and identity is not None:
            self.db.put(f"name/{name}", identity)

    def table(self) -> tuple[dict[str, str], dict[str, str]]:
        """(worker id -> identity, name -> identity): two scans, for the status table."""
        out: tuple[dict[str, str], dict[str, str]] = ({}, {})
        rows = self.db.q(
            "SELECT key, value FROM kv WHERE key LIKE 'identity/%' OR key LIKE 'name/%'"
        )
        for r in rows:
            kind, _, key = r["key"].partition("/")
            out[kind == "name"][key] = json.loads(r["value"])
        return out

    def workers_of(self, identity: str) -> list[str]:
        """Every worker id `identity` registered (a scan: for a quarantine, not a lease)."""
        rows = self.db.q(
            "SELECT key FROM kv WHERE key LIKE 'identity/%' AND value=?", (json.dumps(identity),)
        )
        return sorted(r["key"].split("/", 1)[1] for r in rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Mint a per-worker join credential.")
    p.add_argument("name", help="the worker's name (1-64 of A-Z a-z 0-9 _ -)")
    p.add_argument("--token_file", required=True, help="the controller's join secret file")
    args = p.parse_args(argv)
    from bridge.control.trust.join_secret import read_secret

    print(mint_credential(read_secret(args.token_file), args.name))


if __name__ == "__main__":
    main()
