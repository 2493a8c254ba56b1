"""Kuhn poker against a fixed opponent: the paper's small poker task, solvable exactly.

Three cards (J < Q < K), one each, ante 1 chip, one bet size of 1 chip. The first player
checks or bets; facing a check the second checks (showdown for 1) or bets; facing a bet a
player calls (showdown for 2) or folds (loses what it put in). The model plays one hand
per episode, in either seat, one decision per turn; reward = its net chips (-2 .. +2).

Episode seed s: the deal and seat are situation s % 12 (6 deals x 2 seats, so a uniform
seed is a uniform deal), the opponent's mixed strategy draws from `random.Random(s)`.

Text (short, for the character-level tiny model; one letter per action):
    reset   "Kuhn Q. you Q:"                (model first)
            "Kuhn Q. opp b. you Q:"         (model second, the opponent bet)
    step    "c"/"check"/"call", "b"/"bet", "f"/"fold" (first word, case-insensitive);
            anything else folds. Next observation e.g. " opp b. you Q:" (the card is
            restated before every answer).

Exact evaluation: the model decides at 12 information sets (card x history "", "cb" in
the first seat, "b", "c" in the second). `expected_reward(policy)` enumerates every deal,
seat and opponent action with its probability; `best_response()` enumerates all 2**12 pure
strategies and keeps the best, the optimum any policy can reach against this opponent.
`decision_points()` gives the text the model sees at each information set, so a learner
can read its action probabilities off one forward pass (exact when a turn is one token).

The fixed opponent (`OPPONENT`) always bluffs with a J, never bets a Q and calls a bet with
a Q half the time: exploitable, so the best response earns +0.25 chips per hand (exact,
tests/bridge/tasks/env_test.py), always check/call earns 0, the uniform policy over
{c, b, f} -0.37 and a policy that never says a legal action -1.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator

from bridge.tasks.env import Environment, ExactEval, register_env

CARDS = "JQK"
ACTIONS = ("c", "b", "f")  # check/call, bet, fold
_ALIASES = {"c": "c", "check": "c", "call": "c", "b": "b", "bet": "b", "f": "f", "fold": "f"}
# Probability that the opponent takes the aggressive branch (bet, or call a bet) per card.
OPPONENT = {
    "open": {"J": 1.0, "Q": 0.0, "K": 1.0},  # first to act: bet
    "after_check": {"J": 1.0, "Q": 0.0, "K": 1.0},  # second, facing a check: bet
    "facing_bet": {"J": 0.0, "Q": 0.5, "K": 1.0},  # facing a bet: call
}
SITUATIONS = [(m, o, seat) for seat in (0, 1) for m, o in itertools.permutations(CARDS, 2)]
# Every information set of the model: (its card, the history before its decision).
INFO_SETS = [(c, h) for c in CARDS for h in ("", "cb", "b", "c")]


def parse_action(text: str) -> str | None:
    words = text.strip().lower().split()
    return _ALIASES.get(words[0]) if words else None


def _payoff(history: str, first_card: str, second_card: str) -> int:
    """Chips won by the FIRST player at a terminal history."""
    if history.endswith("f"):  # the folder never matched a bet: it loses its ante
        folder_is_first = len(history) % 2 == 1
        return -1 if folder_is_first else 1
    stake = 2 if "b" in history else 1
    return stake if CARDS.index(first_card) > CARDS.index(second_card) else -stake


def _terminal(history: str) -> bool:
    return history in ("cc", "bc", "cbc") or history.endswith("f")


def _opponent_p(history: str, card: str) -> float:
    """Opponent's probability of 'b' (open/after check) or 'c' (call) at `history`."""
    if history == "":
        return OPPONENT["open"][card]
    if history == "c":
        return OPPONENT["after_check"][card]
    return OPPONENT["facing_bet"][card]


def _opponent_moves(history: str, card: str) -> list[tuple[str, float]]:
    p = _opponent_p(history, card)
    facing_bet = history.endswith("b")
    aggressive, passive = ("c", "f") if facing_bet else ("b", "c")
    return [(a, q) for a, q in ((aggressive, p), (passive, 1.0 - p)) if q > 0]


def _legal(history: str, action: str) -> str:
    """The model's action as the game applies it: an unparseable action folds, a fold with
    no bet to face folds anyway (loses the ante), a bet facing a bet calls (no raises)."""
    if action not in ACTIONS:
        return "f"
    return "c" if action == "b" and history.endswith("b") else action


Policy = Callable[[str, str], dict[str, float]]  # (card, history) -> {action: prob}


def expected_reward(policy: Policy) -> float:
    """Exact expected chips per hand for the model's `policy`, averaged over the 12
    equally likely (deal, seat) situations; probability mass on no legal action folds."""

    def value(history: str, model: str, opp: str, seat: int) -> float:
        first, second = (model, opp) if seat == 0 else (opp, model)
        if _terminal(history):
            won = _payoff(history, first, second)
            return won if seat == 0 else -won
        model_turn = (len(history) % 2) == seat
        if model_turn:
            probs = policy(model, history)
            total, out = 0.0, 0.0
            for a, q in probs.items():
                if q > 0:
                    out += q * value(history + _legal(history, a), model, opp, seat)
                    total += q
            if total < 1.0:  # the rest of the mass is invalid text: a fold
                out += (1.0 - total) * value(history + "f", model, opp, seat)
            return out
        return sum(
            q * value(history + a, model, opp, seat) for a, q in _opponent_moves(history, opp)
        )

    return sum(value("", m, o, seat) for m, o, seat in SITUATIONS) / len(SITUATIONS)


def best_response() -> tuple[float, dict[tuple[str, str], str]]:
    """(optimal expected chips per hand, the pure strategy reaching it) by enumeration of
    all 2**12 pure strategies (folding with no bet to face never helps, so each information
    set chooses between its two non-dominated actions)."""
    choices = {h: ("c", "b") if h in ("", "c") else ("c", "f") for _, h in INFO_SETS}
    best, best_s = -float("inf"), {}
    for picks in itertools.product((0, 1), repeat=len(INFO_SETS)):
        strat = {k: choices[k[1]][p] for k, p in zip(INFO_SETS, picks, strict=True)}
        v = expected_reward(lambda c, h, s=strat: {s[(c, h)]: 1.0})
        if v > best + 1e-12:
            best, best_s = v, strat
    return best, best_s


@functools.cache
def optimum() -> float:
    return best_response()[0]


def uniform_policy(card: str, history: str) -> dict[str, float]:
    return {a: 1.0 / 3 for a in ACTIONS}


@functools.cache
def sft_teacher() -> dict[tuple[str, str], dict[str, float]]:
    """The format teacher's strategy: per information set, half uniform and half a fixed
    random draw (seeded, chosen without looking at rewards), so every action keeps >= 1/6
    and the answer depends on the card and the history."""
    rng = random.Random("kuhn_poker/sft_teacher")
    out = {}
    for key in INFO_SETS:
        draw = [rng.expovariate(1.0) for _ in ACTIONS]  # a flat Dirichlet sample
        out[key] = {a: 0.5 / 3 + 0.5 * d / sum(draw) for a, d in zip(ACTIONS, draw, strict=True)}
    return out


def _describe(action: str) -> str:
    return f" opp {action}."


def _ask(card: str) -> str:
    """The prompt for a decision restates the model's card right before it answers: the
    tiny character-level policy read the card at the start of the text not at all
    (BUILD_NOTES.md, issue 27: every information set's policy was the same)."""
    return f" you {card}:"


@register_env("kuhn_poker", max_turns=2, turn_max_tokens=1)
class KuhnPoker(Environment):
    """One hand of Kuhn poker for the model against `OPPONENT` (see the module docstring).

    Text that is no action folds (the game's rule); `invalid` says so, so the task option
    `illegal_penalty` (EnvTask) can take chips off the TRAINING reward of such a hand. The
    exact evaluation keeps measuring the game itself (junk = fold, no penalty)."""

    def reset(self, seed: int) -> str:
        self.model, self.opp, self.seat = SITUATIONS[seed % len(SITUATIONS)]
        self.rng = random.Random(seed)
        self.history = ""
        text = f"Kuhn {self.model}."
        if self.seat == 1:
            text += _describe(self._opponent_acts())
        return text + _ask(self.model)

    def _opponent_acts(self) -> str:
        p = _opponent_p(self.history, self.opp)
        facing_bet = self.history.endswith("b")
        aggressive, passive = ("c", "f") if facing_bet else ("b", "c")
        action = aggressive if self.rng.random() < p else passive
        self.history += action
        return action

    def _result(self) -> float:
        first, second = (self.model, self.opp) if self.seat == 0 else (self.opp, self.model)
        won = _payoff(self.history, first, second)
        return float(won if self.seat == 0 else -won)

    def step(self, action: str) -> tuple[str, float, bool]:
        if _terminal(self.history):
            raise ValueError("the hand is over; reset first")
        self.history += _legal(self.history, parse_action(action) or "f")
        if _terminal(self.history):
            return f" end {self.opp}.", self._result(), True
        text = _describe(self._opponent_acts())
        if _terminal(self.history):
            return text + f" end {self.opp}.", self._result(), True
        return text + _ask(self.model), 0.0, False

    def invalid(self, action: str) -> bool:
        return parse_action(action) is None

    def unfinished_reward(self) -> float:
        return -1.0  # a hand left unplayed counts as a fold (stalling must not pay)

    def demonstrations(self, seed: int) -> Iterator[tuple[str, str]]:
        """Format, no strategy: each first decision answered by a random action letter from
        `sft_teacher()`, a mixed strategy drawn at random per information set (not from
        rewards). It differs between information sets on purpose: a teacher that answers the
        same way everywhere (the first version: uniform letters) trains the policy to
        ignore its card and the history, and RL never recovered from that (BUILD_NOTES.md,
        issue 27). SFT on these teaches the action format, RL has to find the strategy."""
        rng = random.Random(f"kuhn_poker/sft/{seed}")
        teacher = sft_teacher()
        while True:
            prompt = self.reset(rng.randrange(1 << 62))
            probs = teacher[(self.model, self.history)]
            yield prompt, rng.choices(ACTIONS, weights=[probs[a] for a in ACTIONS])[0]

    def exact_eval(self) -> ExactEval:
        points = decision_points()
        index = {key: i for i, (key, _) in enumerate(points)}

        def value(probs: list[dict[str, float]]) -> float:
            return expected_reward(lambda c, h: probs[index[(c, h)]])

        return ExactEval([t for _, t in points], parse_action, value, optimum())


def decision_points() -> list[tuple[tuple[str, str], list[str]]]:
    """Each information set with the transcript the model sees there: [obs, action, obs,
    ...] ending with the observation it answers (one-letter actions)."""
    out = []
    for card, h in INFO_SETS:
        if h == "":
            out.append(((card, h), [f"Kuhn {card}.{_ask(card)}"]))
        elif h == "cb":
            out.append(((card, h), [f"Kuhn {card}.{_ask(card)}", "c", _describe("b") + _ask(card)]))
        else:
            out.append(((card, h), [f"Kuhn {card}.{_describe(h)}{_ask(card)}"]))
    return out
