"""What the trust checks cost: the share of learner time spent on verification, at
Qwen3-0.6B shapes (hidden 1024, mlp 3072, 16 heads, 8 kv heads,
head_dim 128, tied) with the vocabulary and sequence length of a real run.

    python -m bench.verify_cost --out=/tmp/verify_cost.json \
        [--vocab=32768,151936 --seq_len=1024 --batch=2 --num_layers=1,2 --steps=3]

Per vocabulary size and layer count, on the same weights and batch:
  * the RL train step of `--batch` rows with the sampling check (`StepConfig.sampling_check`:
    per position Var_p[log p], one more pass over the [B, T, V] log-probs, and the per-row
    sums) and without, interleaved (on, off, on, off, ...; medians): `step_check_s`,
    `step_nocheck_s`;
  * the audit's re-score (learner_jax/rl/rescore.py) under a version published to a real
    weight store by the learner's own publish path: `rescore_read_s` (the read, every
    chunk's BLAKE3 checked against the manifest) and `rescore_row_s` (the forward per row
    of `seq_len` tokens, from `--rescore_rows` rows);
  * the exact check (learner_jax/rl/exact_check.py) of the same rows under the same stored
    version: `exact_row_s` per row (the version read is cached after the first batch);
  * BLAKE3 over the bytes of one published version (the writer digests every chunk once per
    publish; CRC-32 of the same bytes for comparison): `digest_s`.

And in subprocesses with a real vLLM engine (skipped by `--engine=false`):
  * `python -m bench.sampler_cost`: the worker's tokens/s with the verifiable sampler over
    vLLM's own, same engine, interleaved (headline `sampler_tokens_per_s_ratio`, at the
    largest `--sampler_vocab`);
  * `python -m bench.honest_mismatch`: the share of an honest bf16 engine's tokens the exact
    check refuses against the fp32 learner (headline `honest_mismatch_rate`, peaked weights).

Then the share of a run's learner time spent on verification (`shares`): a step of
`--train_rows` rows (the measured step scaled by rows), the sampled re-score (`--versions`
version reads and `--audit_rows` rows each, every `--rescore_every` steps), the focus's
worst case (the same on every step: an unsettled worker with old rows of every version;
audit_focus.py), one version digested per step (kappa = 1; the publish runs on a background
thread in the binary, so this overstates). share = (sampling check + re-score + digest) /
(step with the check + re-score + digest); `share_exact` adds the exact check of every
consumed row (`--train_rows` x `exact_row_s` + one version read per step) to both sides.

Few layers overstate the share (the checks scale with B x T x V, the step also with the
layers): with two or more `--num_layers` the times are fitted linearly in the layer count
and extrapolated to `--extrapolate_layers` (28, Qwen3-0.6B). The step and the re-score use
the learner's chunked head (`--logprob_chunk`, `model.logprob_chunk`), as a real run at
vocabulary 151k must. CPU timings on a shared box are noisy: quote the load average too.
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

from bench import rl_step
from bridge.control.protocol import ConsumedGroup, Trajectory
from bridge.model.presets import qwen3_0p6b
from bridge.store.weight_store import WeightStore
from learner_jax import publish
from learner_jax.model import model, sharding
from learner_jax.rl.exact_check import ExactChecker
from learner_jax.rl.rescore import VersionRescorer
from learner_jax.training import losses, optim, train_state, train_step

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_list("vocab", ["32768", "151936"], "Vocabulary sizes.")
flags.DEFINE_list("num_layers", ["2"], "Decoder layer counts (two or more: per-layer fit).")
flags.DEFINE_integer("batch", 4, "Rows per train step.")
flags.DEFINE_integer("seq_len", 1024, "Tokens per row.")
flags.DEFINE_integer("logprob_chunk", 256, "Tokens per chunk of the head (0 = full logits).")
flags.DEFINE_integer("steps", 3, "Timed steps per arm (median) after one warm-up each.")
flags.DEFINE_integer("rescore_rows", 4, "Rows re-scored in the measurement.")
flags.DEFINE_integer("rescore_every", 10, "A run's audit_rescore_every.")
flags.DEFINE_integer("audit_rows", 16, "A run's audit_rescore_rows (rows per version).")
flags.DEFINE_integer("versions", 3, "Versions a re-score reads (every tag: up to S + 1).")
flags.DEFINE_integer("train_rows", 256, "Rows per learner step of the run (16 x 16).")
flags.DEFINE_string("store_dtype", "bfloat16", "Dtype of the published version.")
flags.DEFINE_integer("extrapolate_layers", 28, "Layer count to extrapolate the share to.")
flags.DEFINE_bool("engine", True, "Also run the vLLM benches (sampler cost, honest rate).")
flags.DEFINE_list("sampler_vocab", ["151936"], "Vocabularies of the sampler's cost.")


def _engine_bench(module: str, *args: str) -> dict:
    """The JSON a vLLM bench writes, run in its own process (an engine per process)."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        subprocess.run([sys.executable, "-m", module, f"--out={out}", *args], check=True)
        with open(out) as f:
            return json.load(f)


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
        # every row on-policy: audited, as on-policy rows are
        rl_step.random_batch(
            cfg, FLAGS.batch, FLAGS.seq_len, np.random.default_rng(0), np.ones(FLAGS.batch)
        ),
        mesh,
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
    # The exact check of the same rows (every consumed token, before the step trains): a
    # forward under the version plus the Gumbel argmax over the vocabulary per position.
    checker = ExactChecker(
        rescorer.params, cfg, temperature=1.0, rows_per_call=FLAGS.rescore_rows,
        chunk=FLAGS.logprob_chunk or 256,
        options=model.ModelOptions(logprob_chunk=FLAGS.logprob_chunk),
    )  # fmt: skip
    groups = [
        ConsumedGroup(group_id=i, prompt_id="p", prompt="", answer="", trajectories=[t],
                      worker_id=w, sampling_seed=12345)
        for i, (w, t) in enumerate(trajs)
    ]  # fmt: skip
    checker.check(groups)  # compile, and the version read (cached from here on)
    _, exact_s = _timed(checker.check, groups)
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
        "exact_row_s": exact_s / FLAGS.rescore_rows,
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
    row = {"vocab": vocab, "num_layers": layers, **steps, **r}
    row["step_ratio"] = row["step_check_s"] / row["step_nocheck_s"]
    row["rescore_row_s"] = (r["rescore_s"] - r["rescore_read_s"]) / FLAGS.rescore_rows
    return {**row, **shares(row)}


def shares(m: dict) -> dict:
    """A run's per-step costs from one measurement: a step of `--train_rows` rows (the
    measured step scaled by rows: the checks and the step are both per token); the sampled
    re-score reads `--versions` versions and scores `--audit_rows` rows of each every
    `--rescore_every` steps; the focus (worst case: an unsettled worker with old rows of
    every version) the same on every step; one version digested per step (kappa = 1)."""
    scale = FLAGS.train_rows / FLAGS.batch
    on, off = m["step_check_s"] * scale, m["step_nocheck_s"] * scale
    check = max(on - off, 0.0)
    one_rescore = FLAGS.versions * (m["rescore_read_s"] + FLAGS.audit_rows * m["rescore_row_s"])
    sampled, digest = one_rescore / FLAGS.rescore_every, m["digest_s"]

    def share(rescore: float, exact: float = 0.0) -> float:
        return (check + rescore + digest + exact) / (on + rescore + digest + exact)

    # every consumed row once, and each new version read once (kappa = 1)
    exact = FLAGS.train_rows * m["exact_row_s"] + m["rescore_read_s"]

    return {
        "run_step_check_s": on,
        "run_step_nocheck_s": off,
        "run_sampling_check_s": check,
        "run_rescore_sampled_s": sampled,
        "run_rescore_focus_s": one_rescore,
        "share_sampled": share(sampled),
        "share_focus": share(sampled + one_rescore),
        "run_exact_check_s": exact,
        "share_exact": share(sampled, exact),
    }


def extrapolate(rows: list[dict], layers: int) -> list[dict]:
    """Per vocabulary, to `layers` layers: the times linear in the layer count, fitted to
    the two smallest counts measured (the check itself scales with B x T x V, not layers)."""
    out = []
    for vocab in sorted({r["vocab"] for r in rows}):
        of_v = sorted((r for r in rows if r["vocab"] == vocab), key=lambda r: r["num_layers"])
        if len(of_v) < 2:
            continue
        a, b = of_v[0], of_v[1]
        k = (layers - a["num_layers"]) / (b["num_layers"] - a["num_layers"])
        keys = ("step_nocheck_s", "rescore_read_s", "rescore_row_s", "exact_row_s",
                "version_bytes")  # fmt: skip
        m = {key: a[key] + (b[key] - a[key]) * k for key in keys}
        per_byte = statistics.mean([x["digest_s"] / x["version_bytes"] for x in (a, b)])
        m["digest_s"] = per_byte * m["version_bytes"]  # the digest is per byte
        check = statistics.mean([a["step_check_s"] - a["step_nocheck_s"],
                                 b["step_check_s"] - b["step_nocheck_s"]])  # fmt: skip
        m["step_check_s"] = m["step_nocheck_s"] + max(check, 0.0)
        out.append({"vocab": vocab, "num_layers": layers, "extrapolated": True, **m, **shares(m)})
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
    cols = ["vocab", "num_layers", "step_check_s", "step_nocheck_s", "rescore_read_s",
            "rescore_row_s", "exact_row_s", "digest_s", "share_sampled", "share_focus",
            "share_exact"]  # fmt: skip
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows + extra:
        print("  ".join(f"{r[c]:>14.4g}" if isinstance(r[c], float) else f"{r[c]:>14}"
                        for c in cols))  # fmt: skip
    widest = max(rows + extra, key=lambda r: (r["vocab"], r["num_layers"]))
    headline = {"share_exact": widest["share_exact"], "share_sampled": widest["share_sampled"]}
    engine_rows = []
    if FLAGS.engine:
        sampler = _engine_bench("bench.sampler_cost", f"--vocab={','.join(FLAGS.sampler_vocab)}")
        honest = _engine_bench("bench.honest_mismatch", "--std=0.2", "--dtype=bfloat16")
        headline["sampler_tokens_per_s_ratio"] = sampler["headline"]["sampler_tokens_per_s_ratio"]
        headline["honest_mismatch_rate"] = honest["headline"]["honest_mismatch_rate"]
        engine_rows = [{"bench": "sampler_cost", **sampler}, {"bench": "honest_mismatch", **honest}]
    print(json.dumps(headline))
    result = {
        "headline": headline,
        "rows": rows + extra + engine_rows,
        "measured": rows,
        "extrapolated": extra,
        "batch": FLAGS.batch,
        "seq_len": FLAGS.seq_len,
        "logprob_chunk": FLAGS.logprob_chunk,
        "rescore_rows": FLAGS.rescore_rows,
        "run": {
            "train_rows": FLAGS.train_rows,
            "audit_rows": FLAGS.audit_rows,
            "versions": FLAGS.versions,
            "rescore_every": FLAGS.rescore_every,
        },
        "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
        "load_average": os.getloadavg(),
    }
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
