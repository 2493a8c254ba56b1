"""The behaviour log-prob audit on real numbers: vLLM engines (fp32 and bf16) sample the tiny
model, transformers fp32 plays the learner, and the per-group statistics go through
`bridge.control.trust.audit.rows_to_worker_stats` into a real `Controller.audit`. Honest engines
never trip it over a long run; fabricated log-probs and another model's are quarantined
within a bounded number of groups. Prints the measured spread (quoted in BUILD_NOTES.md)."""

import numpy as np
import pytest

from bridge.contracts.k3 import k3
from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.protocol import WorkerProfile
from bridge.control.trust import audit
from bridge.model import tiny_model
from bridge.tasks import make_task
from rollout_gpu.engine import SampleRequest

pytestmark = pytest.mark.vllm

GROUPS, N, MAX_TOKENS = 12, 4, 24


class HFScorer:
    """transformers fp32 log-probs of completion tokens under given weights."""

    def __init__(self, model_dir, weights=None):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
        if weights is not None:
            sd = {k: torch.from_numpy(v) for k, v in weights.items()}
            self.model.load_state_dict(sd, strict=False)
            self.model.tie_weights()

    def logprobs(self, prompt_ids, completion_ids):
        torch = self.torch
        ids = list(prompt_ids) + list(completion_ids)
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, :-1].double()
        lp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        return lp[len(prompt_ids) - 1 :].numpy()


def sample(engine, prompts):
    reqs = [
        SampleRequest(prompt_token_ids=p, n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=i)
        for i, p in enumerate(prompts)
    ]
    return engine.generate(reqs)


def group_arrays(prompt, completions, behaviour, learner):
    """Padded [N, T] behaviour/learner/mask arrays of one group."""
    t = max(len(c.token_ids) for c in completions)
    b, lr, m = np.zeros((N, t)), np.zeros((N, t)), np.zeros((N, t))
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        b[i, :n], lr[i, :n], m[i, :n] = behaviour(prompt, c), learner(prompt, c), 1.0
    return b, lr, m


@pytest.fixture(scope="module")
def measured(tiny_model_dir, vllm_engine, extra_vllm_engine):
    """worker kind -> per-group (behaviour, learner, mask) arrays, all at version 0."""
    codec = TextCodec(tiny_model_dir)
    task = make_task("arithmetic")
    stream = task.train_prompts(0)
    prompts = [codec.encode_prompt(next(stream).text) for _ in range(GROUPS)]
    bf16 = extra_vllm_engine(
        tiny_model_dir, dtype="bfloat16", max_model_len=256, seed=0, max_num_seqs=8
    )
    learner = HFScorer(tiny_model_dir)
    cfg = tiny_model.tiny_config("qwen3")
    other = HFScorer(tiny_model_dir, tiny_model.random_hf_weights(cfg, seed=99))

    def lp(scorer):
        return lambda p, c: scorer.logprobs(p, c.token_ids)

    def engine_lp(p, c):
        return np.asarray(c.logprobs)

    out = {}
    fp32_samples = sample(vllm_engine, prompts)
    for name, samples, behaviour in [
        ("fp32", fp32_samples, engine_lp),
        ("bf16", sample(bf16, prompts), engine_lp),
        ("fabricated", fp32_samples, lambda p, c: np.full(len(c.token_ids), -0.01)),
        ("other_model", fp32_samples, lp(other)),
    ]:
        out[name] = [
            group_arrays(p, cs, behaviour, lp(learner))
            for p, cs in zip(prompts, samples, strict=True)
        ]
    return out


def spread(groups):
    """(mean k3 per token, max per-group mean k3, mean log-ratio) of a worker's groups."""
    per_group, k_all, lr_all, n_all = [], 0.0, 0.0, 0.0
    for b, lr, m in groups:
        kk = (k3(lr - b) * m).sum()
        per_group.append(kk / m.sum())
        k_all, lr_all, n_all = k_all + kk, lr_all + ((b - lr) * m).sum(), n_all + m.sum()
    return k_all / n_all, max(per_group), lr_all / n_all


def test_honest_engines_pass_and_cheaters_are_quarantined(measured, tmp_path, tiny_model_dir):
    numbers = {name: spread(groups) for name, groups in measured.items()}
    for name, (mean, worst, lr) in numbers.items():
        print(f"audit spread {name}: mean k3 {mean:.3g}/token, worst group {worst:.3g}, "
              f"mean log-ratio {lr:+.3g}")  # fmt: skip
    config = ControllerConfig()
    assert numbers["bf16"][1] * 20 < config.audit_kl_threshold  # a wide margin, measured
    codec = TextCodec(tiny_model_dir)
    ctl = Controller(config, str(tmp_path / "c.db"), make_task("arithmetic"), codec=codec)
    profile = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8)
    workers = {name: ctl.register(profile)[0] for name in measured}
    caught_after = {}
    # A long run: every worker's groups, over and over (honest ones see ~25k tokens each).
    for rnd in range(20):
        for name, groups in measured.items():
            for gi, (b, lr, m) in enumerate(groups):
                stats = audit.rows_to_worker_stats(
                    [workers[name]] * N, [0] * N, b, lr, m, current_version=0
                )
                if ctl.audit(stats):
                    caught_after[name] = rnd * GROUPS + gi + 1
    tokens_per_group = np.mean([m.sum() for _, _, m in measured["fp32"]])
    bound = int(np.ceil(config.audit_min_tokens / tokens_per_group)) + 1
    assert set(caught_after) == {"fabricated", "other_model"}, caught_after
    assert max(caught_after.values()) <= bound, (caught_after, bound)
    assert ctl.stats()["fleet/quarantined"] == 2
    assert ctl.authenticate("anything") is None
    ctl.close()
