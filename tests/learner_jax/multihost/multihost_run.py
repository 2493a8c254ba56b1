"""One learner process of the multi-host test (tests/learner_jax/multihost/multihost_test.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python tests/learner_jax/multihost/multihost_run.py \
        --workdir=W --batches=B.npz --out=O --num_processes=2 --process_id=0 --port=P

Runs the training binary's own `train.run` on RL batches built from real trajectories
(saved by the test as B.npz; a restarted run continues after its newest checkpoint), then
publishes the final params with the binary's `WeightPublisher` (canary included; each
process writes its own shards) and writes what the test compares: O.params.npz (process 0:
the params, gathered for the comparison only) and O.<process>.json (the chunks of each
array that lie inside this process's own devices' blocks). `--num_processes=1` is the
single-process reference run; `--pause_before=K` stalls this process before batch K (the
test then kills it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)


def _items(path: str, workdir: str, pause_before: int):
    """Batch i for RL step i + 1, from the newest checkpoint's step on (a resumed run)."""
    import time

    from learner_jax.training import train_step

    data = np.load(path)
    ckpts = os.path.join(workdir, "checkpoints")  # read lazily: after the learner restored
    done = max([int(d) for d in os.listdir(ckpts) if d.isdigit()] or [0])
    i = done
    while f"{i}/tokens" in data.files:
        if i == pause_before:  # this process stalls; the others block in the next step
            print(f"pausing before batch {i}", flush=True)
            time.sleep(600)
        fields = {k[len(f"{i}/") :]: data[k] for k in data.files if k.startswith(f"{i}/")}
        # The test waits for this line (not a sleep) before it kills the other process.
        print(f"taking batch {i}", flush=True)
        yield train_step.Batch(**fields), {"policy_version": i}, {"next": i + 1}
        i += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num_processes", type=int, default=1)
    p.add_argument("--process_id", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--die_after_init", action="store_true", help="exit 3 once connected")
    p.add_argument("--block_after_init", action="store_true", help="wait in a barrier")
    p.add_argument("--pause_before", type=int, default=-1, help="stall before this batch")
    p.add_argument("--hf_dir", default="")
    args = p.parse_args()

    import jax
    from jax.experimental import multihost_utils

    from bridge.contracts.prompt import TextCodec
    from learner_jax import config_file, run_config, train
    from learner_jax.multihost import distributed
    from learner_jax.rl import weights

    config = config_file.load_config(os.path.join(ROOT, "configs", "test_tiny.py"))
    config.sft.steps = 0
    config.total_steps = args.steps
    config.checkpoint.interval = 1
    config.checkpoint.async_save = False
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
    config.optimizer.warmup_steps = 0
    config.optimizer.learning_rate = 1e-2
    config.model.hf_dir = args.hf_dir
    # The test compares two runs' published bytes; their masters differ by float noise, which
    # a bf16 rounding (the auto publish dtype of a bf16-compute run) could turn into one ulp.
    config.bridge.publish_dtype = "float32"
    if args.num_processes > 1:
        config.distributed.coordinator_address = f"127.0.0.1:{args.port}"
        config.distributed.num_processes = args.num_processes
        config.distributed.process_id = args.process_id
        config.distributed.heartbeat_timeout_s = 5
    if args.die_after_init or args.block_after_init:
        distributed.initialize(run_config.distributed_config(config))
        print(f"process {jax.process_index()} connected", flush=True)
        # Every process has said so before process 0 dies (else process 1's error poll may
        # kill it before its print: the test reads that line).
        distributed.barrier("all_connected", timeout_s=300)
        if args.die_after_init:
            os._exit(3)
        distributed.barrier("never_reached", timeout_s=600)
        return

    items = _items(args.batches, args.workdir, args.pause_before)
    learner = train.run(config, args.workdir, items=items)
    params = learner.state.params
    # The binary's own publisher (canary included); every process publishes its shards.
    codec = TextCodec(learner.hf_dir)
    publisher = weights.WeightPublisher(
        weights.open_store("", args.workdir, learner.step),
        lambda version, spec: version,  # no controller to announce to here
        learner,
        every=1,
        keep=3,
        background=False,
        seed=config.seed,
        vocab_size=codec.tok.get_vocab_size(),
        bos_id=codec.bos_id,
    )
    publisher.publish(learner.step)
    store = publisher.store
    full = multihost_utils.process_allgather(params, tiled=True)  # for the comparison only
    out = {
        "process": jax.process_index(),
        "step": learner.step,
        "local": _local_chunks(store, learner.step, learner.model_cfg, params),
    }
    with open(f"{args.out}.{jax.process_index()}.json", "w") as f:
        json.dump(out, f)
    if distributed.is_leader():
        flat = {"/".join(k.key for k in path): np.asarray(v) for path, v in _leaves(full)}
        np.savez(f"{args.out}.params.npz", **flat)
    learner.close()


def _local_chunks(store, version, cfg, params) -> dict[str, list[list[int]]]:
    """Chunk positions of each HF array lying wholly inside a block this process's own
    devices hold (what it can write without receiving anyone's data)."""
    from bridge.model import layouts
    from bridge.store.chunk_digest import chunk_boxes

    manifest = store.manifest(version)
    out = {}
    for row in layouts.table(cfg):
        arr = layouts.get_leaf(params, row.flax_path)
        info = manifest.arrays[row.hf_name]
        boxes = []
        for index in arr.sharding.addressable_devices_indices_map(arr.shape).values():
            for hf_index, _ in row.transform.shard_pieces(index, arr.shape):
                boxes.append([(s.start, s.stop) for s in hf_index])
        out[row.hf_name] = [
            list(pos)
            for pos, cbox in chunk_boxes(info.shape, info.chunks)
            if any(
                all(lo <= clo and chi <= hi for (clo, chi), (lo, hi) in zip(cbox, b, strict=True))
                for b in boxes
            )
        ]
    return out


def _leaves(tree):
    import jax

    return jax.tree_util.tree_flatten_with_path(tree)[0]


if __name__ == "__main__":
    main()
