"""LoRA vs full-weight training and dissemination, side by side in one run (issue 28).

    python -m bench.lora --out=/tmp/lora.json [--rank=16] [--steps=5] [--swap]

Rows (arm = lora | full):
- bytes per version at Qwen3-0.6B shapes (computed from the shapes, both in bf16, the
  full versions' publish dtype) and on the tiny model (measured: manifests of versions
  published to a file store; adapters published in float32 there);
- learner step time (median of --steps jitted steps after compile) and learner memory
  (state bytes: params + optimizer state + the frozen base; XLA's compiled temp bytes) on
  a small Qwen3 (--layers, --hidden) on one CPU device;
- swap time on the real vLLM CPU engine (--swap): a new adapter version (verified store
  read + PEFT dir + add_lora + first request) vs a full version (verified store read +
  reload_weights + first request), medians of 3;
- parity: learner LoRA log-probs vs transformers + peft with the same adapter (1e-4).
- with --runs=LORA_WORKDIR,FULL_WORKDIR, two real demo runs (bench/lora_runs.py): held-out
  accuracy, median `bridge/version_bytes`, median swap time (publish -> worker serving it),
  median RL step time, RL wall time; rows `run_*`, headline `run_*`, and a side-by-side
  table. --demo_root=DIR runs them first (bench/lora_demo.py): the demo's SFT once, its
  export, then full RL and LoRA RL from that same policy, --rl_steps each.
Headline: bytes_ratio (adapter / full at Qwen3-0.6B, rank --rank), parity_ok, swap_vs_full,
step_time_ratio, state_bytes_ratio. The goal line (bytes_ratio <= 2%) is printed last.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from bridge.adapters import peft_layout  # noqa: E402
from bridge.model import layouts, presets, tiny_model  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "JSON output path", required=True)
_RANK = flags.DEFINE_integer("rank", 16, "LoRA rank")
_STEPS = flags.DEFINE_integer("steps", 5, "timed learner steps per arm")
_LAYERS = flags.DEFINE_integer("layers", 4, "layers of the learner-arm model")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "hidden size of the learner-arm model")
_SWAP = flags.DEFINE_bool("swap", True, "time swaps on the real vLLM engine")
_RUNS = flags.DEFINE_string(
    "runs", "", "LORA_WORKDIR,FULL_WORKDIR: two demo runs side by side (bench/lora_runs.py)"
)
_DEMO_ROOT = flags.DEFINE_string(
    "demo_root", "", "run the demo's SFT once, then full and LoRA RL from it (bench/lora_demo.py)"
)
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 2000, "--demo_root: SFT steps (the demo's)")
_RL_STEPS = flags.DEFINE_integer("rl_steps", 300, "--demo_root: RL steps of each arm (the demo's)")
_LORA_ARGS = flags.DEFINE_string("lora_args", "", "--demo_root: extra flags of the LoRA arm")
_ARM_ARGS = flags.DEFINE_string("arm_args", "", "--demo_root: extra flags of both arms")
_FLEET_EVAL_STEPS = flags.DEFINE_integer(
    "fleet_eval_steps", 20, "--demo_root: steps of a LoRA run with eval.on=fleet (0 = none)"
)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_params(cfg, rank: int) -> int:
    per_layer = 0
    for proj in TARGETS:
        ins, outs = peft_layout.kernel_shapes(cfg, proj)
        per_layer += rank * (int(np.prod(ins)) + int(np.prod(outs)))
    return per_layer * cfg.num_layers


def full_params(cfg) -> int:
    return sum(int(np.prod(r.hf_shape)) for r in layouts.table(cfg))


def learner_arm(cfg, lcfg, steps: int) -> dict:
    import jax

    from learner_jax import optim, sharding, train_state, train_step

    mesh = sharding.make_mesh({}, jax.devices()[:1])
    opt = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-4))
    _, shardings = train_state.state_shardings(cfg, opt, mesh, lora=lcfg)
    state = train_state.create_train_state(cfg, opt, mesh, lora=lcfg)
    step = train_step.jit_step(
        cfg, opt, train_step.StepConfig(kind="sft", lora=lcfg), mesh, shardings
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (8, 129))
    batch = train_step.put_batch(train_step.make_batch(tokens, np.ones_like(tokens)), mesh)
    with sharding.use_mesh(mesh):
        compiled = step.jitted.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    trained = sum(x.nbytes for x in jax.tree.leaves(state.params))
    state, _ = step(state, batch)  # warm
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return {
        "step_s": float(np.median(times)),
        "state_bytes": int(state_bytes),
        "trained_bytes": int(trained),
        "xla_temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
    }


def parity(tmp: str, rank: int) -> float:
    """max |learner - peft| of LoRA log-probs on the tiny model (random nonzero adapter)."""
    import torch
    from flax import traverse_util
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    from learner_jax import lora, model

    cfg = tiny_model.tiny_config("qwen3")
    path = os.path.join(tmp, "parity")
    tiny_model.make_tiny_model(path, cfg, 0)
    weights = tiny_model.random_hf_weights(cfg, 0, std=0.2)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    torch.manual_seed(0)
    pm = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), init_lora_weights=False
        ),
    )
    tensors = {k: v.detach().numpy() for k, v in get_peft_model_state_dict(pm).items()}
    adapters = traverse_util.unflatten_dict(peft_layout.from_peft(tensors, cfg))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, 24))
    with torch.no_grad():
        lp = torch.log_softmax(pm(input_ids=torch.tensor(ids)).logits, -1)[0]
    ref = np.asarray([float(lp[t, ids[0, t + 1]]) for t in range(23)])
    ours = model.forward_logprobs(
        lora.combine(layouts.hf_to_flax(cfg, weights), adapters),
        cfg,
        ids[:, :-1].astype(np.int32),
        np.arange(23, dtype=np.int32)[None],
        np.ones((1, 23), np.int32),
        ids[:, 1:].astype(np.int32),
        lora=lora.LoraConfig(rank=rank, alpha=2.0 * rank),
    )
    return float(np.abs(np.asarray(ours[0]) - ref).max())


def swap_arm(tmp: str, rank: int) -> dict:
    import jax
    import torch
    from flax import traverse_util

    from bridge.store.weight_store import WeightStore
    from bridge.weights import adapter_store
    from learner_jax import lora, lora_publish, model
    from rollout_gpu.adapters import AdapterServer, start_lora_engine
    from rollout_gpu.vllm_engine import VllmEngine

    cfg = tiny_model.tiny_config("qwen3")
    path = tiny_model.make_tiny_model(os.path.join(tmp, "swap"), cfg, 0)
    lcfg = lora.LoraConfig(rank=rank, alpha=2.0 * rank)
    shapes = jax.eval_shape(lambda: model._init_boxed(cfg, jax.random.key(0), np.float32, lcfg))
    _, ad = lora.split_params(
        jax.tree.map(lambda x: x.value, shapes, is_leaf=lambda x: hasattr(x, "names"))
    )
    rng = np.random.default_rng(0)
    spec = os.path.join(tmp, "store")
    astore, fstore = adapter_store.adapter_store(spec), WeightStore(spec)
    hf = tiny_model.random_hf_weights(cfg, 0)
    for v in range(1, 5):
        flat = {
            p: 0.01 * rng.standard_normal(x.shape).astype(np.float32)
            for p, x in traverse_util.flatten_dict(ad).items()
        }
        lora_publish.publish_adapter_version(
            astore, v, v, cfg, lcfg, traverse_util.unflatten_dict(flat)
        )
        fstore.publish(
            v, v, [(k, x + 0.001 * v) for k, x in hf.items()], cfg.to_hf_dict(), "float32"
        )
    prompt = [[1] + list(range(5, 20))]
    engine = start_lora_engine(path, max_loras=2, max_lora_rank=rank, max_model_len=128)
    server = AdapterServer(engine, astore, os.path.join(tmp, "cache"), keep=2)
    server.prompt_logprobs(1, prompt)  # compile / warm
    ad_t = []
    for v in (2, 3, 4):
        t0 = time.perf_counter()
        server.prompt_logprobs(v, prompt)
        ad_t.append(time.perf_counter() - t0)
    full = VllmEngine.start(path, dtype="float32", max_model_len=128)
    full.prompt_logprobs(prompt)
    full_t = []
    for v in (2, 3, 4):
        t0 = time.perf_counter()
        tensors = fstore.read_all(v)
        full.load_weights([(k, torch.from_numpy(x)) for k, x in tensors.items()])
        full.prompt_logprobs(prompt)
        full_t.append(time.perf_counter() - t0)
    return {
        "adapter_swap_s": float(np.median(ad_t)),
        "full_swap_s": float(np.median(full_t)),
        "adapter_version_bytes": astore.manifest(4).total_bytes,
        "full_version_bytes": fstore.manifest(4).total_bytes,
        "_engines": (engine, full),
    }


def main(argv):
    del argv
    from learner_jax import lora

    rank = _RANK.value
    runs = _RUNS.value.split(",") if _RUNS.value else None
    if _DEMO_ROOT.value:  # first: the slow part, and a failure here should not wait
        from bench import lora_demo

        runs = lora_demo.prepare(
            _DEMO_ROOT.value, _SFT_STEPS.value, _RL_STEPS.value, _LORA_ARGS.value,
            _ARM_ARGS.value, _FLEET_EVAL_STEPS.value,
        )  # fmt: skip
    q = presets.qwen3_0p6b()
    a, f = adapter_params(q, rank), full_params(q)
    rows = [
        {"arm": "lora", "what": "version_bytes_qwen3_0.6b_bf16", "value": 2 * a},
        {"arm": "full", "what": "version_bytes_qwen3_0.6b_bf16", "value": 2 * f},
    ]
    cfg = tiny_model.tiny_config(
        "qwen3",
        num_layers=_LAYERS.value,
        hidden_size=_HIDDEN.value,
        intermediate_size=2 * _HIDDEN.value,
    )
    arms = {
        "full": learner_arm(cfg, None, _STEPS.value),
        "lora": learner_arm(cfg, lora.LoraConfig(rank=rank, alpha=2.0 * rank), _STEPS.value),
    }
    for arm, r in arms.items():
        rows += [{"arm": arm, "what": k, "value": v} for k, v in r.items()]
    with tempfile.TemporaryDirectory() as tmp:
        err = parity(tmp, rank)
        rows.append({"arm": "lora", "what": "parity_max_abs_logp_diff", "value": err})
        swap = swap_arm(tmp, rank) if _SWAP.value else None
    if swap:
        swap.pop("_engines")
        rows += [
            {"arm": "lora" if k.startswith("adapter") else "full", "what": k, "value": v}
            for k, v in swap.items()
        ]
    if runs:
        from bench import lora_runs

        run_rows, run_head = lora_runs.rows(*runs)
        rows += run_rows
    headline = {
        "bytes_ratio": a / f,
        "parity_ok": err <= 1e-4,
        "swap_vs_full": swap["adapter_swap_s"] / swap["full_swap_s"] if swap else None,
        "step_time_ratio": arms["lora"]["step_s"] / arms["full"]["step_s"],
        "state_bytes_ratio": arms["lora"]["state_bytes"] / arms["full"]["state_bytes"],
        "trained_bytes_ratio": arms["lora"]["trained_bytes"] / arms["full"]["trained_bytes"],
        **(run_head if runs else {}),
    }
    print(f"{'arm':6s}{'what':42s}{'value':>16s}")
    for r in rows:
        v = r["value"]
        print(
            f"{r['arm']:6s}{r['what']:42s}{v:16.6g}"
            if isinstance(v, float)
            else f"{r['arm']:6s}{r['what']:42s}{v:16d}"
        )
    print(json.dumps(headline))
    if runs:
        stats = {arm: lora_runs.run_stats(d) for arm, d in zip(("lora", "full"), runs, strict=True)}
        print(lora_runs.table(stats))
    if _DEMO_ROOT.value and _FLEET_EVAL_STEPS.value > 0:
        fleet = lora_demo.fleet_eval_stats(os.path.join(_DEMO_ROOT.value, "lora_fleet_eval"))
        headline["lora_fleet_eval"] = fleet
        print(f"LoRA with eval.on=fleet: {json.dumps(fleet)}")
    with open(_OUT.value, "w") as fh:
        json.dump({"headline": headline, "rows": rows}, fh, indent=1)
    ok = "MET" if headline["bytes_ratio"] <= 0.02 else "NOT MET"
    print(
        f"goal: adapter bytes per version <= 2% of full at Qwen3-0.6B shapes, rank {rank}: "
        f"{100 * headline['bytes_ratio']:.2f}% ({2 * a / 1e6:.1f} MB vs {2 * f / 1e9:.2f} GB, "
        f"bf16) -> {ok}"
    )


if __name__ == "__main__":
    app.run(main)
