"""What a lease hands a worker for each prompt group, built on the trusted side.

The controller builds each prompt's token ids itself (the run's tokenizer, `codec`) and
refuses a submission generated from other ids (bridge/control/intake/intake.py checks against the
same `prompt_ids`); the sampling settings and, for a multi-turn task, the episode spec come
from the run's config and task, never from a worker.

Part of `Controller` (bridge/control/controller.py, `self.content`).
"""

from __future__ import annotations

from bridge.control.config import ControllerConfig
from bridge.control.intake.rewards import Codec
from bridge.control.intake.validation import SubmissionError
from bridge.control.leasing.sampling_seeds import SamplingSeeds
from bridge.control.protocol import EpisodeSpec, PromptGroup, SamplingParams
from bridge.tasks import EnvTask, Task


class LeaseContent:
    def __init__(
        self,
        config: ControllerConfig,
        task: Task,
        codec: Codec | None,
        seeds: SamplingSeeds | None = None,
    ):
        self.config, self.task, self.codec = config, task, codec
        self.seeds = seeds

    def prompt_ids(self, text: str) -> list[int]:
        if self.codec is None:
            raise SubmissionError(
                "this controller has no tokenizer (Controller(..., codec=TextCodec(hf_dir))), "
                "so it can neither build prompt ids nor score completions",
                503,
            )
        return self.codec.encode_prompt(text)

    @property
    def sampling(self) -> SamplingParams:
        """What a lease asks for; a multi-turn task's `turn_max_tokens` caps each turn."""
        c, t = self.config, self.task
        if isinstance(t, EnvTask) and t.turn_max_tokens < c.sampling.max_tokens:
            return c.sampling.model_copy(update={"max_tokens": t.turn_max_tokens})
        return c.sampling

    def episode(self, answer: str) -> EpisodeSpec | None:
        """What a worker needs to play a multi-turn task's prompt (None: single-turn). The
        seed (an environment task's `answer`, bridge/tasks/env.py: EnvTask) is hidden
        state, a poker deal: it stays here, and the worker gets each observation from
        POST /v1/episode (episode_steps.py). An environment without hidden state
        (`Environment.hidden_state` False: a tool task's question) sends its seed, and the
        worker plays it, its tools included; the scoring replay recomputes every
        observation either way."""
        t = self.task
        if not isinstance(t, EnvTask):
            return None
        c = self.config
        return EpisodeSpec(
            env=t.env_name,
            module=type(t.env).__module__,
            options=t.env_options,
            seed=-1 if t.hides_state else int(answer),
            max_turns=t.max_turns,
            max_tokens=c.max_completion_tokens or c.sampling.max_tokens,
        )

    def group(self, row, lease_id: str = "") -> PromptGroup:
        """The leased form of one queued group (a `groups` row of bridge/control/state/db.py) in
        lease `lease_id`, with that lease's sampling seed for it (sampling_seeds.py)."""
        sampling = self.sampling
        if self.seeds is not None and lease_id:
            seed = self.seeds.seed(lease_id, row["group_id"])
            sampling = sampling.model_copy(update={"seed": seed})
        return PromptGroup(
            group_id=row["group_id"],
            prompt_id=row["prompt_id"],
            task=self.task.name,
            prompt=row["prompt"],
            prompt_token_ids=self.prompt_ids(row["prompt"]),
            n=self.config.group_size,
            sampling=sampling,
            episode=self.episode(row["answer"]),
        )
