"""Rollout worker: joins the controller, serves the newest policy version with a rollout
engine (`RolloutEngine`; the binary runs `VllmEngine`), and turns leased prompt groups
into version-tagged trajectories (the controller scores them; a worker never sees a
reference answer).

    python -m rollout_gpu.worker --controller=http://127.0.0.1:8470 \\
        --token_file=/tmp/run/join_token \\
        [--price_per_hour=2.5 --accelerator=H100-80GB --max_num_seqs=64 --region=us-east]

`--token_file` holds the join secret (the training binary writes <workdir>/join_token).
vLLM needs an HF directory (config.json + tokenizer) to start. By default the worker
downloads those few files from the announced weight store (bridge/store/model_files.py,
checksummed, cached in `--cache_dir`), starts vLLM on dummy weights and swaps the newest
version in through the verified path; `--model_dir=DIR` starts from a local directory
instead (and its weights, until the first swap).

Loop (`RolloutWorker.run`): join -> load the newest announced version -> take a lease ->
generate n samples per prompt from the leased prompt token ids with per-token log-probs
(rollout_gpu/generate.py) -> submit; swap weights between leases when a response
brings a newer version (after the loaded version's queued evaluation, `eval_pending`:
bridge/control/evaluation/eval_leases.py), so all tokens of a lease carry the version that
made them. With partial rollouts (the lease says `partial="continue"`, `rollout.partial`) the
worker also swaps mid-lease: before generating (a lease that waited asks the controller for
its newest version first, `_hear_news`), and whenever a newer version is ready while
it generates, continuing its unfinished samples under it (generate.py `continue_groups`);
each token carries the version that sampled it. While such a lease generates, the
controller holds the worker's heartbeats until a newer version is announced
(`ControllerSession.want_news`), so the worker hears of it when it is published.
The worker is composed of three owners: `ControllerSession` (rollout_gpu/session.py:
registration, retried calls, heartbeats, the stop state), `WeightVersions`
(rollout_gpu/versions.py: loaded, fetching, swap-ready and refused versions) and the engine.

Failure handling: an unreachable controller is retried and a 401 re-registers (see
session.py). A generation that fails, or a submission the controller refuses, is logged
and the lease released with the reason: the worker keeps going and never submits a
partial group. SIGTERM/SIGINT: take no new lease (checked before every lease request, so a
signal during warm-up or a swap is not answered with one), finish the current one if it
completes within `--grace_s`, else abort it and release it; then leave (the controller
requeues anything still held) and exit 0. The process ends within grace + 3 s whatever
the controller's state; a second signal ends it at once.

Lifecycle (rollout_gpu/lifecycle.py): the controller says "run over" when training ends
-> abort, leave, exit 0. It says standby (`active=false`) -> take no leases, heartbeats
only, until it says active again (`--on_standby=exit`: leave and exit 0, so the machine
can be released). It stops answering -> one log line, retries with capped exponential
backoff (`--max_backoff_s`), exit 3 after `--max_no_contact_s` without an answer. With
`--exit_with_parent` (the training binary's local workers) the worker stops as on SIGTERM
once the process that started it is gone, even if it was killed -9.
Exit status: 0 done, 2 refused by the controller, 3 no contact.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable

from absl import app, logging

from bridge.config.keys import SCHEMA
from bridge.control.http.client import ControllerClient, ControllerError
from bridge.control.protocol import EpisodeStep, Lease, LeaseRequest, Submission, WorkerProfile
from bridge.weights import kinds
from rollout_gpu import adapter_swap, lifecycle
from rollout_gpu import generate as gen
from rollout_gpu.engine import RolloutEngine
from rollout_gpu.session import ControllerSession, FatalError, Throughput, WorkerOptions
from rollout_gpu.versions import VersionState, WeightVersions

__all__ = ["FatalError", "RolloutWorker", "Throughput", "WorkerOptions"]

# Version news younger than this is taken as the controller's newest when a partial-rollout
# lease starts generating: a lease reply a moment ago named it (a lease generated at once
# asks nothing more), and a version published in that moment is swapped in mid-lease.
NEWS_FRESH_S = 0.5


class _EngineStarter:
    """How this worker builds its engine (bridge/weights/sides.py `EngineStarter`):
    `make_engine(model_dir)`, or `make_engine(model_dir, lora={...})` for adapters."""

    def __init__(self, make_engine: Callable, cache_dir: str):
        self.make_engine, self.cache_dir = make_engine, cache_dir

    def plain(self, model_dir: str) -> RolloutEngine:
        return self.make_engine(model_dir)

    def with_adapters(self, base) -> RolloutEngine:
        return adapter_swap.start(self.make_engine, base, self.cache_dir)


class RolloutWorker:
    def __init__(
        self,
        options: WorkerOptions,
        engine: RolloutEngine | None = None,
        make_engine: Callable[[str], RolloutEngine] | None = None,
    ):
        """`engine`: a running engine; or `make_engine(model_dir)`, called once the store's
        model files are known (a worker started without a local model directory)."""
        if (engine is None) == (make_engine is None):
            raise ValueError("pass exactly one of engine and make_engine")
        self.opts = options
        peers = None
        if options.relay:
            from rollout_gpu.peer_swap import PeerSwap

            peers = PeerSwap(
                options.relay_host,
                options.relay_port,
                options.relay_url,
                min_rate=options.peer_min_bytes_per_s,
            )
        self.versions = WeightVersions(peers)  # the one owner of loaded / fetching / swap
        self.session = ControllerSession(options, self.versions)
        self.engine, self._make_engine = engine, make_engine
        if engine is not None:
            gen.check_logprobs_mode(engine)
        self._last_said: str | None = None  # the last waiting condition logged
        self._warmed = False
        self.leases_done = 0
        self._eval_hold: int | None = None  # keep this version loaded: its eval is queued

    @property
    def version(self) -> int:
        return self.versions.loaded

    @property
    def stop(self):
        """Set by a SIGTERM (`request_stop`) or the run's end: take no new lease."""
        return self.session.stop

    def request_stop(self, *_) -> None:
        self.session.request_stop()

    # -- engine ----------------------------------------------------------------------------
    def start_engine(self) -> bool:
        """Builds the engine from the store's model files once a store is announced."""
        from bridge.store import model_files
        from bridge.store.weight_store import WeightStore

        if self.engine is not None:
            return True
        store = self.versions.announced.store
        if store is None:
            self._say_once("waiting for the learner's first version (it names the store)")
            return False
        try:
            weights = WeightStore(store)
            path = model_files.fetch(weights, self.opts.cache_dir)
            manifest = weights.manifest(self.versions.announced.version)
            recipe = kinds.strategy_of(manifest).engine_recipe(  # LoRA: its base, on disk
                weights, manifest, path, self.opts.cache_dir
            )
        except Exception as e:  # noqa: BLE001 - unreachable or bad store: keep retrying
            self._say_once(
                f"cannot take the model files from {store}: {type(e).__name__}: {e} (a "
                "learner's default <workdir>/weights store is readable only on its own "
                "machine: set bridge.store, or pass --model_dir)"
            )
            return False
        logging.info("starting the engine from the store's model files in %s", path)
        self.engine = recipe.start(_EngineStarter(self._make_engine, self.opts.cache_dir))
        gen.check_logprobs_mode(self.engine)
        return True

    def _say_once(self, message: str) -> None:
        """Logs a waiting condition when it changes, not at every retry."""
        if message != self._last_said:
            self._last_said = message
            logging.warning("%s", message)

    def warm_up(self) -> None:
        """One tiny generation before the first lease. vLLM's first sampling call with
        log-probs builds its sampler path (~18 s on these CPUs with processed log-probs),
        holding the GIL: the heartbeat thread could not renew the first lease, which then
        expired while its work was being generated."""
        if self._warmed:
            return
        self._warmed = True
        t0 = time.monotonic()
        self.engine.generate([gen.warm_up_request()])
        logging.info("engine warmed up in %.1fs", time.monotonic() - t0)

    # -- leases ----------------------------------------------------------------------------
    def take_lease(self) -> Lease | None:
        if self.stop.is_set():
            # Checked here, before every request, not only at the top of the loop: a SIGTERM
            # that lands during warm-up or a swap (seconds each) must not be answered with a
            # fresh lease.
            return None
        req = LeaseRequest(max_groups=self._max_groups(), **self.versions.lease_claims())
        try:
            r = self.session.call(ControllerClient.lease, req, until_stop=True)
        except lifecycle.ControllerGone:
            raise
        except ConnectionError:  # stopping while the controller is away: no new work anyway
            return None
        self.versions.hear(r)
        self._eval_hold = self.version if r.eval_pending else None
        if r.reason in ("run_over", "inactive"):
            self.session.standing.update(
                active=r.reason != "inactive", run_over=r.reason == "run_over"
            )
            return None
        if r.reason == "behind":  # no waiting: swap, or claim the fetch just started
            self.versions.behind(claimed_fetching=req.fetching_version >= 0)
        elif r.lease is None:
            self.stop.wait(max(r.retry_after_s, 0.05))
        return r.lease

    def _max_groups(self) -> int:
        # The controller caps it at max_concurrent_sequences // group_size.
        return min(4096, self.opts.profile.max_concurrent_sequences)

    def run_lease(self, lease: Lease) -> bool:
        """Generate and submit one lease; False if it was released instead."""
        session = self.session
        deadline = time.monotonic() + self.opts.throttle_s
        while time.monotonic() < deadline and not session.past_grace():
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        t0 = time.monotonic()
        session.active_sequences = sum(g.n for g in lease.groups)
        try:
            observe = lambda eps: session.call(  # a multi-turn lease's observations
                ControllerClient.episode, EpisodeStep(lease_id=lease.lease_id, episodes=eps)
            )
            if lease.partial == "continue":  # episodes too: a newer version between turns
                # A lease that waited starts on the newest version the controller has.
                self._hear_news()
                if self._newer_ready():
                    self._swap_newer()
                swaps = gen.Swaps(due=self._newer_ready, swap=self._swap_newer)
                session.want_news(True)  # held heartbeats: hear of versions as published
                try:
                    results = gen.continue_groups(
                        self.engine, lease.groups, self.version, swaps, self._abort, observe
                    )
                finally:
                    session.want_news(False)
            else:
                results = gen.generate_groups(
                    self.engine, lease.groups, self.version, self._abort, observe
                )
        except gen.GenerationAborted:
            return self.release(lease, "worker shutting down")
        except gen.GenerationError as e:
            logging.error("lease %s: %s", lease.lease_id, e)
            return self.release(lease, f"{type(e).__name__}: {e}")
        finally:
            session.active_sequences = 0
        trajs = [t for r in results for t in r.trajectories]
        # Generated tokens only: a multi-turn episode's observation tokens (mask 0) come
        # from the environment, and counting them overstated a poker worker's speed.
        tokens = sum(sum(t.mask) for t in trajs)
        session.meter.add(tokens, len(trajs))
        try:
            resp = session.call(
                ControllerClient.submit, Submission(lease_id=lease.lease_id, groups=results)
            )
        except ControllerError as e:
            logging.error("lease %s: submission refused: %s", lease.lease_id, e)
            return self.release(lease, f"submission refused: {e.detail}")
        except ConnectionError as e:  # gave up (past the grace period): the lease expires
            logging.error("lease %s: not submitted: %s", lease.lease_id, e)
            return False
        self.versions.hear(resp)  # its route too: the one for the version it announces
        self._eval_hold = self.version if resp.eval_pending else None
        self.leases_done += 1
        logging.info(
            "lease %d: %d groups, %d samples, %d tokens in %.2fs at version %d "
            "(accepted %d, duplicates %d)",
            self.leases_done,
            len(results),
            len(trajs),
            tokens,
            time.monotonic() - t0,
            self.version,
            len(resp.accepted),
            len(resp.duplicates),
        )
        return True

    def _hear_news(self) -> None:
        """Ask the controller for its newest version (a heartbeat) unless a reply said it
        within `NEWS_FRESH_S`. Version news otherwise comes only with heartbeats (seconds
        apart, further as the fleet grows) and lease replies: a lease that waited after its
        reply (a busy or throttled worker) was generated whole on the version it was leased
        at although the controller had published two newer ones meanwhile, and with S = 1
        it came back too stale to use, the drops `continue` exists to avoid. Without an
        answer it goes on with what it knows."""
        if self.versions.news_age() <= NEWS_FRESH_S:
            return
        try:
            self.session.heartbeat_once()
        except (ControllerError, ConnectionError) as e:
            logging.warning("no version news before generating: %s", e)

    def _newer_ready(self) -> bool:
        """A newer version can be loaded now, and no queued evaluation holds this one."""
        held = self._eval_hold is not None and self._eval_hold == self.version
        return not held and self.versions.state() is VersionState.SWAP_READY

    def _swap_newer(self) -> int:
        """Load the newest announced version mid-lease; the version served after it (the
        same one if the load was refused: `WeightVersions.ensure` logs why)."""
        self.versions.ensure(self.engine)
        return self.version

    def _abort(self) -> bool:
        """Stop generating: past the grace time, or the run is over (nobody wants it)."""
        return self.session.past_grace() or self.session.standing.run_over

    def release(self, lease: Lease, reason: str) -> bool:
        logging.info("releasing lease %s: %s", lease.lease_id, reason)
        try:
            self.session.call(
                ControllerClient.release,
                lease.lease_id,
                reason[:1000],
                patient=not self.stop.is_set(),
            )
        except (ControllerError, ConnectionError) as e:
            logging.warning("could not release lease %s (it will expire): %s", lease.lease_id, e)
        return False

    # -- main loop -------------------------------------------------------------------------
    def run(self) -> int:
        session = self.session
        session.join()
        session.start_heartbeats()
        try:
            while not self.stop.is_set():
                if self.opts.max_leases and self.leases_done >= self.opts.max_leases:
                    break
                session.contact.check()  # raises ControllerGone past the no-contact limit
                if not session.standing.active:
                    if self.opts.on_standby == "exit":
                        logging.info("on standby and --on_standby=exit: leaving, exit 0")
                        break
                    # Idle cheaply: no generation, no lease polling; the heartbeat thread
                    # flips `standing.active` back (or a signal sets `stop`).
                    self.stop.wait(0.5)
                    continue
                held = self._eval_hold is not None and self._eval_hold == self.version
                if not self.start_engine() or not (held or self.versions.ensure(self.engine)):
                    self.stop.wait(self.opts.backoff_s)
                    continue
                self.warm_up()
                lease = self.take_lease()
                if lease is not None:
                    self.run_lease(lease)
        finally:
            self.shutdown()
        return self.leases_done

    def shutdown(self) -> None:
        self.session.leave()
        logging.info("left after %d leases", self.leases_done)


# -- binary ----------------------------------------------------------------------------------
# Every flag's name, default and help is declared in bridge/config/keys.py: the `worker`
# section, and the fleet.* keys the training binary hands its local workers as flags.
_FLAGS = SCHEMA.define_flags()


def _flag(name: str):
    return _FLAGS[name].value


def main(argv):
    del argv
    with open(_flag("token_file")) as f:
        secret = f.read().strip()
    if not secret:
        raise app.UsageError(f"{_flag('token_file')} is empty")
    from rollout_gpu.vllm_engine import VllmEngine, configure_cpu_process, detect_accelerator

    accelerator = _flag("accelerator") or detect_accelerator()

    if accelerator == "cpu":
        configure_cpu_process(kvcache_gib=_flag("cpu_kvcache_gib"))

    seed = _flag("seed") if _flag("seed") is not None else random.randrange(1 << 31)

    def engine(model_dir: str, load_format: str = "auto", lora: dict | None = None):
        opts = dict(dtype=_flag("dtype"), max_model_len=_flag("max_model_len"), seed=seed)
        if lora is not None:  # a LoRA run's base (rollout_gpu/adapter_swap.py)
            from rollout_gpu.adapters import start_lora_engine

            return start_lora_engine(model_dir, max_num_seqs=_flag("max_num_seqs"), **lora, **opts)
        return VllmEngine.start(
            model_dir, max_num_seqs=_flag("max_num_seqs"), load_format=load_format, **opts
        )

    opts = WorkerOptions(
        controller=_flag("controller"),
        join_secret=secret,
        profile=WorkerProfile(
            accelerator=accelerator,
            price_per_hour=_flag("price_per_hour"),
            max_concurrent_sequences=_flag("max_num_seqs"),
            region=_flag("region"),
            name=_flag("name"),
            engine_dtype=_flag("dtype"),
        ),
        throttle_s=_flag("throttle_s"),
        max_leases=_flag("max_leases"),
        grace_s=_flag("grace_s"),
        tls_verify=_flag("tls_ca_file") or True,
        token_file=_flag("token_file"),
        cache_dir=_flag("cache_dir"),
        relay=_flag("relay"),
        relay_host=_flag("relay_host"),
        relay_port=_flag("relay_port"),
        relay_url=_flag("relay_url"),
        peer_min_bytes_per_s=_flag("peer_min_bytes_per_s"),
        max_no_contact_s=_flag("max_no_contact_s"),
        max_backoff_s=_flag("max_backoff_s"),
        on_standby=_flag("on_standby"),
    )
    if _flag("model_dir"):
        worker = RolloutWorker(opts, engine=engine(_flag("model_dir")))
    else:
        # The weights arrive by swap (dummy ones first); a LoRA base comes with its own.
        make = lambda path, lora=None: engine(path, "auto" if lora else "dummy", lora)  # noqa: E731
        worker = RolloutWorker(opts, make_engine=make)
    lifecycle.install_stop_signals(worker.request_stop, _flag("grace_s"))
    if _flag("exit_with_parent"):
        lifecycle.stop_when_parent_exits(os.getppid())
    try:
        worker.run()
    except FatalError as e:
        logging.error("%s", e)
        sys.exit(2)
    except lifecycle.ControllerGone as e:
        logging.error("%s", e)
        logging.flush()
        os._exit(lifecycle.EXIT_NO_CONTACT)
    except ConnectionError as e:  # stopped (SIGTERM) before it could join
        logging.error("%s", e)
        logging.flush()
        os._exit(0 if worker.stop.is_set() else 1)
    # The engine's teardown (vLLM's) can hang at interpreter exit; everything is flushed by now.
    logging.flush()
    os._exit(0)


def cli() -> None:
    """`echo2-worker` (pyproject's scripts): the same as `python -m rollout_gpu.worker`."""
    app.run(main)


if __name__ == "__main__":
    cli()
