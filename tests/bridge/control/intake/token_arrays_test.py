"""The intake's array checks (token_arrays.py, ScoringText, WorkerTrajectory.segments) give
the answers of the per-token Python loops they replaced, on random completions: random
ids (visible, hidden, stop, out of the vocabulary, past int64), log-probs (NaN, inf,
positive, -0.0), versions and model/environment segment layouts. The loops are written out
here as the specification. Each check runs twice: every list through the arrays
(`ARRAY_MIN` 0) and at the shipped threshold, where these short lists take the Python pass.
A scored trajectory and a group's JSON are those of the validating constructor and the
one-call list dump they replaced."""

import contextlib
import math

import pydantic
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from bridge.control.intake import token_arrays
from bridge.control.intake.intake import group_json
from bridge.control.intake.rewards import HiddenToken, ScoringText, scored_trajectory
from bridge.control.protocol import Trajectory, WorkerTrajectory
from bridge.model.tiny_model import EOS_ID, PAD_ID

_SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate]
)
_GROUP = pydantic.TypeAdapter(list[Trajectory])
# The tiny tokenizer's 99 ids, the padded model vocabulary past it, and the stop ids.
_IDS = st.one_of(st.integers(0, 140), st.sampled_from([EOS_ID, PAD_ID]))


# None: the shipped threshold (these tests' lists are all shorter); 0: arrays for every list.
ARRAY_MINS = pytest.mark.parametrize("array_min", [0, None], ids=["arrays", "shipped"])


@contextlib.contextmanager
def arrays_from(array_min):
    saved = token_arrays.ARRAY_MIN
    token_arrays.ARRAY_MIN = saved if array_min is None else array_min
    try:
        yield token_arrays.ARRAY_MIN
    finally:
        token_arrays.ARRAY_MIN = saved


def test_the_threshold_picks_the_path():
    n = token_arrays.ARRAY_MIN
    assert token_arrays.short([0] * (n - 1)) and not token_arrays.short([0] * n)


def segments_per_token(ids, mask):
    out = []
    for tok, m in zip(ids, [1] * len(ids) if mask is None else mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


@st.composite
def completions(draw):
    """(ids, mask or None): a completion with random runs of model and environment tokens."""
    ids = draw(st.lists(_IDS, min_size=1, max_size=60))
    if draw(st.booleans()):
        return ids, None
    runs = draw(st.lists(st.integers(1, 8), min_size=1, max_size=len(ids)))
    first = draw(st.integers(0, 1))
    mask = [(first + k) % 2 for k, n in enumerate(runs) for _ in range(n)]
    mask = (mask + [mask[-1]] * len(ids))[: len(ids)]
    return ids, mask


def _trajectory(ids, mask):
    n = len(ids)
    return WorkerTrajectory.model_construct(
        prompt_id="p", sample_index=0, prompt_token_ids=[1], completion_token_ids=ids,
        logprobs=[-1.0] * n, versions=[0] * n, finish_reason="length", completion_mask=mask,
    )  # fmt: skip


@_SETTINGS
@given(completions())
def test_segments_are_the_per_token_runs(c):
    ids, mask = c
    assert _trajectory(ids, mask).segments() == segments_per_token(ids, mask)


def _outcome(f, *args):
    try:
        return "ok", f(*args)
    except HiddenToken as e:
        return "hidden", str(e)


def count_hidden_per_token(scoring, trajectories):
    """The per-turn rule, token by token: a model turn holding a hidden id (a stop id
    ending the turn allowed) makes its trajectory count once."""
    n = 0
    for t in trajectories:
        for m, ids in segments_per_token(t.completion_token_ids, t.completion_mask):
            body = ids[:-1] if ids and ids[-1] in scoring.stops else ids
            if m == 1 and any(scoring.hidden(i) for i in body):
                n += 1
                break
    return n


@ARRAY_MINS
def test_text_and_hidden_counts_are_the_per_token_rule(text_codec, array_min):
    scoring = ScoringText(text_codec)

    @_SETTINGS
    @given(st.lists(completions(), min_size=1, max_size=4))
    def check(cs):
        for ids, _ in cs:
            assert _outcome(scoring.text, ids) == _outcome(scoring_text_per_token, ids)
        trajectories = [_trajectory(ids, mask) for ids, mask in cs]
        assert scoring.count_hidden(trajectories) == count_hidden_per_token(scoring, trajectories)

    def scoring_text_per_token(ids):
        body = ids[:-1] if ids and ids[-1] in scoring.stops else ids
        for pos, i in enumerate(body):
            if why := scoring.hidden(i):
                raise HiddenToken(f"completion token {pos} (id {i}) is {why}")
        return text_codec.tok.decode(body, skip_special_tokens=False)

    with arrays_from(array_min):
        check()


_BIG = st.integers(-(2**70), 2**70)
_LOGPROBS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, -1e-300, 5e-324, -math.inf, math.nan]),
    st.integers(-3, 1),
)


@_SETTINGS
@given(
    st.lists(
        st.one_of(st.integers(-2, 130), st.sampled_from([-1, 0, 127, 128]), _BIG), max_size=40
    ),
    st.lists(_LOGPROBS, max_size=40),
    st.lists(st.one_of(st.integers(0, 5), _BIG), min_size=1, max_size=40),
)
@ARRAY_MINS
def test_first_offenders_are_the_per_token_loops(array_min, ids, logprobs, versions):
    with arrays_from(array_min):
        outside = token_arrays.first_outside(ids, 0, 128)
        bad = token_arrays.first_bad_logprob(logprobs)
        span = token_arrays.version_span(versions)
    # Past int64 (or a short list) the helper runs the per-token loop itself.
    assert outside == next((k for k, i in enumerate(ids) if not 0 <= i < 128), None)
    assert bad == next(
        (k for k, x in enumerate(logprobs) if not (math.isfinite(x) and x <= 0.0)), None
    )
    down = any(b < a for a, b in zip(versions, versions[1:], strict=False))
    assert span == (min(versions), max(versions), down)


@ARRAY_MINS
@_SETTINGS
@given(
    st.lists(completions(), min_size=1, max_size=3),
    st.one_of(st.floats(-2, 2), st.integers(-2, 2)),
    st.integers(0, 9),
)
def test_scored_trajectories_and_their_json_are_the_validated_ones(array_min, cs, reward, think):
    """`scored_trajectory` is `Trajectory(**t.model_dump(), ...)` (the score coerced and
    checked as that validation does) and `group_json` the one-call list dump."""
    trajectories = [
        WorkerTrajectory(
            prompt_id="p",
            sample_index=k,
            prompt_token_ids=[1, 2],
            completion_token_ids=ids,
            logprobs=[-0.5] * len(ids),
            versions=[0] * len(ids),
            finish_reason="stop",
            completion_mask=mask,
        )  # fmt: skip
        for k, (ids, mask) in enumerate(cs)
    ]
    with arrays_from(array_min):
        scored = [scored_trajectory(t, reward, "why", think) for t in trajectories]
    validated = [
        Trajectory(**t.model_dump(), reward=reward, reward_error="why", think_tokens=think)
        for t in trajectories
    ]
    for a, b in zip(scored, validated, strict=True):
        assert a == b and type(a.reward) is type(b.reward) is float
        assert a.model_fields_set == b.model_fields_set
    assert group_json(scored) == _GROUP.dump_json(validated).decode()


@ARRAY_MINS
def test_a_score_the_validation_refuses_is_refused(array_min):
    t = WorkerTrajectory(
        prompt_id="p", sample_index=0, prompt_token_ids=[1], completion_token_ids=[5],
        logprobs=[-0.5], versions=[0], finish_reason="stop",
    )  # fmt: skip
    for reward, think in ((math.nan, 0), (1.0, -1)):
        with arrays_from(array_min), pytest.raises(pydantic.ValidationError):
            scored_trajectory(t, reward, "", think)
