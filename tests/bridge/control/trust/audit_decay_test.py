"""The audit's per-worker score (bridge/control/audit.WorkerAudit) against a float64
reference of its closed form: token-decayed sums (weight exp(-tokens / window) on the past,
its square on the sampling check's variance), a CUSUM of the evidence reset at 0, and the
order of the verdicts (evidence at any token count; then, past min_tokens, |Z|, then the
mean k3 and mean log-ratio), each threshold at its exact edge."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from controller_helpers import Clock, make, worker
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from bridge.control.config import ControllerConfig
from bridge.control.protocol import WorkerProfile
from bridge.control.trust import audit

CFG = audit.AuditConfig(
    kl_threshold=0.25,
    logratio_threshold=0.5,
    min_tokens=64,
    window_tokens=100,
    sampling_z=3.0,
    sampling_evidence=20.0,
)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    ctl = make(tmp_path_factory.mktemp("audit"))
    yield ctl.db
    ctl.close()


def _stat(w, tokens, k3=0.0, lr=0.0, dev=0.0, var=0.0, ev=0.0):
    return audit.AuditStat(w, 0, tokens=tokens, sum_k3=k3, sum_logratio=lr, sum_dev=dev,
                           sum_var=var, sum_evidence=ev)  # fmt: skip


def _reference(stats, c):
    """The sums and the verdict after each stat, in float64 by the module docstring."""
    s = dict(k3=0.0, lr=0.0, n=0.0, total=0.0, dev=0.0, var=0.0, cusum=0.0)
    out = []
    for x in stats:
        keep = math.exp(-x.tokens / c.window_tokens)
        s = dict(
            k3=keep * s["k3"] + x.sum_k3,
            lr=keep * s["lr"] + x.sum_logratio,
            n=keep * s["n"] + x.tokens,
            total=s["total"] + x.tokens,
            dev=keep * s["dev"] + x.sum_dev,
            var=keep**2 * s["var"] + x.sum_var,
            cusum=max(0.0, s["cusum"] + x.sum_evidence),
        )
        z = s["dev"] / math.sqrt(s["var"]) if s["var"] > 0 else 0.0
        if s["cusum"] >= c.sampling_evidence:
            verdict = "evidence"
        elif s["total"] < c.min_tokens:
            verdict = None
        elif abs(z) > c.sampling_z:
            verdict = "z+" if z > 0 else "z-"
        elif s["k3"] / s["n"] > c.kl_threshold or abs(s["lr"] / s["n"]) > c.logratio_threshold:
            verdict = "far"
        else:
            verdict = None
        out.append((dict(s), verdict))
    return out


def _kind(why):
    if why is None:
        return None
    if why.startswith("sampled tokens likelier than the policy samples: evidence"):
        return "evidence"
    if why.startswith("sampled tokens likelier than the policy samples: Z +"):
        return "z+"
    if why.startswith("sampled tokens less likely than the policy samples: Z -"):
        return "z-"
    if why.startswith("behaviour log-probs far from the learner's: mean k3"):
        return "far"
    return why


_stats = st.lists(
    st.tuples(
        st.integers(1, 300),  # tokens
        st.floats(0.0, 0.6),  # mean k3 per token
        st.floats(-1.0, 1.0),  # mean log-ratio per token
        st.floats(-1.0, 1.0),  # mean deviation per token
        st.floats(0.01, 1.0),  # mean variance per token
        st.floats(-3.0, 3.0),  # evidence
    ),
    min_size=1,
    max_size=6,
)


_ids = itertools.count()


# No shrinking: a failing sequence of a few stats is readable as drawn, and mutation runs
# fail it hundreds of times.
@settings(max_examples=40, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(rows=_stats)
def test_sums_and_verdicts_follow_the_float64_reference(db, rows):
    w = f"w{next(_ids)}"
    a = audit.WorkerAudit(CFG, db)
    stats = [_stat(w, n, k * n, lr * n, d * n, v * n, e) for n, k, lr, d, v, e in rows]
    for x, (want, verdict) in zip(stats, _reference(stats, CFG), strict=True):
        assert _kind(a.add(x)) == verdict
        got = db.audit_sums(w)
        for key, value in want.items():
            # a handful of float64 multiply-adds of values up to ~300 each
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12 * (1 + want["n"]))
        score = a.score(w)
        assert score["kl"] == pytest.approx(want["k3"] / want["n"], rel=1e-12, abs=1e-15)
        assert score["logratio"] == pytest.approx(want["lr"] / want["n"], rel=1e-12, abs=1e-15)
        assert score["sampling_evidence"] == pytest.approx(want["cusum"], rel=1e-12, abs=1e-12)
        assert score["tokens"] == want["total"]
        z = want["dev"] / math.sqrt(want["var"])
        assert score["sampling_z"] == pytest.approx(z, rel=1e-9, abs=1e-12)


def test_each_threshold_at_its_edge(db):
    a = audit.WorkerAudit(CFG, db)
    # Mean k3 exactly at the threshold passes; a hair above quarantines (one stat: the
    # decayed sums are the stat's own, exactly).
    assert a.add(_stat("k3-at", 64, k3=0.25 * 64)) is None
    assert _kind(a.add(_stat("k3-over", 64, k3=0.25 * 64 + 1e-9))) == "far"
    assert a.add(_stat("lr-at", 64, lr=-0.5 * 64)) is None
    assert _kind(a.add(_stat("lr-over", 64, lr=-0.5 * 64 - 1e-9))) == "far"  # |mean|
    assert _kind(a.add(_stat("lr-over+", 64, lr=0.5 * 64 + 1e-9))) == "far"
    # min_tokens: 63 tokens are not judged, 64 are.
    assert a.add(_stat("few", 63, k3=63.0)) is None
    assert _kind(a.add(_stat("enough", 64, k3=64.0))) == "far"
    # |Z| exactly at sampling_z passes (dev 3, var 1); above it quarantines, either sign.
    assert a.add(_stat("z-at", 64, dev=3.0, var=1.0)) is None
    assert a.add(_stat("z-at-", 64, dev=-3.0, var=1.0)) is None
    assert _kind(a.add(_stat("z-over", 64, dev=3.0 + 1e-9, var=1.0))) == "z+"
    assert _kind(a.add(_stat("z-under", 64, dev=-3.0 - 1e-9, var=1.0))) == "z-"
    # The evidence threshold is reached at equality, before min_tokens.
    assert a.add(_stat("ev-below", 1, ev=20.0 - 1e-9)) is None
    assert _kind(a.add(_stat("ev-at", 1, ev=20.0))) == "evidence"


def test_switches_off_and_what_is_not_counted(db):
    off = audit.WorkerAudit(audit.AuditConfig(**{**vars(CFG), "sampling_z": 0.0,
                                                   "sampling_evidence": 0.0}), db)  # fmt: skip
    # Z = +-100 and evidence 1e3 judge nothing with their checks off (0 = off).
    assert off.add(_stat("z-off", 64, dev=100.0, var=1.0, ev=1e3)) is None
    assert off.add(_stat("z-off-", 64, dev=-100.0, var=1.0)) is None
    a = audit.WorkerAudit(CFG, db)
    assert a.add(_stat("empty", 0, k3=1e9)) is None  # no tokens: nothing to judge
    assert db.audit_sums("empty") is None
    for bad in (math.nan, math.inf, -math.inf):
        for field in ("k3", "lr", "dev", "var", "ev"):
            w = f"nonfinite-{field}-{bad}"
            assert a.add(_stat(w, 64, **{field: bad})) == "non-finite audit numbers"
            assert db.audit_sums(w) is None  # and the sums are not poisoned
    assert a.add(_stat("empty-nan", 0, k3=math.nan)) is None
    # A negative evidence resets the CUSUM at 0, so an honest past cannot bank credit.
    a.add(_stat("cusum", 1, ev=-50.0))
    assert db.audit_sums("cusum")["cusum"] == 0.0
    assert _kind(a.add(_stat("cusum", 1, ev=20.0))) == "evidence"
    assert a.score("never-audited") == {"kl": 0.0, "logratio": 0.0, "sampling_z": 0.0,
                                        "sampling_evidence": 0.0, "tokens": 0.0}  # fmt: skip


def test_from_config_reads_every_audit_key(db):
    c = ControllerConfig(
        audit_kl_threshold=0.3, audit_logratio_threshold=0.4, audit_min_tokens=5,
        audit_window_tokens=7, audit_sampling_z=8.0, audit_sampling_evidence=9.0,
        exact_quarantine_tokens=10, exact_quarantine_fraction=0.11, exact_flip_tokens=12,
        exact_flip_fraction=0.13,
    )  # fmt: skip
    got = audit.WorkerAudit.from_config(c, db).config
    assert got == audit.AuditConfig(0.3, 0.4, 5, 7, 8.0, 9.0, 10, 0.11, 12, 0.13)


def test_fold_quarantines_once_and_counts_tokens(tmp_path):
    ctl = make(tmp_path, Clock(), audit_min_tokens=10, audit_kl_threshold=0.25)
    cheat, honest = worker(ctl), worker(ctl)
    far = _stat(cheat, 10, k3=10.0)
    fine = _stat(honest, 20, k3=0.0)
    out = ctl.auditor.fold([far, fine, far], now=5.0)
    assert out == [cheat]  # the second stat of the same worker does not quarantine twice
    assert ctl.db.get("audit/tokens") == 40
    assert ctl.db.get("fleet/quarantined") == 1
    assert ctl.db.quarantined()[cheat]["at"] == 5.0
    assert ctl.auditor.fold([far], now=6.0) == []  # already quarantined
    assert ctl.auditor.fold([_stat("no-such-worker", 10, k3=10.0)], now=7.0) == []
    assert ctl.db.get("fleet/quarantined") == 1
    ctl.close()


def test_vouches_only_past_min_tokens_of_its_own(tmp_path):
    ctl = make(tmp_path, Clock(), audit_min_tokens=10_000)
    w = worker(ctl)
    assert not audit.vouches(ctl.db, w, 10)  # nothing audited yet: nobody is vouched for
    ctl.auditor.fold([_stat(w, 9)], now=1.0)
    assert not audit.vouches(ctl.db, w, 10)
    assert not audit.vouches(ctl.db, "other", 10)  # audited run, no tokens of its own
    ctl.auditor.fold([_stat(w, 1)], now=1.0)
    assert audit.vouches(ctl.db, w, 10)  # exactly min_tokens
    ctl.close()


def test_row_sums_to_worker_stats_adds_every_sum_per_worker():
    ids = ["a", "b", "a", "", "a", "c"]
    on = [True, True, True, True, False, True]
    k3s, lrs, ns = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], [0.5, -1.0, 0.25, 3.0, 5.0, 7.0], [
        3, 4, 5, 6, 7, 0]  # fmt: skip
    dev, var, ev = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [
        -1.0, 2.0, -3.0, 4.0, 5.0, 6.0]  # fmt: skip
    got = audit.row_sums_to_worker_stats(ids, on, k3s, lrs, ns, 9, dev, var, ev)
    # "" has no worker, row 4 is off-policy, row 5 has no tokens
    assert got == [
        audit.AuditStat("a", 9, 8, 5.0, 0.75, 0.4, 4.0, -4.0),
        audit.AuditStat("b", 9, 4, 2.0, -1.0, 0.2, 2.0, 2.0),
    ]
    assert isinstance(got[0].tokens, int) and isinstance(got[0].version, int)
    plain = audit.row_sums_to_worker_stats(ids, on, k3s, lrs, ns, 9)
    assert [(s.sum_dev, s.sum_var, s.sum_evidence) for s in plain] == [(0.0, 0.0, 0.0)] * 2
    # dev without var (or var without dev) is not a measurement: both read as zeros
    half = audit.row_sums_to_worker_stats(ids, on, k3s, lrs, ns, 9, row_dev=dev)
    assert [(s.sum_dev, s.sum_var) for s in half] == [(0.0, 0.0)] * 2
    half = audit.row_sums_to_worker_stats(ids, on, k3s, lrs, ns, 9, row_var=var)
    assert [(s.sum_dev, s.sum_var) for s in half] == [(0.0, 0.0)] * 2
    with pytest.raises(ValueError):
        audit.row_sums_to_worker_stats(ids, on[:-1], k3s, lrs, ns, 9)


def test_row_workers_repeats_each_group_worker():
    class G:
        def __init__(self, w):
            self.worker_id = w

    assert audit.row_workers([G("a"), G("b")], 3) == ["a", "a", "a", "b", "b", "b"]


def test_evidence_adds_up_per_credential_and_loopback_workers_alone(tmp_path):
    ctl = make(tmp_path, Clock(), audit_min_tokens=10)
    profile = WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=8)
    first, _ = ctl.register(profile, identity="cred:x")
    again, _ = ctl.register(profile, identity="cred:x")
    l1, _ = ctl.register(profile, identity="local")
    l2, _ = ctl.register(profile, identity="local")
    ctl.auditor.add(_stat(first, 6, k3=0.6))
    ctl.auditor.add(_stat(again, 4, k3=0.4))
    assert ctl.auditor.score(again)["tokens"] == 10 == ctl.auditor.score(first)["tokens"]
    assert ctl.db.audit_sums("cred:x")["total"] == 10
    ctl.auditor.fold([_stat(l1, 10)], now=1.0)
    assert ctl.auditor.score(l1)["tokens"] == 10 and ctl.auditor.score(l2)["tokens"] == 0
    assert audit.vouches(ctl.db, l1, 10) and not audit.vouches(ctl.db, l2, 10)
    assert audit.vouches(ctl.db, again, 10)  # its credential's 10 tokens
    ctl.close()


def test_small_thresholds_and_single_tokens(db):
    # Thresholds below 1 still judge (0 is off, not 1): evidence 0.5, |Z| 0.5, and a Z of
    # +0.8 (inside (0.5, 1]) reads as likelier tokens.
    small = audit.WorkerAudit(audit.AuditConfig(**{**vars(CFG), "sampling_z": 0.5,
                                                     "sampling_evidence": 0.5}), db)  # fmt: skip
    assert _kind(small.add(_stat("ev-small", 1, ev=0.75))) == "evidence"
    assert _kind(small.add(_stat("z-small", 64, dev=0.8, var=1.0))) == "z+"
    assert _kind(small.add(_stat("z-small-", 64, dev=-0.8, var=1.0))) == "z-"
    # One token is a measurement: its non-finite numbers are refused, its row is counted.
    a = audit.WorkerAudit(CFG, db)
    assert a.add(_stat("one-nan", 1, k3=math.nan)) == "non-finite audit numbers"
    (one,) = audit.row_sums_to_worker_stats(["w"], [True], [0.5], [0.25], [1], 2)
    assert (one.tokens, one.sum_k3, one.sum_logratio) == (1, 0.5, 0.25)


def test_row_sums_trace_under_jit():
    # The jitted train step calls row_sums with xp=jax.numpy on tracers: every array op
    # must be xp's, not numpy's.
    rng = np.random.default_rng(1)
    learner, behaviour = rng.normal(-2.0, 0.5, (2, 5)), rng.normal(-2.0, 0.5, (2, 5))
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = jax.jit(lambda a, b, m: audit.row_sums(a, b, m, xp=jnp))(
        f32(learner), f32(behaviour), f32(mask)
    )
    want = audit.row_sums(learner, behaviour, mask.astype(np.float64))
    for g, w in zip(got, want, strict=True):
        # float32 of O(1) terms, <= 5 per row: well within 1e-5 of the row's scale
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)
