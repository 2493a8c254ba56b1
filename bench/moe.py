"""The MoE layer against a dense layer with the same active parameters, at Qwen3-30B-A3B's
layer shape, and the expert-sharded layer against the single-device one.

    python -m bench.moe --out=/tmp/moe.json [--tokens=256] [--steps=3]

Shapes: hidden 2048, 128 experts of width 768, 8 active a token (`presets.qwen3_30b_a3b`);
only the number of layers (one MLP block) and of tokens are reduced. Arms, each a jitted
forward + backward of the block (gradients of sum(y * dy) w.r.t. the input and every
parameter):
- `moe_blocks`: learner_jax/model/moe.py's SparseMoE with the block-scan grouped matmul
  (the CPU path of moe_matmul='auto');
- `moe_ragged_dot`: the same layer with jax.lax.ragged_dot (the GPU/TPU path; skipped on
  CPU, where JAX lowers it by masking every expert over every row: E x the FLOPs and an
  [E, rows, hidden] buffer);
- `dense_same_active`: a SwiGLU MLP of width k x 768 = 6144, i.e. each token meets the same
  number of parameters as in the MoE (the router's D x E aside).
Per arm: median step time over --steps runs after the compile, XLA's compiled memory
(arguments = parameters + input, temp = activations and workspace), analytic FLOPs.

ep_sharded_equals_single: the MoE block with its experts split over 8 devices (mesh
fsdp=8, learner_jax/model/sharding.py: whole experts per device) against one device,
--ep_tokens tokens: output and every gradient within 256 float32 ulps of their own scale
(tests/float_tolerance.py's criterion). On CPU it runs at a reduced width (hidden 256, 32
experts of width 96, still 8 active; `EP_CPU_SHAPE`): 8 virtual devices in one host's
memory cannot each hold the gathered 2.4 GB of a full-shape layer's experts; on an
accelerator backend it runs at the full shape.

Headline: moe_vs_dense_active_time (MoE step time / dense step time, same run; the
'auto' arm of this backend), ep_sharded_equals_single, and replay_kl_ratio: the mismatch
KL with replay / without of the end-to-end MoE run with a bf16 vLLM worker
(configs/qwen3_moe_shaped.py), read from its workdir with --e2e_workdir=DIR
(bench/moe_routing.py runs it); null without.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

# 8 virtual CPU devices for the expert-sharded arm (as the tests run); set before jax loads.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bridge.model import presets  # noqa: E402
from learner_jax.model import model, moe, sharding  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
ULPS = 256


# --shape=small (tests): 8 active of 32 experts at a width that runs in seconds; the
# bench's numbers are --shape=full.
SMALL_SHAPE = {"hidden_size": 256, "num_experts": 32, "moe_intermediate_size": 96}


def layer_config(shape: str = "full"):
    cfg = presets.qwen3_30b_a3b(num_layers=1)
    return cfg if shape == "full" else dataclasses.replace(cfg, **SMALL_SHAPE)


def dense_config(cfg):
    """A dense Qwen3 block whose MLP has the MoE's active width (k x I)."""
    return dataclasses.replace(
        cfg,
        family="qwen3",
        intermediate_size=cfg.num_experts_per_tok * cfg.moe_intermediate_size,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        norm_topk_prob=False,
        router_aux_loss_coef=0.0,
    )


def make_block(arm: str, cfg, block: int):
    if arm == "dense_same_active":
        return model.MLP(dense_config(cfg))
    impl = "blocks" if arm == "moe_blocks" else "ragged_dot"
    return moe.SparseMoE(cfg, matmul=impl, block=block)


def step_fn(module):
    def loss(params, x, dy):
        return (module.apply({"params": params}, x) * dy).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def inputs(cfg, tokens: int, rows: int = 1, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (rows, tokens // rows, cfg.hidden_size)
    return (
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
    )


def init(module, x):
    return jax.jit(lambda r: nn.unbox(module.init(r, x)["params"]))(jax.random.key(0))


def flops(arm: str, cfg, tokens: int) -> float:
    """Forward + backward (3x the forward) of the block's matmuls."""
    d = cfg.hidden_size
    if arm == "dense_same_active":
        fwd = 2 * tokens * 3 * d * cfg.num_experts_per_tok * cfg.moe_intermediate_size
    else:
        rows = tokens * cfg.num_experts_per_tok
        fwd = 2 * rows * 3 * d * cfg.moe_intermediate_size + 2 * tokens * d * cfg.num_experts
    return 3.0 * fwd


def time_arm(arm: str, cfg, tokens: int, steps: int, block: int) -> dict:
    module = make_block(arm, cfg, block)
    x, dy = inputs(cfg, tokens)
    params = init(module, x)
    fn = step_fn(module)
    compiled = fn.lower(params, x, dy).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready(fn(params, x, dy))  # warm
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, x, dy))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    f = flops(arm, cfg, tokens)
    return {
        "arm": arm,
        "tokens": tokens,
        "step_s": step_s,
        "gflops": f / 1e9,
        "gflops_per_s": f / step_s / 1e9,
        "param_bytes": int(sum(p.nbytes for p in jax.tree.leaves(params))),
        "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0)),
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
        "block": block if arm == "moe_blocks" else None,
    }


def close_at_scale(got, want) -> tuple[bool, float]:
    """(|got - want| <= 256 ulps of max |want|, the worst error in those ulps)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = EPS32 * max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max()) / scale
    return err <= ULPS, err


EP_CPU_SHAPE = SMALL_SHAPE


def ep_sharded_equals_single(cfg, tokens: int, block: int) -> dict:
    """The MoE block's output and gradients with experts split over 8 devices vs 1."""
    if jax.default_backend() == "cpu":
        cfg = dataclasses.replace(cfg, **EP_CPU_SHAPE)
    devices = jax.devices()
    if len(devices) < 8:
        return {"arm": "ep_sharded", "skipped": f"{len(devices)} devices < 8"}
    module = make_block("moe_blocks", cfg, block)
    x, dy = inputs(cfg, tokens, rows=8, seed=1)
    params = init(module, x)
    fn = step_fn(module)
    (y1, (g1, gx1)) = jax.device_get(fn(params, x, dy))

    mesh = sharding.make_mesh({"fsdp": 8}, devices[:8])
    rules = sharding.DEFAULT_RULES
    boxed = jax.eval_shape(lambda: module.init(jax.random.key(0), x)["params"])
    shardings = sharding.logical_shardings(boxed, mesh, rules)
    sharded = jax.device_put(params, shardings)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    with sharding.use_mesh(mesh, rules):
        out = fn(sharded, jax.device_put(x, rows), jax.device_put(dy, rows))
    experts = sharded["experts"]["gate_proj"]
    per_device = experts.sharding.shard_shape(experts.shape)[0]
    (y8, (g8, gx8)) = jax.device_get(out)
    checks = {"value": close_at_scale(y8, y1), "input_grad": close_at_scale(gx8, gx1)}
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(g8), jax.tree.leaves(g1), strict=True
    ):
        checks[jax.tree_util.keystr(path)] = close_at_scale(a, b)
    return {
        "arm": "ep_sharded",
        "tokens": tokens,
        "hidden": cfg.hidden_size,
        "experts": cfg.num_experts,
        "moe_intermediate": cfg.moe_intermediate_size,
        "devices": 8,
        "experts_per_device": int(per_device),
        "equal": all(ok for ok, _ in checks.values()),
        "worst_ulps": max(err for _, err in checks.values()),
    }


def auto_block(cfg, tokens: int) -> int:
    """The mean rows an expert gets, rounded up to a power of two in [8, 128]. On a CPU the
    block matmuls are bound by reading the expert's weights, so blocks about one expert's
    share (each expert read ~once) beat smaller ones with less padding: measured at hidden
    2048 / width 768, 8 of 32 experts, 16 rows an expert: block 16 2.2x the dense time,
    block 8 2.6x; 64 rows an expert: block 64 1.3x, block 16 1.5x, block 8 2.7x."""
    mean = tokens * cfg.num_experts_per_tok / cfg.num_experts
    return int(min(128, max(8, 2 ** int(np.ceil(np.log2(max(mean, 1)))))))


def run(tokens: int, steps: int, ep_tokens: int, block: int = 0, shape: str = "full") -> dict:
    cfg = layer_config(shape)
    block = block or auto_block(cfg, tokens)
    arms = ["dense_same_active", "moe_blocks"]
    if jax.default_backend() in ("gpu", "tpu"):
        arms.append("moe_ragged_dot")
    rows = [time_arm(arm, cfg, tokens, steps, block) for arm in arms]
    ep = ep_sharded_equals_single(cfg, ep_tokens, 8)
    rows.append(ep)
    by = {r["arm"]: r for r in rows}
    auto = "moe_ragged_dot" if "moe_ragged_dot" in by else "moe_blocks"
    headline = {
        "moe_vs_dense_active_time": by[auto]["step_s"] / by["dense_same_active"]["step_s"],
        "ep_sharded_equals_single": ep.get("equal"),
        # From the end-to-end MoE run (vLLM workers, replay on vs off), not this bench.
        "replay_kl_ratio": None,
    }
    return {
        "headline": headline,
        "rows": rows,
        "backend": jax.default_backend(),
        "shape": {
            "hidden": cfg.hidden_size,
            "experts": cfg.num_experts,
            "active": cfg.num_experts_per_tok,
            "moe_intermediate": cfg.moe_intermediate_size,
        },
    }


def table(result: dict) -> str:
    lines = [
        f"{'arm':<20}{'tokens':>7}{'step_s':>9}{'GFLOP':>8}{'GFLOP/s':>9}"
        f"{'params MB':>11}{'temp MB':>9}"
    ]
    for r in result["rows"]:
        if "step_s" not in r:
            continue
        lines.append(
            f"{r['arm']:<20}{r['tokens']:>7}{r['step_s']:>9.3f}{r['gflops']:>8.1f}"
            f"{r['gflops_per_s']:>9.1f}{r['param_bytes'] / 2**20:>11.1f}"
            f"{r['temp_bytes'] / 2**20:>9.1f}"
        )
    for r in result["rows"]:
        if r["arm"] == "ep_sharded" and "equal" in r:
            lines.append(
                f"experts over 8 devices ({r['experts_per_device']} each) == 1 device: "
                f"{r['equal']} (worst {r['worst_ulps']:.1f} ulps of scale, limit {ULPS})"
            )
    lines.append("headline: " + json.dumps(result["headline"]))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=256, help="tokens through the timed arms")
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm (median)")
    p.add_argument("--ep_tokens", type=int, default=64, help="tokens of the sharded check")
    p.add_argument("--block", type=int, default=0, help="rows per block (0 = auto_block)")
    p.add_argument("--shape", default="full", choices=("full", "small"))
    p.add_argument(
        "--e2e_workdir",
        default="",
        help="a configs/qwen3_moe_shaped.py run's workdir: its replay_kl_ratio "
        "(bench/moe_routing.py) goes into the headline",
    )
    a = p.parse_args(argv)
    result = run(a.tokens, a.steps, a.ep_tokens, a.block, a.shape)
    if a.e2e_workdir:
        from bench.moe_routing import replay_kl_ratio

        e2e = replay_kl_ratio(a.e2e_workdir)
        result["headline"]["replay_kl_ratio"] = e2e["replay_kl_ratio"]
        result["rows"].append({"arm": "e2e_replay", "workdir": a.e2e_workdir, **e2e})
    print(table(result))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
