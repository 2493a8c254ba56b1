"""Held-out episodes played by the learner (episode_eval.py) are the episodes transformers'
greedy decoding plays from the same weights, built the same way: prompt ids, each turn's
ids (with the EOS it stopped on), the environment's observation encoded and appended; the
reward is the environment's replay of those turns."""

import jax
import pytest

from bridge.contracts.prompt import TextCodec
from bridge.tasks import make_task
from bridge.tasks.env import Environment, register_env
from learner_jax.evaluation import evaluate
from learner_jax.evaluation.episode_eval import EpisodeEvaluator
from learner_jax.model import hf_import, sharding

TURN = 4


@register_env("three_turns_eval_test", max_turns=3, turn_max_tokens=TURN)
class ThreeTurns(Environment):
    """Three model turns; the observation quotes the last turn, so a wrong context shows."""

    hidden_state = False

    def reset(self, seed: int) -> str:
        self.k = 0
        return f"{seed % 97}+1="

    def step(self, action: str) -> tuple[str, float, bool]:
        self.k += 1
        return f" [{action[:2]}|{self.k}]", float("1" in action), self.k >= 3


def test_episodes_match_transformers_greedy_play(tiny_model_dir):
    import torch
    import transformers

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(tiny_model_dir, mesh)
    task = make_task("three_turns_eval_test", eval_size=6)
    codec = TextCodec(tiny_model_dir)
    ev = EpisodeEvaluator(cfg, codec, task, evaluate.EvalConfig(8, 40))
    got = ev.episodes(params, mesh)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt, (reward, actions) in zip(task.eval_prompts(), got, strict=True):
        env = task.new_env()
        env.reset(task.seed_of(prompt))
        ids, want = codec.encode_prompt(prompt.text), []
        for _ in range(3):
            x = torch.tensor([ids])
            with torch.no_grad():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=TURN,
                                  do_sample=False, eos_token_id=codec.eos_id,
                                  pad_token_id=codec.pad_id)  # fmt: skip
            new = out[0, len(ids) :].tolist()
            if codec.eos_id in new:
                new = new[: new.index(codec.eos_id) + 1]
            want.append(codec.decode([t for t in new if t != codec.eos_id]))
            obs, _, done = env.step(want[-1])
            ids = ids + new + codec.encode(obs)
            if done:
                break
        assert actions == want, prompt.text
        assert reward == pytest.approx(task.episode(prompt, want).reward)
    summary = ev.summary(params, mesh)
    assert summary["eval/mean_turns"] == 3.0
