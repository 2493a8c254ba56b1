"""What the trust checks cost the learner (issue 23, must-show): the share of learner time
spent on verification, at Qwen3-0.6B shapes (hidden 1024, mlp 3072, 16 heads, 8 kv heads,
head_dim 128, tied) with the vocabulary and sequence length of a real run.

    python -m bench.verify_cost --out=/tmp/verify_cost.json \
        [--vocab=32768,151936 --seq_len=1024 --batch=4 --num_layers=2 --steps=3]

Per vocabulary size, on the same weights and batch:
  * the RL train step with the sampling check (`StepConfig.sampling_check`: per position
    Var_p[log p], one more pass over the [B, T, V] log-probs, and the per-row sums) and
    without, timed interleaved (on, off, on, off, ...; medians): `step_check_s`;
  * the audit's re-score (learner_jax/rl/rescore.py) of `--rescore_rows` rows of `seq_len`
    tokens under a version read back from a real weight store (every chunk's BLAKE3 checked
    against the manifest as it is read): `rescore_s`, of which `rescore_read_s` the
    verified read; the training binary runs it every `--rescore_every` steps
    (`controller.audit_rescore_every`), and on every step while some worker is unsettled
    (audit_focus.py), so both shares are given;
  * BLAKE3 over the bytes of one published version (the writer digests every chunk once
    per publish, every kappa steps; CRC-32 of the same bytes for comparison): `digest_s`.

share = check time / (step with checks + its part of the re-score + digest), per step with
kappa = 1. CPU numbers (this box: 2 shared cores) with few layers overstate the share of the
[B, T, V] checks relative to a 28-layer model, whose layers cost ~num_layers / 2 times
more: `step_off_per_layer_s` (from the two smallest layer counts, if given) extrapolates
the check's share to 28 layers. The step uses the learner's chunked head
(`--logprob_chunk`, `model.logprob_chunk`), as a real run at vocabulary 151k must.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
import zlib

import blake3
import jax
import numpy as np
from absl import app, flags

from bridge.control.protocol import Trajectory
from bridge.model.presets import qwen3_0p6b
from bridge.store.weight_store import WeightStore
from learner_jax import losses, model, optim, publish, sharding, train_state, train_step
from learner_jax.rl.rescore import VersionRescorer

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_list("vocab", ["32768", "151936"], "Vocabulary sizes.")
flags.DEFINE_list("num_layers", ["2"], "Decoder layer counts (two or more: per-layer fit).")
flags.DEFINE_integer("batch", 4, "Rows per train step.")
flags.DEFINE_integer("seq_len", 1024, "Tokens per row.")
flags.DEFINE_integer("logprob_chunk", 256, "Tokens per chunk of the head (0 = full logits).")
flags.DEFINE_integer("steps", 3, "Timed steps per arm (median) after one warm-up each.")
flags.DEFINE_integer("rescore_rows", 16, "Rows per re-score (controller.audit_rescore_rows).")
flags.DEFINE_integer("rescore_every", 10, "Steps between re-scores (audit_rescore_every).")
flags.DEFINE_string("store_dtype", "bfloat16", "Dtype of the published version.")
flags.DEFINE_integer("extrapolate_layers", 28, "Layer count to extrapolate the share to.")


def _batch(cfg, b: int, t: int, rng):
    tokens = rng.integers(3, cfg.vocab_size, (b, t + 1))
    loss_mask = np.zeros_like(tokens)
    loss_mask[:, t // 4 :] = 1  # a quarter prompt, the rest completion
    return train_step.make_batch(
        tokens,
        loss_mask,
        valid=np.ones_like(tokens, bool),
        behavior_logp=-12.0 + rng.standard_normal((b, t)),
        advantages=rng.standard_normal(b),
        on_policy=np.ones(b),  # every row audited, as on-policy rows are
    )


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def time_steps(cfg, mesh) -> dict:
    """Median train-step time with and without the sampling check, interleaved."""
    opt = optim.make_optimizer(
        optim.OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=100)
    )
    state = train_state.create_train_state(cfg, opt, mesh, seed=0)
    _, shardings = train_state.state_shardings(cfg, opt, mesh)
    base = train_step.StepConfig(
        kind="rl",
        loss=losses.LossConfig(name="grpo"),
        model_options=model.ModelOptions(logprob_chunk=FLAGS.logprob_chunk),
    )
    arms = {
        on: train_step.jit_step(
            cfg, opt, dataclasses.replace(base, sampling_check=on), mesh, shardings
        )
        for on in (True, False)
    }
    batch = train_step.put_batch(
        _batch(cfg, FLAGS.batch, FLAGS.seq_len, np.random.default_rng(0)), mesh
    )
    times: dict = {True: [], False: []}
    for i in range(FLAGS.steps + 1):  # the first round compiles
        for on, step in arms.items():
            (state, _), s = _timed(step, state, batch)
            if i:
                times[on].append(s)
    return {
        "step_check_s": statistics.median(times[True]),
        "step_nocheck_s": statistics.median(times[False]),
        "params": state.params,
    }


def time_rescore(cfg, params, workdir: str) -> dict:
    """One re-score of `rescore_rows` rows under a version published to a real store."""
    store = WeightStore(os.path.join(workdir, "store"))
    _, publish_s = _timed(publish.publish_params, store, 1, 1, cfg, params, FLAGS.store_dtype)
    rng = np.random.default_rng(1)
    t, p = FLAGS.seq_len, FLAGS.seq_len // 4
    trajs = [
        (
            "w",
            Trajectory(
                prompt_id="p",
                sample_index=i,
                prompt_token_ids=rng.integers(3, cfg.vocab_size, p).tolist(),
                completion_token_ids=rng.integers(3, cfg.vocab_size, t - p).tolist(),
                logprobs=[-12.0] * (t - p),
                versions=[1] * (t - p),
                finish_reason="length",
                reward=0.0,
            ),
        )  # fmt: skip
        for i in range(FLAGS.rescore_rows)
    ]
    rescorer = VersionRescorer(
        store, cfg, every=1, max_rows=FLAGS.rescore_rows,
        options=model.ModelOptions(logprob_chunk=FLAGS.logprob_chunk),
    )  # fmt: skip
    rescorer.rescore(1, trajs)  # compile
    _, read_s = _timed(rescorer.params, 1)
    _, total_s = _timed(rescorer.rescore, 1, trajs)
    # The digest's cost is per byte: the stored version's bytes (a bf16 version as 2-byte
    # elements), digested as the store does, one call per tensor's buffer.
    width = 2 if FLAGS.store_dtype == "bfloat16" else 4
    data = [np.ascontiguousarray(np.asarray(x).view(np.uint8)[:: 4 // width].copy())
            for x in jax.tree.leaves(jax.device_get(params))]  # fmt: skip
    t0 = time.perf_counter()
    for a in data:
        blake3.blake3(a).digest()
    digest_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in data:
        zlib.crc32(a)
    crc_s = time.perf_counter() - t0
    return {
        "rescore_s": total_s,
        "rescore_read_s": read_s,
        "publish_s": publish_s,
        "version_bytes": int(sum(a.nbytes for a in data)),
        "digest_s": digest_s,
        "crc32_s": crc_s,
    }


def measure(vocab: int, layers: int, mesh, workdir: str) -> dict:
    cfg = dataclasses.replace(qwen3_0p6b(layers), vocab_size=vocab)
    steps = time_steps(cfg, mesh)
    r = time_rescore(cfg, steps.pop("params"), workdir)
    on, off, every = steps["step_check_s"], steps["step_nocheck_s"], FLAGS.rescore_every
    check = max(on - off, 0.0)

    def share(rescore_per_step: float) -> float:
        verify = check + rescore_per_step + r["digest_s"]
        return verify / (on + rescore_per_step + r["digest_s"])

    return {
        "vocab": vocab,
        "num_layers": layers,
        **steps,
        "step_ratio": on / off,
        "sampling_check_s": check,
        **r,
        "share_sampled": share(r["rescore_s"] / every),  # settled fleet
        "share_focus": share(r["rescore_s"]),  # a re-score every step (unsettled workers)
    }


def extrapolate(rows: list[dict], layers: int) -> list[dict]:
    """Per vocabulary: step time linear in layers from the two smallest layer counts; the
    check and the head's re-score part held constant (they scale with B x T x V)."""
    out = []
    for vocab in sorted({r["vocab"] for r in rows}):
        of_v = sorted((r for r in rows if r["vocab"] == vocab), key=lambda r: r["num_layers"])
        if len(of_v) < 2:
            continue
        a, b = of_v[0], of_v[1]
        dl = b["num_layers"] - a["num_layers"]
        per_layer = (b["step_nocheck_s"] - a["step_nocheck_s"]) / dl
        rescore_per_layer = (b["rescore_s"] - a["rescore_s"]) / dl
        off = a["step_nocheck_s"] + per_layer * (layers - a["num_layers"])
        rescore = a["rescore_s"] + rescore_per_layer * (layers - a["num_layers"])
        check = statistics.mean([a["sampling_check_s"], b["sampling_check_s"]])
        digest = a["digest_s"] / a["version_bytes"] * (
            a["version_bytes"] + (b["version_bytes"] - a["version_bytes"]) / dl
            * (layers - a["num_layers"])
        )  # fmt: skip
        on = off + check
        out.append({
            "vocab": vocab, "num_layers": layers, "step_nocheck_s": off, "step_check_s": on,
            "rescore_s": rescore, "digest_s": digest, "step_off_per_layer_s": per_layer,
            "share_sampled": (check + rescore / FLAGS.rescore_every + digest)
            / (on + rescore / FLAGS.rescore_every + digest),
            "share_focus": (check + rescore + digest) / (on + rescore + digest),
        })  # fmt: skip
    return out


def main(argv):
    del argv
    mesh = sharding.make_mesh({"data": -1})
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for layers in (int(x) for x in FLAGS.num_layers):
            for vocab in (int(x) for x in FLAGS.vocab):
                rows.append(
                    measure(vocab, layers, mesh, os.path.join(workdir, f"{vocab}-{layers}"))
                )
                print(json.dumps(rows[-1]), flush=True)
    extra = extrapolate(rows, FLAGS.extrapolate_layers)
    cols = ["vocab", "num_layers", "step_check_s", "step_nocheck_s", "rescore_s", "digest_s",
            "share_sampled", "share_focus"]  # fmt: skip
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows + extra:
        print("  ".join(f"{r[c]:>14.4g}" if isinstance(r[c], float) else f"{r[c]:>14}"
                        for c in cols))  # fmt: skip
    result = {
        "measured": rows,
        "extrapolated": extra,
        "batch": FLAGS.batch,
        "seq_len": FLAGS.seq_len,
        "logprob_chunk": FLAGS.logprob_chunk,
        "rescore_rows": FLAGS.rescore_rows,
        "rescore_every": FLAGS.rescore_every,
        "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
        "load_average": os.getloadavg(),
    }
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
