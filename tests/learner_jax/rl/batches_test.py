"""The RL batch stream against a real controller: trajectories are forgotten only once a
durable checkpoint holds their update, so a run that dies before its newest checkpoint is
durable resumes from the one before and finds every batch it must train again."""

from controller_helpers import make, submit_all, worker

from bridge.control.protocol import LeaseRequest
from learner_jax.rl.batches import BatchShape, BatchSource
from learner_jax.training import advantages


def test_a_checkpoint_at_step_l_frees_only_the_batches_before_l(tmp_path):
    ctl = make(tmp_path, staleness=10, groups_per_step=1)
    ctl.publish(0)
    w = worker(ctl)
    submit_all(ctl, w, ctl.lease(w, LeaseRequest(worker_version=0, max_groups=8)).lease)
    learner_step = [0]  # the learner's step: the batch for step s trains update s + 1
    source = BatchSource(
        ctl,
        BatchShape(groups_per_step=1, samples_per_group=2, max_prompt_len=16, max_answer_len=4),
        advantages.AdvantageConfig(),
        pad_id=0,
        step_fn=lambda: learner_step[0],
        timeout_s=5.0,
    )
    cursors, taken = {}, {}
    for _, _, cursor in source:
        step = learner_step[0]
        taken[step] = [g.group_id for g in source.last_groups]
        learner_step[0] += 1  # trained: a checkpoint now would be at learner step `step + 1`
        cursors[step + 1] = cursor  # what that checkpoint holds
        if step == 0:
            source.checkpointed(1)  # checkpoint 1 saved
        if step == 2:
            source.checkpointed(3)  # checkpoint 3 saving: 1 is surely durable
            break
    # The run dies before checkpoint 3 is durable: the rerun resumes from checkpoint 1 and
    # must find the batches of steps 1 and 2 again (only step 0's was freed).
    ctl.close()
    ctl = make(tmp_path, staleness=10, groups_per_step=1)
    assert ctl.restore_cursor(cursors[1]) == 2
    for step in (1, 2):
        batch, _ = ctl.take_batch(step, 1)
        assert [g.group_id for g in batch] == taken[step]
