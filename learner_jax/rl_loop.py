"""The RL phase's plumbing: controller + weight bridge + local fleet around the learner.

`learner_jax/train.py` runs, after SFT,

    source = trajectory_items(learner)   # an RLSource
    run_rl(learner, source, source.on_step); source.close()

`RLSource` starts the controller (SQLite in `<workdir>/controller.db`, HTTP on
`config.controller.host:port`, `<workdir>/controller.json`), a file weight store in
`<workdir>/weights`, publishes the learner's current params as version `learner.step`
(with the learner-side canary) and announces it, then spawns `config.local_workers`
rollout worker processes (`learner_jax/local_fleet.py`). Iterating it yields one
`(Batch, fleet metrics, cursor)` per learner step: `wait_batch(step, groups_per_step)`
-> `rollout_batch.groups_to_batch`. `on_step` publishes every `publish_every` steps
(`bridge/publish_s`), keeps S + 2 versions in the store, evaluates held-out accuracy
every `rollout.eval_period` RL steps, frees consumed trajectories once a checkpoint holds them
and prints the live line.

Versions are learner steps (SFT steps included): version v = params after v updates.
Staleness is bounded by the controller (S = `config.staleness`); S = 0 is synchronous
(generate at version t, then train step t + 1) and needs `publish_every` = 1, since a
step can only consume what the newest version generated.

Ctrl-C (SIGINT) during RL sets a flag: the current step finishes, the source ends, the
training binary checkpoints, `close()` stops workers (SIGTERM, then kill) and the server
and writes the report. A second Ctrl-C interrupts at once. A rerun resumes: the learner
restores its checkpoint and `restore_cursor` puts groups consumed after it back in the
buffer. If the store holds versions newer than the checkpoint (a crash between publish
and checkpoint), that store and controller database are moved aside and a fresh pair
starts, skipping the prompts the checkpoint already consumed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from bridge.store import model_files
from bridge.control.controller import Controller, ControllerConfig
from bridge.control.service import ServerOptions, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.store.weight_store import WeightStore
from learner_jax import advantages, evaluate, local_fleet, model, publish, report, rollout_batch
from learner_jax.background_publish import BackgroundPublisher, PublishError
from bridge.contracts.prompt import TextCodec
from bridge.contracts import canary as canary_lib

EVAL_FILE = "eval.jsonl"
SWAPS_FILE = "swaps.jsonl"


def _opt(config, path: str, default):
    """config value at dotted `path`, or `default` when the config predates that key."""
    node = config
    for key in path.split("."):
        if key not in node:
            return default
        node = node[key]
    return node


def make_task(config):
    """The config's task (same options as the SFT phase's). Not imported from
    learner_jax.train: under `python -m` that module is __main__ and a second import would
    define its flags twice."""
    from bridge import tasks

    options = {k: v for k, v in config.task.to_dict().items() if k != "name"}
    return tasks.make_task(config.task.name, **options)


def fleet_config(config) -> local_fleet.FleetConfig:
    d = local_fleet.FleetConfig()
    return local_fleet.FleetConfig(
        prices=tuple(_opt(config, "fleet.prices", d.prices)),
        throttle_s=tuple(_opt(config, "fleet.throttle_s", d.throttle_s)),
        max_num_seqs=_opt(config, "fleet.max_num_seqs", d.max_num_seqs),
        threads=_opt(config, "fleet.threads", d.threads),
        kvcache_gib=_opt(config, "fleet.kvcache_gib", d.kvcache_gib),
    )


def open_store(config, workdir: str, step: int) -> WeightStore:
    """The run's weight store (`bridge.store`, default <workdir>/weights) for checkpoint `step`.

    Versions newer than the checkpoint come from a run that died after publishing past its
    last checkpoint. In the workdir's own store they (and the controller database, whose
    trajectories refer to them) are moved aside; in a configured store they are an error,
    since a shared bucket path may hold someone else's run.
    """
    spec = str(_opt(config, "bridge.store", "") or "")
    own = os.path.join(workdir, "weights")
    store = WeightStore(json.loads(spec) if spec.startswith("{") else spec or own)
    newer = [v for v in store.versions() if v > step]
    if not newer:
        return store
    if spec:
        raise ValueError(
            f"weight store {store.spec} has versions {newer} newer than checkpoint step "
            f"{step} (another run, or a lost checkpoint): point bridge.store at a fresh path"
        )
    tag = time.strftime("%Y%m%d-%H%M%S")
    logging.warning(
        "weight store has versions %s newer than checkpoint step %d: moving the store and "
        "controller database aside (*.stale-%s)",
        newer,
        step,
        tag,
    )
    for path in (own, os.path.join(workdir, "controller.db")):
        if os.path.exists(path):
            os.replace(path, f"{path}.stale-{tag}")
    return WeightStore(own)


class SwapWatcher:
    """Records when the controller first sees each worker serve each version (swaps.jsonl).

    Workers report their version on every lease request and heartbeat, so the time from
    `publish` to a worker's swap is observable at the controller, to within a lease poll.
    Versions published before a worker registered are skipped (that is startup time).
    """

    def __init__(self, ctl: Controller, path: str, period_s: float = 0.2):
        self.ctl, self.path, self.period_s = ctl, path, period_s
        self.published_at: dict[int, float] = {}  # version -> announce time (ctl clock)
        self._seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="swap-watcher")
        self._thread.start()

    def _loop(self) -> None:
        with open(self.path, "a") as f:
            while not self._stop.wait(self.period_s):
                with self.ctl.lock:
                    rows = self.ctl.store.q(
                        "SELECT worker_id, version, profile, registered_at FROM workers"
                    )
                now = self.ctl.clock()
                for r in rows:
                    wid, v = r["worker_id"], r["version"]
                    if v < 0 or self._seen.get(wid) == v:
                        continue
                    self._seen[wid] = v
                    pub = self.published_at.get(v)
                    if pub is None or pub < r["registered_at"]:
                        continue
                    line = {
                        "worker_id": wid,
                        "price_per_hour": json.loads(r["profile"])["price_per_hour"],
                        "version": v,
                        "seen_at": now,
                        "published_at": pub,
                    }
                    f.write(json.dumps(line) + "\n")
                    f.flush()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class RLSource:
    """Iterable of RL items plus the per-step hook; see the module docstring."""

    def __init__(self, learner):
        self.learner, config = learner, learner.config
        self.config, self.workdir = config, learner.workdir
        self.S, self.kappa = config.staleness, config.publish_every
        if self.kappa < 1 or self.S < 0:
            raise ValueError(
                f"need publish_every >= 1 and staleness >= 0, got {self.kappa}, {self.S}"
            )
        if self.S < self.kappa - 1:
            raise ValueError(
                f"staleness {self.S} < publish_every - 1 = {self.kappa - 1}: the learner would "
                "wait for versions that are never published"
            )
        self.g, self.n = config.batch.groups_per_step, config.batch.samples_per_group
        self.P, self.A = config.batch.max_prompt_len, config.batch.max_answer_len
        self.task = make_task(config)
        self.codec = TextCodec(learner.hf_dir)
        self.adv_cfg = advantages.AdvantageConfig(
            name=config.advantages.name,
            filter_equal_groups=config.advantages.filter_equal_groups,
        )
        self.eval_period = int(_opt(config, "rollout.eval_period", 0))
        self.rl_start = learner.cursor["rl_start_step"] if learner.phase == "rl" else learner.step
        self.end = self.rl_start + config.total_steps
        self._stop_requested = False
        self._closed = False
        self._prev_sigint = None
        self._last_ckpt = None
        self.fleet = self.server = self.watcher = self.publisher = None
        self.evaluator = evaluate.Evaluator(
            learner.model_cfg,
            self.codec,
            self.task,
            evaluate.EvalConfig(self.P, self.A, dtype=config.model.dtype),
        )
        self._canary_tokens = canary_lib.probe_token_lists(
            self.codec.tok.get_vocab_size(), self.codec.bos_id, seed=config.seed
        )
        self._canary_fn = jax.jit(
            lambda p, t, pos, seg, tgt: model.forward_logprobs(
                p, learner.model_cfg, t, pos, seg, tgt
            )
        )
        try:
            self._start()
        except BaseException:
            self.close(final=False)
            raise

    # -- startup ---------------------------------------------------------------------------
    def _start(self) -> None:
        config, wd, learner = self.config, self.workdir, self.learner
        db = os.path.join(wd, "controller.db")
        self.store = open_store(config, wd, learner.step)
        sampling = SamplingParams(
            temperature=float(_opt(config, "rollout.temperature", 1.0)),
            max_tokens=self.A,
            stop_token_ids=[self.codec.eos_id],
        )
        self.ctl = Controller(
            ControllerConfig(
                staleness=self.S,
                groups_per_step=self.g,
                group_size=self.n,
                vocab_size=learner.model_cfg.vocab_size,
                sampling=sampling,
                max_prompt_tokens=self.P,
                seed=config.seed,
                refuse_too_slow=config.controller.refuse_too_slow,
                retest_slow_after_s=config.controller.retest_slow_after_s,
            ),
            db,
            self.task,
        )
        if learner.cursor.get("rl"):
            back = self.ctl.restore_cursor(learner.cursor["rl"])
            logging.info("resumed the controller cursor (%d groups back in the buffer)", back)
        self.server = serve_controller(
            self.ctl,
            wd,
            ServerOptions(host=config.controller.host, port=config.controller.port),
            config.controller.token_file or None,
        )
        self.token_file = config.controller.token_file or os.path.join(wd, "join_token")
        logging.info("controller at %s", self.server.url)
        # Config + tokenizer beside the versions: a remote worker needs no local model copy.
        model_files.publish(self.store, learner.hf_dir)
        self.publish(learner.step)  # synchronous: workers need a first version to start
        if _opt(config, "bridge.async_publish", False):
            self.publisher = BackgroundPublisher(self.publish)
            self._snapshot = jax.jit(lambda p: jax.tree.map(jnp.copy, p))
        self.watcher = SwapWatcher(self.ctl, os.path.join(wd, SWAPS_FILE))
        if not self._evals().get("before"):
            self.evaluate(tag="before")
        specs = local_fleet.worker_specs(config.local_workers, fleet_config(config), config.seed)
        self.fleet = local_fleet.LocalFleet(
            specs,
            self.server.url,
            self.token_file,
            os.path.join(wd, "workers"),
            fleet_config(config),
        )
        self._prev_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, *_):
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        print("\nCtrl-C: finishing this step, then checkpointing (Ctrl-C again to abort)")

    # -- weights ---------------------------------------------------------------------------
    def canary(self, params) -> dict:
        toks = np.asarray(self._canary_tokens, np.int32)  # [B, T+1], all probes equal length
        seg = np.ones_like(toks[:, :-1])
        pos = np.broadcast_to(np.arange(toks.shape[1] - 1, dtype=np.int32), seg.shape)
        lps = np.asarray(self._canary_fn(params, toks[:, :-1], pos, seg, toks[:, 1:]))
        return canary_lib.canary_payload(self._canary_tokens, list(lps))

    def publish(self, version: int, params=None) -> float:
        """Write `version` (unless the store has it), announce it, gc; returns seconds.

        `params` defaults to the learner's current ones; the background publisher passes
        its own snapshot (the learner has moved on by then)."""
        t0 = time.perf_counter()
        if params is None:
            params = self.learner.state.params
        if version not in self.store.versions():
            publish.publish_params(
                self.store,
                version,
                version,
                self.learner.model_cfg,
                params,
                dtype=self.config.model.param_dtype,
                extra={"canary": self.canary(params)},
            )
        ann = self.ctl.publish(version, self.store.spec)
        if self.watcher is not None:
            self.watcher.published_at[version] = ann.published_at
        self.store.gc(keep=self.S + 2)
        return time.perf_counter() - t0

    # -- evaluation ------------------------------------------------------------------------
    def _evals(self) -> dict:
        out = {}
        path = os.path.join(self.workdir, EVAL_FILE)
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    row = json.loads(line)
                    out[row["tag"]] = row
        return out

    def evaluate(self, tag: str) -> float:
        t0 = time.perf_counter()
        acc = self.evaluator.accuracy(
            self.learner.state.params, self.learner.mesh, self.learner.rules
        )
        row = {"tag": tag, "step": self.learner.step, "accuracy": acc, "time": time.time()}
        with open(os.path.join(self.workdir, EVAL_FILE), "a") as f:
            f.write(json.dumps(row) + "\n")
        logging.info(
            "held-out accuracy %.3f at step %d (%s, %.2fs)",
            acc,
            row["step"],
            tag,
            time.perf_counter() - t0,
        )
        return acc

    # -- the stream ------------------------------------------------------------------------
    def __iter__(self):
        timeout_s = float(_opt(self.config, "rollout.wait_timeout_s", 900.0))
        while not self._stop_requested:
            step = self.learner.step
            t0, groups = time.monotonic(), None
            while groups is None:
                groups, stats = self.ctl.wait_batch(step, self.g, timeout_s=1.0)
                if self._stop_requested:
                    return
                if groups is None:
                    if self.fleet is not None:
                        self.fleet.check()
                    if time.monotonic() - t0 > timeout_s:
                        raise TimeoutError(
                            f"no batch for step {step} after {timeout_s:.0f}s: {stats}; "
                            f"see {self.workdir}/workers/"
                        )
            cursor = self.ctl.export_cursor()
            batch, rstats = rollout_batch.groups_to_batch(
                groups, self.n, self.P, self.A, step, self.adv_cfg, pad_id=self.codec.pad_id
            )
            fleet = {k: v for k, v in stats.items() if not k.startswith("policy_version")}
            fleet.update(rstats)
            yield batch, fleet, cursor

    def on_step(self, learner, metrics: dict) -> dict:
        step, out = learner.step, {"bridge/publish_s": 0.0, "time/wall": time.time()}
        if (step - self.rl_start) % self.kappa == 0:
            if self.publisher is None:
                out["bridge/publish_s"] = self.publish(step)
            else:
                t0 = time.perf_counter()
                self.publisher.submit(step, self._snapshot(learner.state.params))
                out["bridge/publish_blocking_s"] = time.perf_counter() - t0
                out["bridge/publish_s"] = self.publisher.last_s  # the newest one finished
                out["bridge/publish_skipped"] = self.publisher.skipped
        out["policy_version"] = self.ctl.announcement().version
        if step >= self.end or (
            self.eval_period and (step - self.rl_start) % self.eval_period == 0
        ):
            out["eval/accuracy"] = self.evaluate(tag="after" if step >= self.end else "rl")
        latest = learner.ckpt.latest_step()
        if latest is not None and latest != self._last_ckpt:
            # The checkpoint before the newest is surely durable (async saves).
            if self._last_ckpt is not None:
                self.ctl.forget_consumed(self._last_ckpt)
            self._last_ckpt = latest
        live = {**metrics, **out, "step": step, "learner/utilization": learner.utilization()}
        print(report.live_line(live, self.end), flush=True)
        return out

    # -- shutdown --------------------------------------------------------------------------
    def close(self, final: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._prev_sigint is not None:
            signal.signal(signal.SIGINT, self._prev_sigint)
        if self.publisher is not None:
            try:
                self.publisher.close(timeout=120)
            except PublishError as e:
                logging.error("%s", e)
        if self.fleet is not None:
            self.fleet.stop()
        if self.watcher is not None:
            self.watcher.stop()
        if self.server is not None:
            self.server.stop()
        if hasattr(self, "ctl"):
            self.ctl.close()
        if final:
            evals = self._evals()
            done = self.learner.step >= self.end
            last = evals.get("after" if done else "stop", {}).get("step")
            if last != self.learner.step and self.learner.step > self.rl_start:
                self.evaluate(tag="after" if done else "stop")
            path = report.write_report(self.workdir)
            print(f"report: {path}", flush=True)


def trajectory_items(learner) -> RLSource:
    """The controller-fed RL stream of `learner` (iterable, with `on_step` and `close`)."""
    return RLSource(learner)
