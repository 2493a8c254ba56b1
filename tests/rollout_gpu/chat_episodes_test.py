"""Token-in/token-out on the real vLLM engine, in a chat template's format: a multi-turn
episode over a tiny model with the real Qwen3 tokenizer format is built by appending the
ids vLLM sampled and the template's own environment turns; re-rendering the same
conversation with the template gives other tokens.

- every model segment is what the engine sampled in exactly that context: vLLM scores the
  same log-probs for it given the whole sequence so far (prompt, earlier turns, the
  environment's turns), and each turn ends with the <|im_end|> it stopped on (or ran out);
- every environment segment is the template's rendering of the observation (chat_turns),
  after the <|im_end|> that closes a turn the token budget cut;
- the learner's row of the episode is those ids, environment tokens masked.
"""

import numpy as np
import pytest

from bridge.contracts.prompt import PromptFormat, TextCodec
from bridge.control.protocol import EpisodeSpec, PromptGroup, SamplingParams
from bridge.model import qwen3_tokenizer as q3
from bridge.tasks.chat_turns import turn_format
from bridge.tasks.env import Environment, register_env
from learner_jax.training import advantages, rollout_batch
from rollout_gpu.episodes import generate_episodes

pytestmark = pytest.mark.vllm
QWEN3 = turn_format("qwen3")


@register_env("chat_count_test", max_turns=3, turn_max_tokens=6)
class ChatCount(Environment):
    """Three model turns; each observation a user turn in the Qwen3 chat format."""

    hidden_state = False
    turns = QWEN3  # a chat template's turns: a cut turn is closed (cut_turn_close)

    def reset(self, seed: int) -> str:
        self.k = 0
        return f"Count with me from {seed}."

    def step(self, action: str) -> tuple[str, float, bool]:
        self.k += 1
        return QWEN3.env_text([{"role": "user", "content": f"next {self.k}"}]), 0.0, self.k >= 3


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_chat_model_dir, qwen3_chat_engine):
    return qwen3_chat_model_dir, qwen3_chat_engine


def test_chat_episodes_are_the_sampled_ids_and_the_templates_turns(qwen3_engine):
    path, engine = qwen3_engine
    codec = TextCodec(path, PromptFormat("chat", thinking="on"))
    im_end = q3.token_id("<|im_end|>")
    prompt = codec.encode_prompt(ChatCount().reset(4))
    group = PromptGroup(
        group_id=1, prompt_id="chat/4", task="chat_count_test", prompt="", n=4,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop_token_ids=[im_end]),
        episode=EpisodeSpec(env="chat_count_test", module=__name__, seed=4, max_turns=3,
                            max_tokens=200),
    )  # fmt: skip
    (result,) = generate_episodes(engine, [group], version=0)
    rerendered_differs = cut_turns = 0
    for t in result.trajectories:
        segs = t.segments()
        model = [ids for m, ids in segs if m == 1]
        shown = [ids for m, ids in segs if m == 0]
        assert len(model) == 3 and len(shown) == 2
        for k, ids in enumerate(shown, start=1):
            close = "" if model[k - 1][-1] == im_end else "<|im_end|>"
            text = close + QWEN3.env_text([{"role": "user", "content": f"next {k}"}])
            assert ids == codec.encode(text)
            cut_turns += bool(close)
        full = list(t.prompt_token_ids) + list(t.completion_token_ids)
        ref = engine.prompt_logprobs([full])[0][len(prompt) - 1 :]
        mask = np.asarray(t.completion_mask) == 1
        np.testing.assert_allclose(np.asarray(t.logprobs)[mask], ref[mask], atol=2e-3)
        for ids in model[:-1]:
            assert ids[-1] == im_end or len(ids) == 6  # stopped on <|im_end|> or ran out
        # The conversation as messages, rendered again: other tokens.
        messages = [{"role": "user", "content": ChatCount().reset(4)}]
        for k, ids in enumerate(model):
            body = ids[:-1] if ids[-1] == im_end else ids
            messages.append(
                {"role": "assistant", "content": codec.tok.decode(body, skip_special_tokens=False)}
            )
            if k < 2:
                messages.append({"role": "user", "content": f"next {k + 1}"})
        again = codec.encode(QWEN3.render(messages, enable_thinking=True))
        rerendered_differs += again[: len(full)] != full
    assert rerendered_differs == len(result.trajectories)
    assert cut_turns > 0  # the untrained model runs out of its 6 tokens in most turns
    # The learner's rows: exactly these ids, the environment's turns masked.
    batch, _ = rollout_batch.groups_to_batch(
        [_scored(result)], 4, 64, 200, current_version=0, adv_cfg=advantages.AdvantageConfig()
    )
    for r, t in enumerate(sorted(result.trajectories, key=lambda t: t.sample_index)):
        p, c = len(t.prompt_token_ids), len(t.completion_token_ids)
        row = list(t.prompt_token_ids) + list(t.completion_token_ids)
        np.testing.assert_array_equal(batch.tokens[r, : p + c - 1], row[:-1])
        np.testing.assert_array_equal(batch.targets[r, p - 1 : p - 1 + c], row[p:])
        np.testing.assert_array_equal(batch.loss_mask[r, p - 1 : p - 1 + c], t.completion_mask)


def _scored(result):
    from bridge.control.protocol import ConsumedGroup, Trajectory

    trajs = [
        Trajectory(**t.model_dump(), reward=float(t.sample_index % 2)) for t in result.trajectories
    ]
    return ConsumedGroup(
        group_id=result.group_id, prompt_id="chat/4", prompt="", answer="4", trajectories=trajs
    )
