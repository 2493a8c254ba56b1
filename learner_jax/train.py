"""The training binary: SFT warm start, then RL on trajectories from the rollout fleet.

    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/echo2_demo \
        [--config.total_steps=100 --config.mesh.fsdp=2 ...]

`main` -> `run(config, workdir)`, which reads top to bottom:

  1. validate the config (a bad one fails before anything is written), write config.json
  2. build the learner (`learner.py`); it resumes from the newest checkpoint in the workdir
  3. SFT: `config.sft.steps` updates on the task's (prompt, answer) pairs
  4. wire the RL parts (`learner_jax/rl/`): controller + HTTP service, swap watcher,
     weight store + publisher, held-out evaluation, fleet (provisioners + follower), batch
     source, Ctrl-C
  5. the RL loop: one update per batch until `config.total_steps` RL updates are done;
     after each, the parts' after-step hooks in order (`rl/hooks.py`: publish, audit,
     evaluate, fleet), so the loop itself knows none of them
  6. shut the parts down in reverse order, evaluate once more, write the report

Ctrl-C during RL finishes the step, checkpoints and shuts down in that order; rerunning the
same command resumes (the checkpoint holds the controller's cursor). The console shows a
header, progress bars, warnings and a summary; the complete log is `<workdir>/train.log`
(`console.py`). Metrics: `<workdir>/metrics.jsonl` and TensorBoard files in `<workdir>/tb`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator, Sequence

from absl import app, flags
from ml_collections import config_flags

from learner_jax import run_config
from learner_jax.learner import Learner
from learner_jax.model.model_dir import check_tiny_model_dir
from learner_jax.multihost import distributed
from learner_jax.reporting import console, report
from learner_jax.rl.hooks import AfterStep, after_step
from learner_jax.run_config import prompt_format, validate
from learner_jax.training import diagnostics, train_step

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a configs/NAME.py file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, model).")

CONFIG_FILE = "config.json"
# Not __name__: under `python -m` that is "__main__", outside the learner_jax logger tree.
log = logging.getLogger("learner_jax.train")

RLItem = tuple[train_step.Batch, dict, dict]  # (batch, metrics from the fleet, cursor blob)


def write_config(config, workdir: str) -> str:
    """Write the resolved config as JSON into the workdir (and to the log, at DEBUG)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    text = config.to_json_best_effort(indent=2, sort_keys=True)
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)
    log.debug("resolved config:\n%s", config)
    return path


def make_task(config):
    """The config's task from the bridge registry."""
    from bridge import tasks
    from bridge.contracts import thinking
    from bridge.tasks.chat_turns import TemplateTurns

    # task.thinking / task.eval_file are the run's (prompt format, evaluation), not options
    run_keys = ("name", "thinking", "eval_file")
    options = {k: v for k, v in config.task.to_dict().items() if k not in run_keys}
    task = tasks.make_task(config.task.name, **options)
    mode = thinking.prompt_thinking(str(config.task.get("thinking", "auto")))
    if mode and isinstance(getattr(getattr(task, "env", None), "turns", None), TemplateTurns):
        # An environment's turns end with the template's generation prompt, which the
        # thinking switch changes (Qwen3 off: an empty think block): the run's, as the
        # prompt's. An option, so workers and the reward pool build the same turns.
        task = tasks.make_task(config.task.name, **options, thinking=mode)
    return task


def run_sft(learner: Learner, task) -> None:
    """SFT phase until `config.sft.steps` updates; resumes mid-phase from the cursor."""
    from bridge.contracts.prompt import TextCodec
    from learner_jax.training.sft_data import SFTStream

    config = learner.config
    max_len = config.batch.max_prompt_len + config.batch.max_answer_len
    stream = SFTStream(
        task,
        TextCodec(learner.hf_dir, prompt_format(config, task)),
        config.sft.batch_size,
        max_len,
        seed=config.seed,
        skip=learner.cursor["sft_consumed"],
    )
    with console.Progress("SFT", config.sft.steps, done=learner.step) as bar:
        while learner.step < config.sft.steps:
            t0 = time.perf_counter()
            batch = next(stream, None)
            if batch is None:
                logging.warning("task %s ran out of SFT examples", config.task.name)
                break
            metrics = learner.train_step(batch, wait_s=time.perf_counter() - t0)
            learner.cursor["sft_consumed"] = stream.consumed
            line = f"loss {metrics['loss']:.4f} | acc {metrics['token_accuracy']:.3f}"
            if learner.step % config.log_every == 0 or learner.step == config.sft.steps:
                learner.log(metrics)
                logging.info("sft step %d %s", learner.step, line)
            learner.save()
            bar.update(learner.step, line)


def run_rl(learner: Learner, items: Iterable[RLItem], hooks: Sequence[AfterStep] = ()) -> None:
    """RL phase: one update per item until `config.total_steps` RL updates are done.

    Each item carries the batch, the fleet's metrics for it (policy_version, reward/mean,
    staleness/..., merged into the metrics line) and the trajectory source's cursor, which
    is checkpointed so a resumed run continues the stream where it stopped. `hooks`
    (learner_jax/rl/hooks.py: publishing, audit, evaluation, the fleet) run in order after
    every update and may add metrics.
    """
    learner.start_rl()
    config, start = learner.config, learner.cursor["rl_start_step"]
    end = start + config.total_steps
    it: Iterator[RLItem] = iter(items)
    last_acc = None  # the bar keeps showing the latest held-out accuracy
    with console.Progress("RL", config.total_steps, learner.rl_steps, offset=start) as bar:
        while learner.step < end:
            t0 = time.perf_counter()
            item = next(it, None)
            if item is None:
                logging.info("trajectory stream ended at step %d", learner.step)
                break
            batch, fleet, cursor = item
            metrics = learner.train_step(batch, wait_s=time.perf_counter() - t0)
            learner.cursor["rl"] = cursor
            metrics.update(fleet)
            metrics.update(after_step(hooks, learner, metrics))
            row = learner.log(metrics)
            learner.save()
            last_acc = row.get("eval/accuracy", last_acc)
            bar.update(learner.rl_steps, report.live_fields({**row, "eval/accuracy": last_acc}))
    learner.save(force=learner.ckpt.latest_step() != learner.step)


def run(config, workdir: str, items: Iterable[RLItem] | None = None, config_file: str = ""):
    """Everything main() does. `items` replaces the fleet's batches (tests)."""
    from bridge.contracts.prompt import TextCodec
    from learner_jax.evaluation import evals, evaluate, fleet_eval
    from learner_jax.fleet import fleet, local_fleet
    from learner_jax.multihost import mirror
    from learner_jax.rl import (
        batches,
        exact_check,
        heal,
        hooks,
        interrupt,
        rescore,
        serve,
        swaps,
        weights,
    )

    # 1. Config: every check that needs no workdir first, then the files. With several
    # processes (config.distributed) they connect first: the mesh spans all their devices.
    distributed.initialize(run_config.distributed_config(config))
    validate(config)
    if config.total_steps > 0 and distributed.is_leader():  # before any work
        diagnostics.warn_cold_adam(config.optimizer.learning_rate, config.optimizer.warmup_steps)
    check_tiny_model_dir(config, workdir)  # resuming another model's workdir fails here too
    if distributed.is_leader():  # one writer per shared workdir file
        write_config(config, workdir)
        console.log_to_file(workdir)
        console.header(config, workdir, config_file)
    distributed.barrier(f"checked:{os.path.abspath(workdir)}")  # before anyone writes more
    # 2. The learner, restored from the workdir's newest checkpoint when there is one.
    learner = Learner(config, workdir)
    with contextlib.ExitStack() as stack:
        stack.callback(learner.close)
        task = make_task(config)
        # 3. SFT warm start.
        if config.sft.steps > 0 and learner.phase == "sft":
            run_sft(learner, task)
        if config.total_steps <= 0:
            learner.save(force=learner.ckpt.latest_step() != learner.step)
            return learner
        learner.start_rl()
        if items is not None:
            run_rl(learner, items)
            return learner
        if not distributed.is_leader():  # processes 1..P-1 mirror process 0's RL loop
            follow_rl(learner, task)
            return learner
        leader = None  # process 0 of several: announces every collective to the others
        if distributed.multi_process():
            leader = learner.mirror = mirror.Leader(learner)
            stack.push(_end_followers(leader))

        # 4. The RL parts; `parts` closes them in reverse order of creation.
        parts = stack.enter_context(contextlib.ExitStack())
        codec = TextCodec(learner.hf_dir, prompt_format(config, task))
        end = learner.cursor["rl_start_step"] + config.total_steps
        store = weights.open_store(config.bridge.store, workdir, learner.step)
        c = config.controller
        token_file = c.token_file or None
        ctl, server, closers = serve.start_controller(  # own_process: off the learner's GIL
            run_config.controller_config(
                config, learner.model_cfg.vocab_size, codec.eos_id, learner.model_cfg
            ),
            (workdir, task, codec),
            (learner.cursor.get("rl"), learner.step),
            (run_config.server_options(config), token_file),
            own_process=c.get("own_process", False),
        )
        for close in closers:
            parts.callback(close)
        watcher = swaps.SwapWatcher(ctl, os.path.join(workdir, swaps.SWAPS_FILE))
        parts.callback(watcher.stop)
        publisher = weights.WeightPublisher(
            store,
            weights.announcing_hash(ctl.publish),
            learner,
            every=config.publish_every,
            keep=run_config.versions_kept(config),
            # Across processes the publish's collectives must keep their place among the
            # train steps' (the followers replay them in order): publish synchronously.
            background=config.bridge.async_publish and leader is None,
            seed=config.seed,
            vocab_size=codec.tok.get_vocab_size(),
            bos_id=codec.bos_id,
            on_announce=watcher.published,
            mirror=leader,
            delta_config=config.bridge.delta,
            own_store=not config.bridge.store,
        )
        parts.callback(publisher.close)
        publisher.publish(learner.step)  # synchronous: workers need a first version to start
        eval_log = evals.EvalLog(
            _evaluator(learner, task, codec),
            learner,
            workdir,
            end=end,
            period=config.rollout.eval_period,
            # The exact expected reward (Kuhn) runs on process 0 alone: one process only.
            exact=None
            if leader is not None
            else evaluate.exact_evaluator(
                learner.model_cfg, codec, task, run_config.compute_dtype(config)
            ),
            mirror=leader,
        )
        on_learner = fleet_eval.eval_place(config) == "learner"  # else: the workers evaluate
        if on_learner:
            before = eval_log.ensure("before")
            logging.info(
                "held-out accuracy before RL: %.3f (step %d)",
                before["accuracy"],
                before["step"],
                extra=console.SHOW,
            )
        # The fleet: provisioners start `local_workers` workers (local processes or the
        # fleet's command templates); the follower replaces dead ones and, with activation
        # on, releases standby workers and adds one when the active fleet is short.
        fleet_cfg = run_config.fleet_config(config)
        provs = local_fleet.make_provisioners(
            fleet_cfg,
            workdir,
            server.url,
            token_file or os.path.join(workdir, "join_token"),
            config.seed,
            config.local_workers,
        )
        follower = fleet.FleetFollower(
            ctl.status,
            provs,
            run_config.follow_config(config, fleet_cfg),
            os.path.join(workdir, "workers"),
        )
        # Closed after the run-over drain below (parts close in reverse): stop and wait.
        parts.callback(follower.close)
        local_fleet.start_initial(provs, fleet_cfg, config.local_workers)
        logging.info(
            "controller at %s; %d %s workers starting (logs in %s)",
            server.url,
            config.local_workers,
            fleet_cfg.provisioner,
            os.path.join(workdir, "workers"),
            extra=console.SHOW,
        )
        ctrl_c = parts.enter_context(
            interrupt.StopOnCtrlC(lambda msg: logging.info(msg, extra=console.SHOW))
        )
        rescorer = rescore.VersionRescorer.for_run(config, learner, publisher, leader, ctl.config)
        exact = exact_check.ExactChecker.for_run(config, rescorer, ctl.config)
        healer = heal.VersionHealer(ctl, publisher)  # a version workers cannot load
        source = batches.BatchSource(
            ctl,
            run_config.batch_shape(config),
            run_config.advantage_config(config),
            codec.pad_id,
            lambda: learner.step,
            timeout_s=config.rollout.wait_timeout_s,
            should_stop=ctrl_c.requested,
            check_fleet=lambda: (follower.check(), healer.check()),
            where=os.path.join(workdir, "workers"),
            verify=exact.check if exact is not None else None,
        )
        evaluation = fleet_eval.evaluation_hook(
            config, ctl, task, eval_log, workdir, end, rescorer, exact
        )
        # 5. The RL loop, and what runs after each of its updates, in this order.
        run_rl(
            learner,
            source,
            [
                hooks.Publish(publisher, ctl),
                hooks.Audit(ctl, source, rescorer),
                evaluation,
                hooks.Fleet(follower, source),
            ],
        )
        # eval.on=fleet: the last step's version too (eval.final_wait_s), unless Ctrl-C
        fleet_eval.final_wait(evaluation, wait=not ctrl_c.requested())
        # 6. Tell the workers the run is over (finished or Ctrl-C; not on a crash, whose
        # rerun they can rejoin; not with controller.tell_run_over=False: a standing pool)
        # and give polling ones a moment to hear it and exit 0; then workers, publisher,
        # watcher, server and controller stop; then the closing numbers.
        reason = "interrupted" if ctrl_c.requested() else "finished"
        serve.end_run(ctl, reason, tell=config.controller.get("tell_run_over", True))
        parts.close()
        if on_learner:
            eval_log.final()
        path = report.write_report(workdir)
        if learner.metrics is not None:  # W&B: the eval table and the plots
            learner.metrics.report(workdir)
        with open(path) as fh:
            print("\n" + fh.read().strip(), flush=True)
        print(f"report: {path}", flush=True)
    return learner


def _evaluator(learner, task, codec):
    from bridge.tasks.tool_env import ToolEnvironment
    from learner_jax.evaluation import episode_eval, evaluate

    cfg = run_config.eval_config(learner.config)
    if isinstance(getattr(task, "env", None), ToolEnvironment):
        # A tool episode's answer comes after its calls: play the episodes.
        return episode_eval.EpisodeEvaluator(learner.model_cfg, codec, task, cfg)
    return evaluate.Evaluator(learner.model_cfg, codec, task, cfg)


def follow_rl(learner: Learner, task) -> None:
    """Processes 1..P-1 of a multi-process run: train, publish, evaluate and checkpoint
    exactly when process 0 says (learner_jax/multihost/mirror.py); process 0 owns the fleet."""
    from bridge.contracts.prompt import TextCodec
    from bridge.store.weight_store import WeightStore
    from learner_jax.multihost import mirror
    from learner_jax.rl import weights

    codec = TextCodec(learner.hf_dir)
    canary = weights.Canary(learner, codec.tok.get_vocab_size(), codec.bos_id, learner.config.seed)
    evaluator = _evaluator(learner, task, codec)

    def publish_fn(version: int, write: bool, spec: dict) -> None:
        if write:
            weights.write_full_version(WeightStore(spec), version, learner, canary)

    def eval_fn() -> None:
        evaluator.completions(learner.policy_params, learner.mesh, learner.rules)

    # A launcher's Ctrl-C reaches every process (srun, mpirun, a shell's process group):
    # process 0 finishes its step, checkpoints (with us) and then ends the run; dying here
    # would leave that checkpoint waiting. Killing process 0 still stops us (heartbeats).
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        mirror.follow(learner, publish_fn, eval_fn)
    finally:
        signal.signal(signal.SIGINT, previous)


def _end_followers(leader):
    """An exit callback telling the followers the run is over (an exception on process 0,
    Ctrl-C included, fails them too, naming it)."""

    def on_exit(exc_type, exc, tb) -> bool:
        leader.end("" if exc is None else f"{exc_type.__name__}: {exc}")
        return False  # never swallows the exception

    return on_exit


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _WORKDIR.value is None or _CONFIG.value is None:
        raise app.UsageError("--config and --workdir are required")
    console.setup()
    config_file = config_flags.get_config_filename(flags.FLAGS["config"])
    learner = run(_CONFIG.value, _WORKDIR.value, config_file=config_file)
    print(json.dumps({"workdir": _WORKDIR.value, "step": learner.step, "phase": learner.phase}))


def cli() -> None:
    """`echo2-train` (pyproject's scripts): the same as `python -m learner_jax.train`."""
    app.run(main)


if __name__ == "__main__":
    cli()
