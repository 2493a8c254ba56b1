"""Recorded MoE routing at the controller's intake: a well-formed record is stored and
reaches the learner's batch unchanged; every malformed one (shape, range, a repeated
expert, k per token, rows per token, not base64, missing when replay needs it, sent for a
dense policy) is refused with a message naming the fault and leaves the controller's
state exactly as it was."""

import numpy as np
import pytest
from controller_helpers import dump, make, result, worker

from bridge.contracts import routing
from bridge.control.intake.validation import RoutingRule
from bridge.control.protocol import LeaseRequest, RoutedExperts, Submission

LAYERS, K, EXPERTS = 3, 2, 8
RULE = RoutingRule(num_layers=LAYERS, k=K, num_experts=EXPERTS, required=True)


def ids_for(prompt_len, completion_len, seed=0):
    """Valid routing: k distinct experts per row and layer."""
    rng = np.random.default_rng(seed)
    rows = routing.num_rows(prompt_len, completion_len)
    return np.stack(
        [[rng.permutation(EXPERTS)[:K] for _ in range(LAYERS)] for _ in range(rows)]
    ).astype(np.int32)


def wire(ids):
    return RoutedExperts(**routing.encode(ids))


def leased(tmp_path, rule=RULE):
    ctl = make(tmp_path, routing=rule)
    wid = worker(ctl)
    ctl.publish(0)
    lease = ctl.lease(wid, LeaseRequest(worker_version=0, max_groups=1)).lease
    return ctl, wid, lease, lease.groups[0]


def submit(ctl, wid, lease, group, make_routing):
    """Submit the group with each sample's routing from make_routing(prompt_len, i)."""
    res = result(group)
    trajs = [
        t.model_copy(update={"routed_experts": make_routing(len(t.prompt_token_ids), i)})
        for i, t in enumerate(res.trajectories)
    ]
    res = res.model_copy(update={"trajectories": trajs})
    return ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[res]))


def test_valid_routing_reaches_the_learner_unchanged(tmp_path):
    ctl, wid, lease, group = leased(tmp_path)
    sent = {}

    def make_routing(p, i):
        sent[i] = ids_for(p, 3, seed=i)
        return wire(sent[i])

    assert submit(ctl, wid, lease, group, make_routing).accepted == [group.group_id]
    batch, _ = ctl.take_batch(0, 1)
    [g] = [g for g in batch if g.group_id == group.group_id]
    for t in g.trajectories:
        r = t.routed_experts
        got = routing.decode(r.num_layers, r.k, r.ids)
        np.testing.assert_array_equal(got, sent[t.sample_index])


def _shifted(ids):
    out = ids.copy()
    out[1, 2, 0] = EXPERTS  # one id past the last expert
    return out


def _repeated(ids):
    out = ids.copy()
    out[4, 1, 1] = out[4, 1, 0]
    return out


BAD = {
    "expert id 8 outside [0, 8)": lambda p, i: wire(_shifted(ids_for(p, 3))),
    "names expert": lambda p, i: wire(_repeated(ids_for(p, 3))),
    "expected (": lambda p, i: wire(ids_for(p, 2)),  # one row short (a completion token)
    "expected (  ": lambda p, i: wire(ids_for(p, 4)),  # one row too many
    "expected (   ": lambda p, i: wire(ids_for(p, 3)[:, :, :1]),  # k = 1 per token
    "expected (    ": lambda p, i: wire(ids_for(p, 3)[:, :2]),  # a layer missing
    "not base64": lambda p, i: RoutedExperts(num_layers=LAYERS, k=K, ids="@@not base64@@"),
    "whole number of rows": lambda p, i: RoutedExperts(
        num_layers=LAYERS, k=K, ids=routing.encode(ids_for(p, 3))["ids"][:-8]
    ),
    "every trajectory must carry it": lambda p, i: None if i == 1 else wire(ids_for(p, 3)),
}


@pytest.mark.parametrize("fault", list(BAD))
def test_malformed_routing_is_refused_and_changes_nothing(tmp_path, fault):
    ctl, wid, lease, group = leased(tmp_path)
    before = dump(ctl)
    with pytest.raises(ValueError) as err:
        submit(ctl, wid, lease, group, BAD[fault])
    assert fault.strip() in str(err.value), str(err.value)
    assert getattr(err.value, "status", None) == 422
    assert dump(ctl) == before


def test_routing_for_a_dense_policy_is_refused(tmp_path):
    ctl, wid, lease, group = leased(tmp_path, RoutingRule())
    before = dump(ctl)
    with pytest.raises(ValueError, match="policy has no experts"):
        submit(ctl, wid, lease, group, lambda p, i: wire(ids_for(p, 3)))
    assert dump(ctl) == before
    # ... and a dense policy's trajectories need none.
    assert submit(ctl, wid, lease, group, lambda p, i: None).accepted == [group.group_id]


def test_encoding_round_trips():
    ids = ids_for(5, 4)
    fields = routing.encode(ids)
    np.testing.assert_array_equal(routing.decode(**fields), ids)
