"""Partial rollouts (`rollout.partial=continue`): a lease that waited starts generating on the
newest version the controller has, not on the last one its worker happened to hear of.

A worker hears of new versions from heartbeats (seconds apart, further as the fleet grows)
and from lease and submission replies. Here the worker (in-process, on the session's vLLM
engine) takes a lease at version 0; while the lease waits (the worker's throttle, a busy
worker's queue) the learner publishes versions 1 and 2 and moves on to step 2, and no
heartbeat runs (the test drives the worker, there is no heartbeat thread). With S = 1, step 2
may consume versions 1 and 2 only, so a lease generated on version 0 comes back too stale
and the controller drops it, although the controller had version 2 before the lease
generated a token. The worker must ask for version news before it generates, swap version 2
in and generate on it; the learner then consumes every group of the lease at step 2.

Real components: the controller over HTTP on loopback, a file weight store holding versions
0-2 (all three the engine's own weights, so the swaps are real loads through the verified
loader and leave the shared engine as it was), the worker's own lease and submission path.

Would catch: a worker that generates a `continue` lease on the version it last heard of
without asking (the drop), or that asks but does not swap before generating; for episodes
(Kuhn poker), a `continue` lease played without the controller's observations.
"""

import os

import pytest

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import (
    ServerOptions,
    load_or_create_join_secret,
    serve_controller,
)
from bridge.control.protocol import SamplingParams, WorkerProfile
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task
from rollout_gpu.worker import NEWS_FRESH_S, RolloutWorker, WorkerOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

S, GROUP_SIZE, MAX_TOKENS = 1, 2, 4
# The lease waits this long after its reply before generating: long enough that the reply's
# version news is no longer taken as the newest (`NEWS_FRESH_S`), which is the point.
WAIT_S = NEWS_FRESH_S + 0.1


@pytest.fixture(params=["arithmetic", "kuhn_poker"])
def rig(request, tmp_path, vllm_engine):
    """The task: single-turn groups, or Kuhn poker's episodes, whose observations the
    worker asks the controller for turn by turn (the deal is hidden)."""
    cfg = tiny_model.tiny_config("qwen3")
    store_url = f"file://{tmp_path}/store"
    store = WeightStore(store_url)
    weights = tiny_model.random_hf_weights(cfg, seed=0)  # the model dir's: the engine's own
    config = ControllerConfig(
        staleness=S,
        partial="continue",
        groups_per_step=1,
        group_size=GROUP_SIZE,
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
        vocab_size=cfg.vocab_size,
        lease_ttl_s=120.0,  # no heartbeat thread renews it here
    )
    tokenizer = os.path.join(tmp_path, "tokenizer")
    os.makedirs(tokenizer)
    tiny_model.save_tokenizer(tokenizer)
    ctl = Controller(
        config,
        os.path.join(tmp_path, "controller.db"),
        make_task(request.param),
        codec=TextCodec(tokenizer),
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions(host="127.0.0.1", port=0))

    def publish(version):
        store.publish(
            version, version, weights.items(), model_config=cfg.to_hf_dict(), dtype="float32"
        )
        ctl.publish(version, store=store_url)

    opts = WorkerOptions(
        relay=False,
        controller=server.url,
        join_secret=load_or_create_join_secret(str(tmp_path)),
        profile=WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8),
        throttle_s=WAIT_S,
    )
    worker = RolloutWorker(opts, engine=vllm_engine)
    try:
        yield ctl, publish, worker
    finally:
        worker.shutdown()
        server.stop()
        ctl.close()


def test_a_lease_that_waited_generates_on_the_controllers_newest_version(rig):
    ctl, publish, worker = rig
    publish(0)
    worker.session.join()
    assert worker.versions.ensure(worker.engine) and worker.version == 0
    lease = worker.take_lease()  # at version 0, the learner's next step 0
    assert lease is not None and lease.partial == "continue"
    n = len(lease.groups)

    # While the lease waits, the learner trains on (other workers') batches and publishes
    # versions 1 and 2, then asks for step 2's batch: nothing of this lease is in yet.
    publish(1)
    publish(2)
    assert ctl.take_batch(2, n)[0] is None

    assert worker.run_lease(lease) is True
    batch, _ = ctl.take_batch(2, n)
    stats = ctl.stats()
    assert batch is not None, f"dropped {stats['staleness/dropped']} of {n} groups"
    assert stats["staleness/dropped"] == 0
    assert worker.version == 2
    for g in batch:
        for t in g.trajectories:
            assert t.versions and set(t.versions) == {2}, t.versions
