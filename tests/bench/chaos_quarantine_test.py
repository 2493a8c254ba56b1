"""The chaos soak's quarantine verdict (bench/chaos_hostile.py `verdict`) on recorded data:
the learner's exact-check lines in train.log (read by bench/exact_log.py `every_check`) and
the hostile threads' own records of what they submitted. A hostile class passes when it
was quarantined or when every group of it that differs from the seeded draw was refused;
it fails when a group it chose trained, or one it cannot vouch for; an honest quarantine
fails the whole check.

The picker's numbers are the 30-minute soak's (docs/results.md): 21 of its groups checked,
5 refused, 16 trained, never quarantined.
"""

from bench import chaos_hostile, exact_log

PICKER, JUNK, HONEST = "w-picker", "w-junk", "w-honest"


def train_log(tmp_path, steps):
    """A train.log of the learner's per-step lines (learner_jax/rl/batches.py's format);
    `steps`: [(step, {group id: worker id}, refused group ids)]."""
    import json

    lines = [
        f"I1206 19:52:{i:02d}.000000 1 batches.py:93] exact check step {s}: groups "
        f"{json.dumps({str(g): w for g, w in made.items()})} refused {sorted(refused)}\n"
        for i, (s, made, refused) in enumerate(steps)
    ]
    (tmp_path / "train.log").write_text("".join(lines))
    return str(tmp_path)


def picker_run(tmp_path, trained_mismatches=0):
    """21 picker groups over steps 100..120: 5 differ from the seeded draw and are refused,
    16 are the draw token for token and train; `trained_mismatches` > 0 makes the first
    trained one differ (a group the exact check let through). Junk: 3 groups, refused, and
    quarantined. Each step also trains an honest worker's group."""
    steps, submitted = [], []
    for i in range(21):
        gid, differs = 1000 + i, i in (0, 4, 8, 12, 16)
        m = 2 if differs else (trained_mismatches if i == 1 else 0)
        submitted.append({"group_id": gid, "worker_id": PICKER, "mismatches": m})
        steps.append((100 + i, {gid: PICKER, 5000 + i: HONEST}, {gid} if differs else set()))
    junk = [{"group_id": 900 + i, "worker_id": JUNK} for i in range(3)]  # no mismatch count
    steps.append((121, {900 + i: JUNK for i in range(3)}, {900, 901, 902}))
    results = [
        {"class": "picker", "worker_id": PICKER, "worker_ids": [PICKER], "accepted_groups": 21,
         "submitted": submitted},
        {"class": "junk", "worker_id": JUNK, "worker_ids": [JUNK], "accepted_groups": 3,
         "submitted": junk},
        {"class": "mixed_tags", "worker_id": "w-tags", "accepted_groups": 0, "submitted": []},
    ]  # fmt: skip
    return results, exact_log.every_check(train_log(tmp_path, steps))


def test_a_picker_whose_differing_groups_were_all_refused_passes_unquarantined(tmp_path):
    results, checked = picker_run(tmp_path)
    v = chaos_hostile.verdict(results, {JUNK}, checked)
    assert v["ok"], v
    p = v["hostile"]["picker"]
    assert (p["quarantined"], len(p["consumed"]), p["refused"], p["trained"]) == (
        False, 21, 5, 16)  # fmt: skip
    assert p["differing_submitted"] == 5 and p["trained_differing"] == []
    assert v["hostile"]["junk"]["quarantined"] and v["hostile"]["junk"]["neutralised"]


def test_a_trained_group_the_picker_chose_fails_it(tmp_path):
    results, checked = picker_run(tmp_path, trained_mismatches=1)
    v = chaos_hostile.verdict(results, {JUNK}, checked)
    assert not v["ok"]
    assert v["hostile"]["picker"]["trained_differing"] == [[101, 1001, PICKER, False]]
    # Quarantined afterwards does not excuse it: the group trained all the same.
    assert not chaos_hostile.verdict(results, {JUNK, PICKER}, checked)["ok"]


def test_a_trained_group_its_class_cannot_vouch_for_fails_it(tmp_path):
    """The junk worker records no mismatch count (random tokens): any of its groups that
    trains fails it, as does a picker group the thread has no record of (a submission whose
    answer was lost on the way back, then trained)."""
    results, checked = picker_run(tmp_path)
    leaked = [c if c[1] != 901 else (c[0], c[1], c[2], False) for c in checked]
    v = chaos_hostile.verdict(results, {JUNK}, leaked)
    assert not v["ok"] and v["hostile"]["junk"]["trained_differing"] == [[121, 901, JUNK, False]]
    kept = [g for g in results[0]["submitted"] if g["group_id"] != 1001]
    results[0]["submitted"] = kept
    v = chaos_hostile.verdict(results, {JUNK}, checked)
    assert not v["ok"] and v["hostile"]["picker"]["trained_differing"] == [
        [101, 1001, PICKER, False]
    ]
    # Group 1001 submitted twice (its lease expired and came back to the picker), a
    # differing copy first: which copy trained the record cannot say, so the worst counts.
    twice = [{"group_id": 1001, "worker_id": PICKER, "mismatches": m} for m in (3, 0)]
    results[0]["submitted"] = kept + twice
    assert not chaos_hostile.verdict(results, {JUNK}, checked)["ok"]


def test_an_honest_quarantine_or_an_attacker_that_never_registered_fails(tmp_path):
    results, checked = picker_run(tmp_path)
    v = chaos_hostile.verdict(results, {JUNK, HONEST}, checked)
    assert not v["ok"] and v["honest_quarantined"] == [HONEST]
    results[2]["worker_id"] = None  # 403 at registration: it never attacked
    assert not chaos_hostile.verdict(results, {JUNK}, checked)["ok"]


def test_without_the_learners_record_the_accepted_groups_decide(tmp_path):
    """The exact check off (no lines): a hostile class with accepted groups passes only
    quarantined, as before the record existed."""
    results, _ = picker_run(tmp_path)
    v = chaos_hostile.verdict(results, {JUNK}, [])
    assert not v["ok"] and v["judged_by"] == "accepted groups"
    assert not v["hostile"]["picker"]["neutralised"] and v["hostile"]["junk"]["neutralised"]
    assert chaos_hostile.verdict(results, {JUNK, PICKER}, [])["ok"]


def test_the_verdict_is_recomputed_from_its_json(tmp_path):
    """`recheck` judges the lines and records the answer carries, not its verdict: a
    differing picker group made to train in the JSON fails the recheck."""
    import json

    results, checked = picker_run(tmp_path)
    v = chaos_hostile.verdict(results, {JUNK}, checked)
    read = json.loads(json.dumps(v))
    assert chaos_hostile.recheck(read) == v
    row = read["hostile"]["picker"]["consumed"][0]
    assert row[1] == 1000 and row[3] is True  # a differing group, refused
    row[3] = False
    again = chaos_hostile.recheck(read)
    assert not again["ok"] and again["hostile"]["picker"]["trained_differing"] == [row]
    # A record with no line about any hostile group (the learner consumed none of theirs)
    # is still the record: the recheck judges by it, not by the accepted groups.
    honest_only = [c for c in checked if c[2] == HONEST]
    v = chaos_hostile.verdict(results, {JUNK}, honest_only)
    assert v["ok"] and v["judged_by"] == chaos_hostile.BY_RECORD
    assert chaos_hostile.recheck(json.loads(json.dumps(v))) == v


def test_every_check_keeps_a_step_an_earlier_run_checked_before_a_rerun(tmp_path):
    """A kill -9 rerun checks step 7 again with other groups: the first run's group 70
    trained before the rollback and stays in the record (learner_record keeps the last)."""
    workdir = train_log(tmp_path, [(7, {70: PICKER}, set()), (7, {71: HONEST}, set())])
    assert exact_log.every_check(workdir) == [(7, 70, PICKER, False), (7, 71, HONEST, False)]
    assert exact_log.learner_record(workdir)[0] == [(7, 71, HONEST, False)]


def test_the_picker_records_whether_its_greedy_answer_is_the_seeded_draw(tmp_path):
    """The picker's per-group count of tokens that are not the seeded sampler's choice is
    what the verdict trusts a trained group by: 0 exactly where every sample's greedy
    answer is the honest seeded draw at the lease's temperature (the worker's own KV-cache
    sampler, another code path than the count's one forward); both happen here."""
    import os

    from safetensors.numpy import save_file

    from bridge.model import tiny_model

    path = str(tmp_path / "model")
    cfg = tiny_model.tiny_config("qwen3")
    tiny_model.make_tiny_model(path, cfg)
    weights = tiny_model.random_hf_weights(cfg, seed=3, std=0.2)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    w = chaos_hostile.HostileWorker("picker", "http://x", "s", str(tmp_path))
    prompt, seen = [5, 17, 30, 9], set()
    for seed in range(8):
        t = 0.05 if seed % 2 else 1.0  # a cold draw is mostly the greedy answer
        sampling = {"temperature": t, "top_k": -1, "top_p": 1.0, "min_p": 0.0,
                    "seed": 1000 + seed, "max_tokens": 4, "stop_token_ids": []}  # fmt: skip
        g = {"group_id": seed, "prompt_id": 0, "prompt_token_ids": prompt, "n": 2,
             "sampling": sampling}  # fmt: skip
        sent = [t["completion_token_ids"] for t in w._group(g)["trajectories"]]
        draws = [w._seeded(prompt, 1000 + seed, 4, t, {tiny_model.EOS_ID}, index=i)[0]
                 for i in range(2)]  # fmt: skip
        same = sent == draws
        assert (w._record[seed]["mismatches"] == 0) == same, (seed, sent, draws)
        seen.add(same)
    assert seen == {True, False}  # both cases were tested
