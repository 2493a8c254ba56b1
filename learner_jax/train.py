"""The training binary: SFT warm start, then RL on trajectories from the rollout fleet.

    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/echo2_demo \
        [--config.total_steps=100 --config.mesh.fsdp=2 ...]

Writes the resolved config to `<workdir>/config.json` (and logs it), builds the sharded
learner (`learner_jax/learner.py`), resumes from the newest checkpoint in the workdir if
there is one, runs the SFT phase (`config.sft.steps` updates on the task's SFT pairs) and
then the RL phase (`run_rl`, fed by an iterator of trajectory batches; the controller
plugs in through `learner_jax/rl_loop.py`). Metrics go to `<workdir>/metrics.jsonl`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator

from absl import app, flags
from ml_collections import config_flags

from learner_jax import train_step
from learner_jax.learner import Learner, check_tiny_model_dir, validate

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a configs/NAME.py file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, model).")

CONFIG_FILE = "config.json"


def write_config(config, workdir: str) -> str:
    """Log the resolved config and write it as JSON into the workdir."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    text = config.to_json_best_effort(indent=2, sort_keys=True)
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)
    logging.info("resolved config:\n%s", config)
    return path


def make_task(config):
    """The config's task from the bridge registry (None when it has no SFT examples)."""
    from bridge import tasks

    options = {k: v for k, v in config.task.to_dict().items() if k != "name"}
    return tasks.make_task(config.task.name, **options)


def run_sft(learner: Learner, task, log_every: int = 1) -> None:
    """SFT phase until `config.sft.steps` updates; resumes mid-phase from the cursor."""
    from bridge.contracts.prompt import TextCodec
    from learner_jax.sft_data import SFTStream

    config = learner.config
    if learner.phase != "sft":
        return
    max_len = config.batch.max_prompt_len + config.batch.max_answer_len
    stream = SFTStream(
        task,
        TextCodec(learner.hf_dir),
        config.sft.batch_size,
        max_len,
        seed=config.seed,
        skip=learner.cursor["sft_consumed"],
    )
    while learner.step < config.sft.steps:
        t0 = time.perf_counter()
        batch = next(stream, None)
        if batch is None:
            logging.warning("task %s ran out of SFT examples", config.task.name)
            break
        metrics = learner.train_step(batch, wait_s=time.perf_counter() - t0)
        learner.cursor["sft_consumed"] = stream.consumed
        if learner.step % log_every == 0 or learner.step == config.sft.steps:
            learner.log(metrics)
            logging.info(
                "sft step %d loss %.4f acc %.3f",
                learner.step,
                metrics["loss"],
                metrics["token_accuracy"],
            )
        learner.save()


RLItem = tuple[train_step.Batch, dict, dict]  # (batch, metrics from the fleet, cursor blob)


def run_rl(
    learner: Learner,
    items: Iterable[RLItem],
    on_step: Callable[[Learner, dict], dict | None] | None = None,
) -> None:
    """RL phase: one update per item until `config.total_steps` RL updates are done.

    Each item carries the batch, the fleet's metrics for it (policy_version, reward/mean,
    staleness/..., merged into the metrics line) and the trajectory source's cursor, which
    is checkpointed so a resumed run continues the stream where it stopped. `on_step`
    runs after every update (e.g. to publish weights) and may add metrics.
    """
    learner.start_rl()
    config = learner.config
    end = learner.cursor["rl_start_step"] + config.total_steps
    it: Iterator[RLItem] = iter(items)
    while learner.step < end:
        t0 = time.perf_counter()
        item = next(it, None)
        if item is None:
            logging.warning("trajectory source ended at step %d", learner.step)
            break
        batch, fleet, cursor = item
        metrics = learner.train_step(batch, wait_s=time.perf_counter() - t0)
        learner.cursor["rl"] = cursor
        metrics.update(fleet)
        if on_step is not None:
            metrics.update(on_step(learner, metrics) or {})
        learner.log(metrics)
        learner.save()


def run(config, workdir: str, items: Iterable[RLItem] | None = None) -> Learner:
    """Everything main() does, callable from tests and the RL loop."""
    validate(config)  # a bad config fails here, before anything is written
    check_tiny_model_dir(config, workdir)  # and so does resuming another model's workdir
    write_config(config, workdir)
    learner = Learner(config, workdir)
    try:
        if config.sft.steps > 0 and learner.phase == "sft":
            task = make_task(config)
            run_sft(learner, task, config.log_every)
        if items is None and config.total_steps > 0:
            items = _default_rl_items(learner)
        if items is not None and config.total_steps > 0:
            # The controller-fed source (rl_loop.RLSource) publishes weights after each
            # step (on_step) and stops its workers and writes the report on close().
            run_rl(learner, items, getattr(items, "on_step", None))
        learner.save(force=learner.ckpt.latest_step() != learner.step)
    finally:
        if hasattr(items, "close"):
            items.close()
        learner.close()
    return learner


def _default_rl_items(learner: Learner):
    """The controller-fed trajectory stream, once learner_jax/rl_loop.py exists."""
    try:
        from learner_jax import rl_loop
    except ImportError:
        logging.warning("learner_jax.rl_loop is not available: stopping after the SFT phase")
        return None
    return rl_loop.trajectory_items(learner)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _WORKDIR.value is None or _CONFIG.value is None:
        raise app.UsageError("--config and --workdir are required")
    logging.getLogger().setLevel(logging.INFO)
    # orbax logs every file rename at INFO; keep its warnings, drop the chatter.
    logging.getLogger("absl").addFilter(
        lambda r: r.levelno >= logging.WARNING or "orbax" not in r.pathname
    )
    learner = run(_CONFIG.value, _WORKDIR.value)
    print(json.dumps({"workdir": _WORKDIR.value, "step": learner.step, "phase": learner.phase}))


if __name__ == "__main__":
    app.run(main)
