"""Who may register what, over real HTTP on loopback (bridge/control/trust/identity.py): a worker
cannot take a provisioned or live worker's name, nor see other workers' names in
`GET /v1/status`, and a credential or a remote host registers a bounded number of worker
ids, in a burst and live at once. "Remote" here is loopback with the identity's loopback
test turned off: the shared secret from 127.0.0.1 then names the host `host:127.0.0.1`."""

import httpx
import pytest
from controller_helpers import PROFILE, make

from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.trust import identity as identity_lib
from bridge.control.trust.identity import mint_credential


@pytest.fixture
def serve(tmp_path):
    made = []

    def start(**cfg):
        ctl = make(tmp_path, **cfg)
        server = serve_controller(ctl, str(tmp_path), ServerOptions())
        made.append((ctl, server))
        return ctl, server, load_or_create_join_secret(str(tmp_path))

    yield start
    for ctl, server in made:
        server.stop()
        ctl.close()


def register(url, presented, name=""):
    profile = {**PROFILE, "name": name}
    return httpx.post(url + "/v1/register", json={"join_secret": presented, "profile": profile})


def bearer(r) -> dict:
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def follower_view(ctl) -> dict:
    """name -> state as the fleet follower reads them (learner_jax/rl/fleet.py)."""
    rows = sorted(ctl.status()["workers"], key=lambda w: -w["last_contact_s"])
    return {w["name"]: w["state"] for w in rows if w["name"]}


def test_a_worker_cannot_take_a_provisioned_or_live_name(serve):
    ctl, server, secret = serve()
    url = server.url
    honest = bearer(register(url, secret, "local-0"))  # the binary's own worker (loopback)
    assert httpx.post(url + "/v1/heartbeat", headers=honest, json={"worker_version": 0}).is_success
    mallory = mint_credential(secret, "mallory")
    spy = bearer(register(url, mallory))
    # A worker's status shows the run and its own row: no other worker's name or identity.
    seen = httpx.get(url + "/v1/status", headers=spy).json()
    assert [w["identity"] for w in seen["workers"]] == ["cred:mallory"], seen["workers"]
    assert "local-0" not in str(seen["workers"]) and seen["run"]["workers"]["active"] == 2
    # The operator (join secret) sees the whole table.
    full = httpx.get(url + "/v1/status", headers={"Authorization": f"Bearer {secret}"}).json()
    assert {w["name"] for w in full["workers"]} == {"local-0", ""}
    # Registering as the live worker's name, then leaving, does not make it look gone.
    r = register(url, mallory, "local-0")
    assert r.status_code == 409 and "local-0" in r.text, r.text
    assert follower_view(ctl) == {"local-0": "active"}
    # A name squatted before its provisioned worker starts is taken back by that worker,
    # and the squatter's row no longer carries it.
    squat = bearer(register(url, mallory, "local-1"))
    assert bearer(register(url, secret, "local-1"))
    assert httpx.post(url + "/v1/leave", headers=squat).is_success
    assert follower_view(ctl) == {"local-0": "active", "local-1": "active"}
    mallorys = [w["name"] for w in ctl.status()["workers"] if w["identity"] == "cred:mallory"]
    assert mallorys == ["", ""]  # the spy and the squatter
    # The credential of a name owns it too; another credential does not.
    r = register(url, mint_credential(secret, "eve"), "sky-0")
    assert r.status_code == 200
    assert register(url, mint_credential(secret, "bob"), "sky-0").status_code == 409
    assert register(url, mint_credential(secret, "sky-0"), "sky-0").status_code == 200


def test_a_remote_host_registers_a_bounded_burst_and_live_count(serve, monkeypatch):
    monkeypatch.setattr(identity_lib, "is_loopback", lambda ip: False)
    ctl, server, secret = serve(register_identity_burst=4.0, register_identity_rate_per_s=0.01)
    codes = [register(server.url, secret).status_code for _ in range(40)]
    assert codes == [200] * 4 + [429] * 36, codes
    r = register(server.url, secret)
    assert int(r.headers["retry-after"]) >= 1 and r.json()["retry_after_s"] > 0
    # The same from one credential: its burst is its own.
    codes = [register(server.url, mint_credential(secret, "c")).status_code for _ in range(40)]
    assert codes == [200] * 4 + [429] * 36, codes
    live = [w for w in ctl.status()["workers"] if w["state"] != "gone"]
    assert len(live) == 5  # four of the host, the credential's newest


def test_a_remote_host_holds_a_bounded_number_of_live_workers(serve, monkeypatch):
    monkeypatch.setattr(identity_lib, "is_loopback", lambda ip: False)
    ctl, server, secret = serve(
        register_identity_burst=100.0, max_live_workers_per_address=8, register_burst=100.0
    )
    replies = [register(server.url, secret) for _ in range(40)]
    assert [r.status_code for r in replies] == [200] * 8 + [429] * 32
    assert "max_live_workers_per_address" in replies[-1].text
    # One leaves: one more may register.
    assert httpx.post(server.url + "/v1/leave", headers=bearer(replies[0])).is_success
    assert register(server.url, secret).status_code == 200
    assert register(server.url, secret).status_code == 429
    # The operator's own machine is not limited.
    monkeypatch.setattr(identity_lib, "is_loopback", lambda ip: True)
    assert all(register(server.url, secret).status_code == 200 for _ in range(10))
