"""The audit's sampled re-score of older versions (learner_jax/rl/rescore.py): rows tagged
with an older version are scored under that version read back from the weight store, and
the numbers agree with an independent implementation (transformers on the same weights)."""

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from bridge.control.protocol import ConsumedGroup, Trajectory
from bridge.control.trust.audit import AuditStat
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from learner_jax.rl.audit_focus import AuditFocus
from learner_jax.rl.rescore import VersionRescorer


def _hf_dir(path, cfg, weights):
    tiny_model.make_tiny_model(str(path), cfg)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _sample(hf, prompt, n_new, rng, observation=(), temperature=1.0):
    """Sample `n_new` tokens from `hf` at `temperature` (0: greedy, with vLLM's untempered
    log-probs), with `observation` tokens (an environment's, log-prob 0) inserted halfway;
    (completion, its log-probs)."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for k in range(n_new):
            if k == n_new // 2 and observation:
                ids += list(observation)
                lps += [0.0] * len(observation)
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].double()
            logp = torch.log_softmax(logits / (temperature or 1.0), -1).numpy()
            if temperature == 0.0:
                tok = int(np.argmax(logp))
            else:
                tok = int(rng.choice(len(logp), p=np.exp(logp) / np.exp(logp).sum()))
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(prompt) :], lps


def _traj(prompt, completion, logprobs, version, i, mask=None):
    return Trajectory(prompt_id="p", sample_index=i, prompt_token_ids=prompt,
                      completion_token_ids=completion, logprobs=logprobs,
                      versions=[version] * len(completion), finish_reason="length",
                      completion_mask=mask, reward=0.0)  # fmt: skip


def test_rows_of_an_older_version_are_audited_against_that_version(tmp_path):
    cfg = tiny_model.tiny_config("qwen3", num_layers=2)
    old = tiny_model.random_hf_weights(cfg, seed=1, std=0.2)
    new = tiny_model.random_hf_weights(cfg, seed=2, std=0.2)
    store = WeightStore(str(tmp_path / "store"))
    store.publish(3, 3, old.items(), cfg.to_hf_dict(), "float32")
    store.publish(5, 5, new.items(), cfg.to_hf_dict(), "float32")
    hf_old = _hf_dir(tmp_path / "old", cfg, old)
    hf_new = _hf_dir(tmp_path / "new", cfg, new)
    rng = np.random.default_rng(0)
    prompts = [[1, 5 + i, 9, 12 + i] for i in range(4)]
    honest, liar = [], []
    for i, p in enumerate(prompts):
        if i == 0:  # an episode: two observation tokens between two model turns
            c, lp = _sample(hf_old, p, 6, rng, observation=(7, 8))
            honest.append(_traj(p, c, lp, 3, i, mask=[1, 1, 1, 0, 0, 1, 1, 1]))
        else:
            c, lp = _sample(hf_old, p, 6, rng)
            honest.append(_traj(p, c, lp, 3, i))
        c, lp = _sample(hf_new, p, 6, rng)  # sampled by version 5, tagged as version 3
        liar.append(_traj(p, c, lp, 3, i))
    fresh = [_traj(prompts[0], [4, 4], [-1.0, -1.0], 5, 0)]  # the current version: skipped
    groups = [
        ConsumedGroup(group_id=1, prompt_id="p", prompt="", answer="", trajectories=honest,
                      worker_id="honest"),
        ConsumedGroup(group_id=2, prompt_id="p", prompt="", answer="", trajectories=liar,
                      worker_id="liar"),
        ConsumedGroup(group_id=3, prompt_id="p", prompt="", answer="", trajectories=fresh,
                      worker_id="current"),
    ]  # fmt: skip
    rescorer = VersionRescorer(store, cfg, every=2, max_rows=16)
    assert rescorer.maybe(1, groups, current_version=5) == []  # not a re-score step
    stats = {s.worker_id: s for s in rescorer.maybe(2, groups, current_version=5)}
    assert set(stats) == {"honest", "liar"} and stats["honest"].version == 3
    assert stats["honest"].tokens == stats["liar"].tokens == 24
    # fp32 JAX vs fp32 torch on the same stored bytes: numerics only.
    assert stats["honest"].sum_k3 / 24 < 1e-9, stats["honest"]
    assert abs(stats["honest"].sum_logratio) / 24 < 1e-4
    assert stats["liar"].sum_k3 / 24 > 0.01, stats["liar"]  # the audit's default threshold
    assert rescorer.last["audit/rescored_rows"] == 8
    assert rescorer.last["audit/rescored_version_lag"] == 2
    # A version the store no longer keeps cannot be re-scored: nothing is claimed.
    store.gc(keep=1)
    assert rescorer.maybe(4, groups, current_version=5) == []


def test_every_version_tag_is_audited_mixed_rows_token_by_token(tmp_path):
    """Issue 23 item 5: a lie about a version that is not the batch's oldest, and a lie in
    the later part of a mixed row (a swap mid-generation), are both caught; honest mixed
    rows score as honest."""
    cfg = tiny_model.tiny_config("qwen3", num_layers=2)
    weights = {v: tiny_model.random_hf_weights(cfg, seed=v, std=0.2) for v in (3, 4)}
    store = WeightStore(str(tmp_path / "store"))
    for v, w in weights.items():
        store.publish(v, v, w.items(), cfg.to_hf_dict(), "float32")
    hf = {v: _hf_dir(tmp_path / f"v{v}", cfg, w) for v, w in weights.items()}
    rng = np.random.default_rng(0)
    rows = {"honest": [], "liar_v4": [], "liar_mixed": []}
    for i in range(3):
        p = [1, 5 + i, 9, 12 + i]
        c, lp = _sample(hf[3], p, 6, rng)
        rows["honest"].append(_traj(p, c, lp, 3, i))
        a, lpa = _sample(hf[3], p, 3, rng)  # a swap from 3 to 4 after three tokens
        b, lpb = _sample(hf[4], p + a, 3, rng)
        rows["honest"].append(_mixed(p, a + b, lpa + lpb, [3, 3, 3, 4, 4, 4], 10 + i))
        c, lp = _sample(hf[3], p, 6, rng)  # sampled by 3, tagged 4 (not the oldest tag)
        rows["liar_v4"].append(_traj(p, c, lp, 4, i))
        c, lp = _sample(hf[3], p, 6, rng)  # all by 3; the last three claim version 4
        rows["liar_mixed"].append(_mixed(p, c, lp, [3, 3, 3, 4, 4, 4], i))
    groups = [
        ConsumedGroup(group_id=k, prompt_id="p", prompt="", answer="", trajectories=ts,
                      worker_id=w)
        for k, (w, ts) in enumerate(rows.items())
    ]  # fmt: skip
    stats = VersionRescorer(store, cfg, every=1, max_rows=16).maybe(1, groups, 5)
    by = {}
    for s in stats:  # one stat per worker and version: add them up per worker
        a = by.setdefault(s.worker_id, [0.0, 0])
        a[0] += s.sum_k3
        a[1] += s.tokens
    assert by["honest"][1] == 36 and by["liar_v4"][1] == 18 and by["liar_mixed"][1] == 18
    assert by["honest"][0] / 36 < 1e-9, by
    assert by["liar_v4"][0] / 18 > 0.01, by  # past the audit's default threshold
    # Only its three version-4 tokens per row lie: their mean alone is past the threshold.
    v4 = [s for s in stats if s.worker_id == "liar_mixed" and s.version == 4]
    assert v4[0].tokens == 9 and v4[0].sum_k3 / 9 > 0.01, stats


def _mixed(prompt, completion, logprobs, versions, i):
    return Trajectory(prompt_id="p", sample_index=i, prompt_token_ids=prompt,
                      completion_token_ids=completion, logprobs=logprobs, versions=versions,
                      finish_reason="length", reward=0.0)  # fmt: skip


def test_eval_rows_are_audited_under_their_version_and_temperature(tmp_path):
    """Fleet evaluation rows (bridge/control/evaluation/eval_leases.py `take_audit_rows`): re-scored
    under the version evaluated at the eval temperature (greedy: temperature 1, what vLLM
    reports); a worker whose log-probs are another model's is past the threshold, and an
    honest one scored at the wrong temperature would be too (the temperature matters)."""
    cfg = tiny_model.tiny_config("qwen3", num_layers=2)
    weights = {v: tiny_model.random_hf_weights(cfg, seed=v, std=0.2) for v in (6, 7)}
    store = WeightStore(str(tmp_path / "store"))
    store.publish(6, 6, weights[6].items(), cfg.to_hf_dict(), "float32")
    hf = {v: _hf_dir(tmp_path / f"v{v}", cfg, w) for v, w in weights.items()}
    rng = np.random.default_rng(0)
    rows = []
    for i in range(3):
        p = [1, 5 + i, 9, 12 + i]
        for temp in (0.5, 0.0):
            c, lp = _sample(hf[6], p, 6, rng, temperature=temp)
            rows.append(("honest", 6, temp, _traj(p, c, lp, 6, i)))
            c, lp = _sample(hf[7], p, 6, rng, temperature=temp)  # another model's numbers
            rows.append(("liar", 6, temp, _traj(p, c, lp, 6, i)))
    rescorer = VersionRescorer(store, cfg, every=1, max_rows=4)  # 6 rows a kind: 2 chunks
    by = {}
    for s in rescorer.rescore_eval(rows):
        a = by.setdefault(s.worker_id, [0.0, 0])
        a[0] += s.sum_k3
        a[1] += s.tokens
    assert by["honest"][1] == by["liar"][1] == 36
    assert by["honest"][0] / 36 < 1e-9, by
    assert by["liar"][0] / 36 > 0.01, by
    wrong = [(w, v, 1.0, x) for w, v, t, x in rows if w == "honest" and t == 0.5]
    [s] = rescorer.rescore_eval(wrong)
    assert s.tokens == 18 and s.sum_k3 / 18 > 0.01
    # A version the store no longer has is skipped, not an error.
    assert rescorer.rescore_eval([("honest", 9, 0.5, rows[0][3])]) == []


def test_focus_rescores_unsettled_workers_every_step_and_settled_ones_by_sample(tmp_path):
    """Issue 23 item 6, speed (learner_jax/rl/audit_focus.py): rows of a worker with fewer
    than min_tokens audited tokens, or with a sampling Z past half the threshold, are
    re-scored on every step; a settled worker's only on the shared sample's steps, and
    there alongside the unsettled ones (a stream of new workers cannot crowd it out)."""
    cfg = tiny_model.tiny_config("qwen3", num_layers=2)
    store = WeightStore(str(tmp_path / "store"))
    store.publish(3, 3, tiny_model.random_hf_weights(cfg, seed=1).items(), cfg.to_hf_dict(),
                  "float32")  # fmt: skip
    focus = AuditFocus(min_tokens=20, suspect_z=3.0, window_tokens=4096)
    rescorer = VersionRescorer(store, cfg, every=10, max_rows=2, focus=focus)

    def group(worker, k):
        rows = [_traj([1, 5, 9], [4, 6, 8, 10], [-1.0] * 4, 3, i) for i in range(k)]
        return ConsumedGroup(group_id=k, prompt_id="p", prompt="", answer="",
                             trajectories=rows, worker_id=worker)  # fmt: skip

    def tokens(rl_step, *groups):
        out = {}
        for s in rescorer.maybe(rl_step, list(groups), current_version=5):
            out[s.worker_id] = out.get(s.worker_id, 0) + s.tokens
        return out

    focus.note([AuditStat("settled", 3, 100, 0.0, 0.0, sum_dev=1.0, sum_var=50.0)])
    # Not a sample step: max_rows of each new worker's rows (two workers: two chunks), not
    # the settled worker's.
    assert tokens(1, group("new", 3), group("settled", 3), group("new2", 2)) == {
        "new": 8, "new2": 8}  # fmt: skip
    assert rescorer.last["audit/rescored_focus_rows"] == 4
    assert tokens(2, group("new", 3)) == {"new": 8}
    assert tokens(3, group("new", 3)) == {"new": 8}  # 24 tokens: past min_tokens now
    assert not focus.urgent("new") and tokens(4, group("new", 3)) == {}
    # A settled worker whose Z drifts past suspect_z is looked at every step again.
    focus.note([AuditStat("settled", 3, 10, 0.0, 0.0, sum_dev=30.0, sum_var=10.0)])
    assert focus.urgent("settled") and tokens(5, group("settled", 1)) == {"settled": 4}
    # A sample step: max_rows of the settled rows on top of the unsettled worker's.
    assert tokens(10, group("fresh", 2), group("new", 3)) == {"fresh": 8, "new": 8}
    assert rescorer.last["audit/rescored_rows"] == 4
