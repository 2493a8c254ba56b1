"""Multi-turn environments: the EnvTask contract (prompts by seed, disjoint held-out
episodes, replay), Kuhn poker's exact evaluation against an independent Monte Carlo of the
environment itself, and heads-up limit hold'em through pokerkit (seeded explicit dealing,
heads-up blind order, zero-sum payoffs, deterministic replays)."""

import itertools
import random

import pytest

from bridge.tasks import EnvTask, make_env, make_task, replay
from bridge.tasks import kuhn_poker as kuhn


def test_env_task_prompts_are_seeded_episodes_and_the_splits_are_disjoint():
    t = make_task("kuhn_poker", eval_size=32)
    assert isinstance(t, EnvTask) and t.name == "kuhn_poker" and t.max_turns == 2
    train = list(itertools.islice(t.train_prompts(0), 64))
    assert train == list(itertools.islice(t.train_prompts(0), 64))
    assert train != list(itertools.islice(t.train_prompts(1), 64))
    held = t.eval_prompts()
    assert len(held) == 32 and not {p.prompt_id for p in held} & {p.prompt_id for p in train}
    for p in train[:8]:
        assert p.prompt_id == t.prompt_id(int(p.answer)) and p.answer not in p.prompt_id
        env = t.new_env()
        assert env.reset(EnvTask.seed_of(p)) == p.text
    # The one-step case: a completion is the first action; a fold is -1 in every deal.
    assert all(t.reward(p, "fold") == -1.0 for p in train[:8])


def test_replay_stops_at_done_and_scores_unfinished_episodes():
    env = make_env("kuhn_poker")
    r = replay(env, 7, ["f", "c", "c"])
    assert r.done and r.reward == -1.0 and len(r.observations) == 1  # the rest not applied
    seed = next(s for s in range(100) if kuhn.SITUATIONS[s % 12][2] == 0)  # model first
    r = replay(env, seed, [])
    assert not r.done and r.reward == -1.0  # an unplayed hand is a fold


def test_kuhn_decision_texts_are_what_the_environment_shows():
    env = make_env("kuhn_poker")
    seen = set()
    for seed in range(400):
        first = env.reset(seed)
        card = env.model
        history = env.history
        seen.add(((card, history), (first,)))
        if history == "" and env.opp in "JK":  # check, the opponent bets: second decision
            obs, _, done = env.step("c")
            assert not done
            seen.add(((card, "cb"), (first, "c", obs)))
    points = {key: tuple(t) for key, t in kuhn.decision_points()}
    seen = dict(seen)
    assert {k: points[k] for k in seen} == seen  # the same text at every one it reaches
    # It reaches all but one: this opponent opens every J and K, so a Q never sees a check.
    assert set(points) - set(seen) == {("Q", "c")}


def test_kuhn_exact_value_matches_monte_carlo_of_the_environment():
    rng = random.Random(0)
    probs = {
        key: dict(zip("cbf", rng.sample([0.1, 0.3, 0.5], 3), strict=True)) for key in kuhn.INFO_SETS
    }
    exact = kuhn.expected_reward(lambda c, h: probs[(c, h)])
    env, total, n = make_env("kuhn_poker"), 0.0, 60_000
    for seed in range(n):
        env.reset(seed)
        done = False
        while not done:
            p = probs[(env.model, env.history)]
            x = rng.random()
            a = "c" if x < p["c"] else "b" if x < p["c"] + p["b"] else "f" if x < 0.9 else "?"
            _, r, done = env.step(a)
        total += r
    assert abs(total / n - exact) < 0.02, (total / n, exact)


def test_kuhn_best_response_is_the_optimum_and_beats_every_policy():
    best, strat = kuhn.best_response()
    assert best == pytest.approx(0.25)
    assert kuhn.expected_reward(lambda c, h: {strat[(c, h)]: 1.0}) == pytest.approx(best)
    rng = random.Random(1)
    for _ in range(200):  # random mixed policies never beat the pure best response
        probs = {
            k: dict(zip("cb", (x := rng.random(), 1 - x), strict=True)) for k in kuhn.INFO_SETS
        }
        assert kuhn.expected_reward(lambda c, h, p=probs: p[(c, h)]) <= best + 1e-12
    assert kuhn.expected_reward(lambda c, h: {}) == -1.0  # never a legal action: all folds
    exact = make_task("kuhn_poker").exact_eval()
    assert exact.optimum == best and len(exact.transcripts) == 12
    assert [exact.parse(x) for x in ("C", "b", "Fold", "x", "")] == ["c", "b", "f", None, None]
    assert make_task("kuhn_poker", turn_max_tokens=4).exact_eval() is None


def _play(env, seed, rng):
    obs = [env.reset(seed)]
    done, actions = False, []
    while not done:
        a = rng.choice(["c", "r", "f", "x", "raise", "call"])
        o, r, done = env.step(a)
        actions.append(a)
        obs.append(o)
    return obs, actions, r


@pytest.mark.parametrize("invalid", ["fold", "call"])
def test_holdem_payoffs_sum_to_zero_and_replays_are_deterministic(invalid):
    env = make_env("holdem", invalid=invalid)
    rng = random.Random(2)
    for seed in range(150):
        random.seed(seed * 7)  # global random must not matter: dealing is explicit
        obs, actions, reward = _play(env, seed, rng)
        assert sum(env.payoffs) == 0 and sum(env.state.stacks) == 2 * 100
        assert reward == env.payoffs[env.seat]
        again = replay(make_env("holdem", invalid=invalid), seed, actions)
        assert again.done and again.reward == reward and again.observations == obs[1:]
        cards = env.hole[0] + env.hole[1] + env.board
        assert len(set(cards)) == len(cards)


def test_holdem_heads_up_blind_order():
    env = make_env("holdem", invalid="call")
    for seed in range(40):
        env.reset(seed)
        s = env.state
        # player 0 posted the big blind, player 1 (the button) the small blind
        assert list(s.starting_stacks) == [100, 100]
        assert 100 - s.stacks[0] == 2 and 100 - s.stacks[1] >= 1
        if env.seat == 1:  # the model on the button acts first pre-flop
            assert s.actor_index == 1 and not env.board
        # post-flop the big blind acts first: reach the flop by calling
        while s.status and len(env.board) < 3:
            env.step("c")
        if s.status and env.seat == 0:
            assert s.actor_index == 0  # the model (big blind) is first on the flop


def test_holdem_task_prompts_and_bad_options():
    t = make_task("holdem", eval_size=4)
    assert [p.text.startswith("Holdem ") for p in t.eval_prompts()] == [True] * 4
    with pytest.raises(ValueError, match="invalid"):
        make_task("holdem", invalid="raise")


def test_kuhn_demonstrations_are_format_only():
    t = make_task("kuhn_poker")
    examples = list(itertools.islice(t.sft_examples(0), 600))
    assert examples == list(itertools.islice(t.sft_examples(0), 600))
    texts = {x for x, _ in examples}
    many = list(itertools.islice(t.sft_examples(0), 3000))  # ~330 per prompt: sd 0.03
    texts_n = {t: sum(x == t for x, _ in many) for t in texts}
    assert texts <= {tr[0] for _, tr in kuhn.decision_points() if len(tr) == 1}
    counts = {a: sum(1 for _, x in examples if x == a) for a in "cbf"}
    assert sum(counts.values()) == 600 and min(counts.values()) > 150  # every letter, often
    # No strategy: the teacher is worth what uniform letters are (-0.370), far from +0.25.
    teacher = kuhn.sft_teacher()
    assert abs(kuhn.expected_reward(lambda c, h: teacher[(c, h)]) + 0.370) < 0.05
    assert min(q for p in teacher.values() for q in p.values()) >= 1 / 6
    # ... but the answer depends on the card (a teacher that answers the same everywhere
    # trained the policy to ignore its card: docs/results.md, Kuhn poker). Seen in the data:
    share = sorted(sum(a == "c" for x, a in many if x == t) / texts_n[t] for t in texts_n)
    assert share[-1] - share[0] > 0.2, share  # P(check) per prompt
    assert make_task("holdem").sft_examples(0) is not None  # none offered: an empty stream
    assert list(make_task("holdem").sft_examples(0)) == []


def test_kuhn_illegal_penalty_changes_the_training_reward_not_the_exact_value():
    """`illegal_penalty` (an EnvTask option, Kuhn says what is `invalid`): junk text still
    folds, and the TRAINING reward (the replay the reward pool scores) is the fold's result
    minus the penalty; legal play is unchanged.
    The exact evaluation keeps measuring the real game (junk = fold, no penalty)."""
    plain, fined = make_task("kuhn_poker"), make_task("kuhn_poker", illegal_penalty=0.75)
    assert fined.illegal_penalty == 0.75 and plain.illegal_penalty == 0.0
    moves, fined_some = ["c", "b", "f", "fold", "x", "?", ""], 0
    for seed, a1, a2 in itertools.product(range(24), moves, moves):
        p = plain._prompt(seed)
        r0, r1 = plain.episode(p, [a1, a2]), fined.episode(p, [a1, a2])
        applied = [a1, a2][: len(r0.observations)]  # actions after `done` are not applied
        junk = sum(kuhn.parse_action(a) is None for a in applied)
        assert r1.observations == r0.observations and r1.done == r0.done
        assert r1.reward == r0.reward - 0.75 * junk, (seed, a1, a2)
        fold = plain.episode(p, [*applied[:-1], "f"]).reward
        if junk and kuhn.parse_action(applied[-1]) is None:  # junk = the fold, minus the fine
            assert r1.reward == fold - 0.75 and r0.reward == fold
        fined_some += junk > 0
    assert fined_some > 0
    # The reward pool's path (options as plain data) applies it too.
    from bridge.tasks.env import replay_named

    seed = fined._prompt(5)
    assert (
        replay_named(
            "bridge.tasks",
            "kuhn_poker",
            {"illegal_penalty": 0.75},
            (seed.prompt_id, seed.text, seed.answer),
            ["x"],
        )[0]
        == plain.episode(seed, ["x"]).reward - 0.75
    )
    # Exact evaluation: the same number for a policy with junk mass, the same optimum.
    rng, e0, e1 = random.Random(3), plain.exact_eval(), fined.exact_eval()
    probs = [dict(zip("cb", (rng.random() / 2, rng.random() / 2), strict=True)) for _ in range(12)]
    assert e1.value(probs) == e0.value(probs) and e1.optimum == e0.optimum == pytest.approx(0.25)
    assert make_task("holdem", illegal_penalty=0.75).illegal_penalty == 0.75  # any env task
    for bad in (-0.1, float("nan"), float("inf"), "x"):
        with pytest.raises(ValueError, match="illegal_penalty"):
            make_task("kuhn_poker", illegal_penalty=bad)
