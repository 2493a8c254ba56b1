"""The RL phase across processes: process 0 drives, the others mirror its computations.

Process 0 alone hosts the controller, pulls batches from the fleet, and decides when to
publish, evaluate and checkpoint. Every jitted computation on the sharded state is a
collective that all processes must enter in the same order, so process 0 announces each
one as a command in JAX's coordination service (its key-value store, which every process
already talks to) before running it; the other processes run `follow`, executing the
commands in order:

    step     the receiving process's rows of the batch only (the rows its own devices
             hold), zero elsewhere: no process receives rows it does not train on
    publish  the version and whether to write it (canary forward + own shards, then the
             barriers of learner_jax/publish.py)
    eval     the held-out greedy decode (its result matters only on process 0)
    save     an orbax checkpoint (every process writes its own shards)
    end      the run is over

    leader = learner.mirror = mirror.Leader(learner)  # process 0; the publisher and the
                                                      # evaluation log take it too (mirror=)
    mirror.follow(learner, publish_fn, eval_fn)       # processes 1..P-1

A follower that loses process 0 does not wait forever: the coordination service's
heartbeat timeout terminates it (learner_jax/multihost/distributed.py).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable

import jax
import numpy as np

from learner_jax.training import train_step

PIECE_BYTES = 1 << 20  # the coordination service's gRPC messages stay well under 4 MiB
WAIT_MS = 24 * 3600 * 1000  # a follower waits as long as process 0 waits for rollouts
log = logging.getLogger(__name__)


def _client():
    from jax._src import distributed as _dist  # the client has no public accessor

    return _dist.global_state.client


def _encode(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    head = json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + buf.getvalue()


def _decode(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    n = int.from_bytes(data[:4], "big")
    header = json.loads(data[4 : 4 + n])
    with np.load(io.BytesIO(data[4 + n :])) as z:
        return header, {k: z[k] for k in z.files}


def process_rows(batch: train_step.Batch, learner) -> dict[int, np.ndarray]:
    """Global row indices each process's devices hold under the batch sharding."""
    shape = np.shape(batch.tokens)
    sharding = train_step.batch_sharding(learner.mesh, learner.rules)
    rows: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        rows.setdefault(device.process_index, set()).update(range(*index[0].indices(shape[0])))
    return {p: np.array(sorted(r), np.int64) for p, r in rows.items()}


class Channel:
    """An ordered stream of messages from process 0 to each other process."""

    def __init__(self, name: str = "rl"):
        self.name, self.seq = name, 0

    def send(self, process: int, data: bytes) -> None:
        client, key = _client(), f"{self.name}/{self.seq}/{process}"
        pieces = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)] or [b""]
        for i, piece in enumerate(pieces):
            client.key_value_set_bytes(f"{key}/{i}", piece)
        client.key_value_set(f"{key}/n", str(len(pieces)))  # last: the message is complete

    def next_seq(self) -> None:
        self.seq += 1

    def receive(self, process: int) -> bytes:
        client, key = _client(), f"{self.name}/{self.seq}/{process}"
        n = int(client.blocking_key_value_get(f"{key}/n", WAIT_MS))
        data = b"".join(
            client.blocking_key_value_get_bytes(f"{key}/{i}", WAIT_MS) for i in range(n)
        )
        for i in range(n):
            client.key_value_delete(f"{key}/{i}")
        client.key_value_delete(f"{key}/n")
        self.seq += 1
        return data


class Leader:
    """Process 0's side: announces each collective before running it (learner.mirror)."""

    def __init__(self, learner, channel: Channel | None = None):
        self.learner, self.channel = learner, channel or Channel()
        self.followers = [p for p in range(jax.process_count()) if p != jax.process_index()]

    def _broadcast(self, header: dict) -> None:
        data = _encode(header, {})
        for p in self.followers:
            self.channel.send(p, data)
        self.channel.next_seq()

    def step(self, batch: train_step.Batch) -> None:
        rows = process_rows(batch, self.learner)
        # Unset optional fields (`pack`: packing is single-process) are not sent.
        fields = {k: np.asarray(v) for k, v in vars(batch).items() if v is not None}
        for p in self.followers:
            mine = rows.get(p, np.zeros(0, np.int64))
            arrays = {k: v[mine] for k, v in fields.items()}
            arrays["_rows"] = mine
            shapes = {k: list(v.shape) for k, v in fields.items()}
            self.channel.send(p, _encode({"cmd": "step", "shapes": shapes}, arrays))
        self.channel.next_seq()

    def publish(self, version: int, write: bool, store_spec: dict) -> None:
        self._broadcast({"cmd": "publish", "version": version, "write": write, "spec": store_spec})

    def eval(self) -> None:
        self._broadcast({"cmd": "eval"})

    def save(self, force: bool) -> None:
        self._broadcast({"cmd": "save", "force": force})

    def end(self, error: str = "") -> None:
        """The run is over; `error` (process 0 failed) makes the followers fail too."""
        self._broadcast({"cmd": "end", "error": error})


def _global_batch(header: dict, arrays: dict[str, np.ndarray]) -> train_step.Batch:
    rows = arrays.pop("_rows")
    fields = {}
    for name, shape in header["shapes"].items():
        full = np.zeros(shape, arrays[name].dtype)  # rows this process does not hold stay 0
        full[rows] = arrays[name]
        fields[name] = full
    return train_step.Batch(**fields)


def follow(
    learner,
    publish_fn: Callable[[int, bool, dict], None],
    eval_fn: Callable[[], None],
    channel: Channel | None = None,
) -> int:
    """Processes 1..P-1: run process 0's commands until it ends the run; returns how many."""
    channel, me, done = channel or Channel(), jax.process_index(), 0
    while True:
        header, arrays = _decode(channel.receive(me))
        cmd, done = header["cmd"], done + 1
        if cmd == "step":
            learner.train_step(_global_batch(header, arrays))
        elif cmd == "publish":
            publish_fn(header["version"], header["write"], header["spec"])
        elif cmd == "eval":
            eval_fn()
        elif cmd == "save":
            learner.save(force=header["force"])
        elif cmd == "end":
            if header["error"]:
                raise RuntimeError(f"process 0 failed, so this run stops: {header['error']}")
            log.info("process %d: the run is over after %d commands", me, done)
            return done
        else:
            raise ValueError(f"unknown command {cmd!r} from process 0")
