"""Heads-up limit Texas hold'em through pokerkit, against a scripted opponent.

One hand per episode: blinds 1/2, bets 2 (pre-flop, flop) and 4 (turn, river), at most 4
bets a street, stacks of 100; reward = the model's net chips for the hand (pokerkit's
payoffs, which sum to zero over both players: tests/bridge/tasks/env_test.py).

Seeding. pokerkit draws cards with the global `random` unless told which cards to deal,
so nothing is left to it: the episode seed shuffles a 52-card deck with
`random.Random(seed)`, and every hole card, burn card and board card is dealt explicitly
from that deck (no dealing or burning automation). The seed also picks the model's seat
and drives the opponent's occasional bluff. Same seed, same actions -> same hand.

Heads-up blind order. Given blinds (1, 2) for two players pokerkit applies the heads-up
rule itself: player 0 posts the big blind, player 1 (the button) the small blind and acts
first pre-flop, player 0 acts first on every later street (checked in the tests).

Discrete actions, one per model turn, first word of the text, case-insensitive:
"f"/"fold", "c"/"check"/"call", "r"/"b"/"bet"/"raise" (a raise past the cap calls).
Anything else is `invalid` (default "fold"; "call" keeps an untrained policy in the hand,
which end-to-end tests use to get long episodes).

Text is short (the tiny demo model's tokenizer is character-level):
    reset  "Holdem AsKd btn. opp r. you:"     (seat, then what happened until the model acts)
    step   " opp c. flop Jc3d5c. you:"        (events since the model's action)

The opponent (`scripted_opponent`): raises pre-flop with a pair or two cards ten or
higher, after the flop with a pair or better, calls otherwise, and bluff-raises with
probability `bluff` (from the seeded generator).
"""

from __future__ import annotations

import random
import warnings

from bridge.tasks.env import Environment, register_env

RANKS, SUITS = "23456789TJQKA", "cdhs"
DECK = [r + s for r in RANKS for s in SUITS]
STACK, BLINDS, SMALL_BET, BIG_BET = 100, (1, 2), 2, 4
_ALIASES = {"f": "f", "fold": "f", "c": "c", "check": "c", "call": "c"}
_ALIASES.update({w: "r" for w in ("r", "b", "bet", "raise")})
_BOARD = {1: 3, 2: 1, 3: 1}  # street index -> board cards dealt on it


def _pokerkit():
    import pokerkit  # the optional `tasks` extra, imported on first use

    return pokerkit


def parse_action(text: str) -> str | None:
    words = text.strip().lower().split()
    return _ALIASES.get(words[0]) if words else None


def scripted_opponent(hole: list[str], board: list[str], rng: random.Random, bluff: float) -> str:
    """'r' or 'c' (it never folds: a calling station that raises its strong hands)."""
    if rng.random() < bluff:
        return "r"
    if not board:
        pair = hole[0][0] == hole[1][0]
        high = all(RANKS.index(c[0]) >= RANKS.index("T") for c in hole)
        return "r" if pair or high else "c"
    hand = _pokerkit().StandardHighHand.from_game("".join(hole), "".join(board))
    return "c" if hand.entry.label.name == "HIGH_CARD" else "r"


@register_env("holdem", max_turns=12, turn_max_tokens=1)
class Holdem(Environment):
    def __init__(self, invalid: str = "fold", bluff: float = 0.1):
        if invalid not in ("fold", "call"):
            raise ValueError(f"invalid must be 'fold' or 'call', got {invalid!r}")
        if not 0.0 <= bluff <= 1.0:
            raise ValueError(f"bluff must be in [0, 1], got {bluff}")
        self.invalid, self.bluff = invalid[0], float(bluff)

    def reset(self, seed: int) -> str:
        pk = _pokerkit()
        self.rng = random.Random(seed)
        self.deck = list(DECK)
        self.rng.shuffle(self.deck)
        self.seat = self.rng.randrange(2)  # 0: big blind, 1: button (small blind)
        a = pk.Automation
        self.state = pk.FixedLimitTexasHoldem.create_state(
            (
                a.ANTE_POSTING,
                a.BET_COLLECTION,
                a.BLIND_OR_STRADDLE_POSTING,
                a.HOLE_CARDS_SHOWING_OR_MUCKING,
                a.HAND_KILLING,
                a.CHIPS_PUSHING,
                a.CHIPS_PULLING,
            ),
            True,  # ante trimming
            0,  # antes
            BLINDS,
            SMALL_BET,
            BIG_BET,
            (STACK, STACK),
            2,
            mode=pk.Mode.CASH_GAME,
        )
        self.hole = [[self._draw(), self._draw()] for _ in range(2)]
        for cards in self.hole:
            self.state.deal_hole("".join(cards))
        self.board: list[str] = []
        seat = "btn" if self.seat == 1 else "bb"
        return f"Holdem {''.join(self.hole[self.seat])} {seat}.{self._advance()}"

    def _draw(self) -> str:
        return self.deck.pop()

    def _act(self, action: str) -> None:
        s = self.state
        if action == "r" and s.can_complete_bet_or_raise_to():
            s.complete_bet_or_raise_to()
            return
        with warnings.catch_warnings():  # pokerkit warns of a fold with nothing to call:
            warnings.simplefilter("ignore")  # allowed, and it loses what is in the pot
            if action == "f" and s.can_fold():
                s.fold()
                return
        s.check_or_call()

    def _advance(self) -> str:
        """Deal and let the opponent act until the model must act or the hand is over;
        returns what happened as text ending with " you:" (or the result)."""
        s, events = self.state, []
        while s.status:
            if s.can_burn_card():
                s.burn_card(self._draw())
            elif s.can_deal_board():
                cards = [self._draw() for _ in range(_BOARD[s.street_index])]
                s.deal_board("".join(cards))
                self.board += cards
                events.append(
                    f" {('flop', 'turn', 'river')[len(self.board) - 3]} {''.join(cards)}."
                )
            elif s.actor_index == self.seat:
                return "".join(events) + " you:"
            elif s.actor_index is not None:
                move = scripted_opponent(self.hole[1 - self.seat], self.board, self.rng, self.bluff)
                self._act(move)
                events.append(f" opp {move}.")
            else:  # pragma: no cover - every automation that remains is on
                raise RuntimeError(f"pokerkit state waits for an unknown operation: {s}")
        return (
            "".join(events)
            + f" end {''.join(self.hole[1 - self.seat])} {self.payoffs[self.seat]:+d}."
        )

    @property
    def payoffs(self) -> list[int]:
        return [int(x) for x in self.state.payoffs]

    def step(self, action: str) -> tuple[str, float, bool]:
        if not self.state.status:
            raise ValueError("the hand is over; reset first")
        move = parse_action(action) or self.invalid
        self._act(move)
        text = self._advance()
        if self.state.status:
            return text, 0.0, False
        return text, float(self.payoffs[self.seat]), True

    def unfinished_reward(self) -> float:
        """A hand left unplayed is folded: the model loses what it has put in."""
        return -float(STACK - self.state.stacks[self.seat])
