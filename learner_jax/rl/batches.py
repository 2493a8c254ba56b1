"""The RL batch stream: one learner batch per step from the controller's accepted groups.

    source = BatchSource(ctl, shape, adv_cfg, pad_id, step_fn=lambda: learner.step, ...)
    for batch, fleet_metrics, cursor in source: ...

Each item is `ctl.wait_batch(step, groups_per_step)` -> `rollout_batch.groups_to_batch`,
with the fleet's metrics for it and the controller's cursor, which the learner checkpoints
so a resumed run continues where this one stopped. The stream ends when `should_stop()`
turns true (Ctrl-C); `check_fleet()` runs while it waits, so a dead local fleet fails
the run instead of hanging it, and `timeout_s` without a batch is an error too.
`checkpointed(step)` frees consumed trajectories once a checkpoint holds them;
`last_row_workers` names the worker of each row of the newest batch and `last_groups` holds
its groups (for the audit). With the exact check on, each step logs one line (train.log) of
which worker made each consumed group and which groups were refused:

    exact check step 7: groups {"12": "w3", "13": "w1"} refused [12]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable

from bridge.control.trust import audit
from learner_jax import advantages, rollout_batch


@dataclasses.dataclass(frozen=True)
class BatchShape:
    groups_per_step: int
    samples_per_group: int
    max_prompt_len: int
    max_answer_len: int


class BatchSource:
    def __init__(
        self,
        ctl,
        shape: BatchShape,
        adv_cfg: advantages.AdvantageConfig,
        pad_id: int,
        step_fn: Callable[[], int],
        *,
        timeout_s: float,
        should_stop: Callable[[], bool] = lambda: False,
        check_fleet: Callable[[], None] = lambda: None,
        where: str = "the workers' logs",
        verify: Callable | None = None,
    ):
        """`verify(groups)`: the exact check (exact_check.py `ExactChecker.check`); its
        refused groups keep their rows in the batch with seq_mask 0."""
        self.ctl, self.shape, self.adv_cfg, self.pad_id = ctl, shape, adv_cfg, pad_id
        self.step_fn, self.timeout_s = step_fn, timeout_s
        self.should_stop, self.check_fleet, self.where = should_stop, check_fleet, where
        self.verify = verify
        self.last_verdict = None
        self._last_ckpt: int | None = None
        self.last_row_workers: list[str] = []
        self.last_groups: list = []

    def __iter__(self):
        s = self.shape
        while not self.should_stop():
            step = self.step_fn()
            t0, groups, data_wait = time.monotonic(), None, 0.0
            while groups is None:
                groups, stats = self.ctl.wait_batch(step, s.groups_per_step, timeout_s=1.0)
                data_wait += stats.get("time/data_wait_s", 0.0)
                if self.should_stop():
                    return
                if groups is None:
                    self.check_fleet()
                    if time.monotonic() - t0 > self.timeout_s:
                        raise TimeoutError(
                            f"no batch for step {step} after {self.timeout_s:.0f}s: {stats}; "
                            f"see {self.where}"
                        )
            cursor = self.ctl.export_cursor()
            refused: frozenset[int] = frozenset()
            if self.verify is not None:
                # Before anything trains: a group with a token that is not the seeded
                # sampler's choice is refused, and its worker's count goes to the audit.
                self.last_verdict = self.verify(groups)
                refused = frozenset(self.last_verdict.refused)
                self.ctl.audit(self.last_verdict.stats)
                stats = {**stats, **self.last_verdict.metrics}
                # What trained and what did not, per group: the record a run is judged by.
                made = json.dumps({str(g.group_id): g.worker_id for g in groups})
                logging.info("exact check step %d: groups %s refused %s", step, made,
                             sorted(refused))  # fmt: skip
            batch, rstats = rollout_batch.groups_to_batch(
                groups,
                s.samples_per_group,
                s.max_prompt_len,
                s.max_answer_len,
                step,
                self.adv_cfg,
                pad_id=self.pad_id,
                refused=refused,
            )
            # Which worker made each row: the controller audits workers' log-probs with it.
            self.last_row_workers = audit.row_workers(groups, s.samples_per_group)
            self.last_groups = groups
            # The learner reports the version it publishes; the fleet's is per sample.
            fleet = {k: v for k, v in stats.items() if not k.startswith("policy_version")}
            # Of the learner's wait (time/wait_s), the part with no batch at the controller;
            # taking and building the batch is the learner's own time (rl/hooks.py Publish).
            fleet.update(rstats, **{"time/data_wait_s": data_wait})
            yield batch, fleet, cursor

    def checkpointed(self, latest: int | None) -> None:
        """Forget trajectories the checkpoint before `latest` holds.

        The checkpoint before the newest is surely durable (saves are asynchronous). A
        checkpoint at learner step L holds the updates of the batches taken at steps < L
        (the batch of step L is the next one trained), so only those are forgotten: a run
        that dies before `latest` is durable resumes from L and takes step L's batch again.
        Forgetting step L's batch too lost it in the chaos soak (4 groups, stop 20)."""
        if latest is None or latest == self._last_ckpt:
            return
        if self._last_ckpt is not None:
            self.ctl.forget_consumed(self._last_ckpt - 1)
        self._last_ckpt = latest
