"""Default config: tiny Qwen3 model, synthetic arithmetic task, local learner + workers.

Runs anywhere (one device, CPU is enough). Launch:

    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/echo2_demo

Override any key on the command line, e.g. a sharded run on 8 virtual CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/echo2_demo \
        --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2

The keys named in DESIGN.md ("Config keys") are contracts; the rest are ours.
"""

from ml_collections import ConfigDict, config_dict


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.seed = 0
    c.total_steps = 300  # RL learner steps (optimizer updates) after the SFT phase
    # S: a trajectory may lag the learner by at most S versions. Or "auto": the controller
    # moves S within [staleness_min, staleness_max] from the measured drops, the learner's
    # waits and the capacity model (bridge/control/auto_staleness.py; the rule is there).
    c.staleness = config_dict.FieldReference(2, field_type=object)  # an int, or "auto"
    c.staleness_min = 0  # only with staleness="auto"; must be >= publish_every - 1
    c.staleness_max = 4  # only with staleness="auto"; versions kept: staleness_max + 2
    c.publish_every = 1  # kappa: publish weights every kappa learner steps
    c.local_workers = 2  # rollout workers spawned on this machine; 0 = remote only

    c.model = ConfigDict()
    c.model.hf_dir = ""  # '' = build the tiny model into <workdir>/model
    c.model.tiny_family = "qwen3"  # used only when hf_dir is ''
    # 4 layers x 128 wide is the smallest shape we measured that learns 2-digit +/- (clean SFT:
    # 27% held-out at 1000 steps, 91% at 2000); 2 layers x 64 stalls near 15-20%.
    c.model.tiny_num_layers = 4
    c.model.tiny_hidden_size = 128
    c.model.tiny_intermediate_size = 256
    # The tiny model's tokenizer: "char" (one token per character) or "qwen3" (the real Qwen3
    # tokenizer format and chat template, bridge/model/qwen3_tokenizer.py). never_stop: an
    # untied head whose stop-token rows are zero, so random answers run to max_answer_len.
    c.model.tiny_tokenizer = "char"
    c.model.tiny_never_stop = False
    # Compute dtype. auto = bfloat16 for a real model (hf_dir set), float32 for the tiny one;
    # set float32 for bit-exact learner/worker parity checks on CPU.
    c.model.dtype = "auto"  # auto | float32 | bfloat16 | float16
    c.model.param_dtype = "float32"  # master weights; fp32 keeps small updates exact
    # auto = cuDNN flash on GPU where it applies, else blockwise online-softmax (memory linear
    # in T; equal to the reference within 1e-5 fp32). xla = the full [B, N, T, T] reference.
    c.model.attention = "auto"  # auto | xla | dot_product | blockwise (learner_jax/attention.py)
    c.model.remat = "none"  # none | full | a jax.checkpoint_policies name, per decoder layer
    # Tokens per chunk of the unembedding + log-softmax (learner_jax/logprobs.py); 0 = the full
    # [B, T, V] logits at once. At a real vocabulary (151,936) and long T use e.g. 1024: memory
    # O(chunk x V) instead of O(T x V), same numbers.
    c.model.logprob_chunk = 0

    # LoRA (learner_jax/lora.py): rank 0 = full-weight training; rank > 0 trains only
    # adapters on target_modules (q, k, v, o, gate, up, down) over a frozen base.
    c.learner = ConfigDict()
    c.learner.lora = ConfigDict()
    c.learner.lora.rank = 0
    c.learner.lora.alpha = 16.0
    c.learner.lora.target_modules = ("q", "k", "v", "o", "gate", "up", "down")
    c.learner.lora.dropout = 0.0

    c.mesh = ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    # Logical axis -> mesh axes: learner_jax/sharding.py DEFAULT_RULES unless a config sets
    # c.sharding_rules to its own tuple of (logical axis, mesh axes) pairs.

    # Several learner processes (learner_jax/distributed.py; README "Multi-host learner").
    # All unset = one process. The mesh above then spans every process's devices.
    c.distributed = ConfigDict()
    c.distributed.coordinator_address = ""  # host:port of process 0
    c.distributed.num_processes = 0
    c.distributed.process_id = -1
    c.distributed.auto = False  # JAX detects SLURM / Open MPI / TPU pod slices itself
    c.distributed.heartbeat_timeout_s = 20  # a dead peer stops the others after this
    c.distributed.initialization_timeout_s = 300
    c.distributed.cpu_collectives = "gloo"  # cross-process collectives of CPU computations

    c.optimizer = ConfigDict()  # learner_jax/optim.py: clip -> AdamW, warmup + cosine
    # RL peak lr; decays to end_lr_fraction at total_steps. On the 4 x 128 policy 1e-4 takes
    # held-out accuracy from 6.5% to 100% in ~120 steps (BUILD_NOTES.md, "Demo").
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 20
    c.optimizer.end_lr_fraction = 0.1
    c.optimizer.weight_decay = 0.0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.99
    c.optimizer.eps = 1e-8
    c.optimizer.max_grad_norm = 1.0  # 0 = no clipping

    c.loss = ConfigDict()  # learner_jax/losses.py LossConfig; name picks from the registry
    c.loss.name = "grpo"  # grpo | dr_grpo | dapo | gspo
    c.loss.clip_eps = 0.2
    c.loss.clip_eps_high = 0.28  # clip-higher (DAPO); None = symmetric
    c.loss.is_mode = "truncate"  # off-policy weight: truncate | mask | none
    c.loss.is_cap = 2.0
    # Off-policy correction, overrides is_mode when set: none | tis | mask | token_mis
    # (IcePop) | seq_mis | geo_seq (learner_jax/losses.py docstring); is_cap is its c.
    c.loss.off_policy = config_dict.placeholder(str)
    c.loss.kl_coef = 0.0  # beta of the KL penalty to the RL start's policy (reference_policy.py)
    c.loss.kl_end_fraction = 1.0  # beta's cosine schedule ends at kl_coef * this (1: constant)
    # k3 times the ratio pi / pi_prox, with gradient (TRL's use_bias_correction_kl): the KL
    # gradient becomes that of KL(pi || ref) (learner_jax/losses.py docstring).
    c.loss.kl_bias_correction = False
    # Entropy bonus: loss -= entropy_coef * mean full-vocabulary entropy at the sampled
    # tokens (learner_jax/losses.py); keeps exploration alive (configs/kuhn_poker.py).
    c.loss.entropy_coef = 0.0
    c.loss.dr_grpo_constant = config_dict.placeholder(float)  # None = padded answer length

    c.advantages = ConfigDict()
    c.advantages.name = "grpo"  # grpo | dr_grpo (learner_jax/advantages.py)
    c.advantages.filter_equal_groups = False  # DAPO: drop groups whose rewards are all equal

    c.batch = ConfigDict()
    c.batch.groups_per_step = 16  # prompts per learner step
    c.batch.samples_per_group = 16  # n: samples per prompt (more samples = steadier GRPO)
    c.batch.micro_batch_size = 64  # rows per forward/backward; must divide the global batch
    c.batch.max_prompt_len = 16  # BOS + "99-99=" fits with room to spare
    c.batch.max_answer_len = 8  # sampled completion tokens (answers are <= 4 with EOS)
    # Sequence packing (learner_jax/packing.py): rows of pack_len tokens (0 = the row width
    # max_prompt_len + max_answer_len) hold several sequences, so a step's memory follows
    # its real tokens, not rows x the longest; losses are unchanged.
    c.batch.packing = False
    c.batch.pack_len = 0

    c.task = ConfigDict()
    c.task.name = "arithmetic"
    c.task.digits = 2
    c.task.ops = "+-"
    c.task.sft_label_noise = (
        0.7  # the SFT teacher overshoots by one this often (bridge/tasks/registry.py)
    )
    c.task.format_reward = 0.0  # reward for a wrong answer that at least starts with a number
    c.task.eval_every = 10  # held-out split: 1 problem in eval_every is never trained on
    c.task.eval_size = 200
    # Bring your own reward (verl's compute_score convention, bridge/tasks/user_reward.py):
    # "PATH.py:NAME" replaces the task's reward wherever rewards are computed; "" = the task's.
    c.task.reward_fn = ""
    # The run's prompt format and held-out benchmark, not options of the task itself
    # (learner_jax/train.py make_task): present so `--config.task.thinking=on` and
    # `--config.task.eval_file=F` work on the locked config.
    c.task.thinking = "auto"  # auto | on | off: the chat template's enable_thinking
    c.task.eval_file = ""  # benchmark JSONL/Parquet to evaluate on (bridge/tasks/eval_file.py)

    c.checkpoint = ConfigDict()
    c.checkpoint.interval = 20  # steps between saves (SFT and RL steps count alike)
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True

    # SFT warm start: 2000 steps x 64 pairs (~3 min CPU) from a sloppy teacher that answers
    # one too high 70% of the time (task.sft_label_noise). The policy learns the arithmetic
    # and the habit: greedy held-out accuracy 6.5%, while it samples the right answer ~25% of
    # the time. With clean labels (sft_label_noise=0) the same SFT alone reaches ~90%, which
    # leaves RL nothing to show; the sloppy teacher is the demo's stand-in for imperfect
    # demonstrations that RL against an exact verifier corrects.
    c.sft = ConfigDict()
    c.sft.steps = 2000  # 0 = no SFT warm start
    c.sft.learning_rate = 1e-3
    c.sft.end_lr_fraction = 1.0  # constant after warmup
    c.sft.warmup_steps = 10
    c.sft.batch_size = 64
    c.sft.micro_batch_size = 64

    # How a task's prompt text becomes prompt tokens (bridge/contracts/prompt.py), the same on
    # the controller, the learner and every worker: "plain" = BOS + text (what the tiny char
    # models know); "chat" = the tokenizer's chat template with one user turn. '' = the task's
    # own choice (Task.prompt_format; plain for the built-in tasks).
    c.prompt = ConfigDict()
    c.prompt.format = ""  # '' | plain | chat
    c.prompt.system = ""  # chat: a system message ('' = none)
    c.prompt.thinking = ""  # chat: '' (the template's default) | on | off (Qwen3 enable_thinking)

    c.rollout = ConfigDict()  # learner_jax/rl/ (serve.py, evals.py, batches.py)
    # Sampling temperature. Workers report vLLM's processed log-probs (the tempered softmax
    # they sampled from) and the learner divides its logits by the same temperature, so any
    # T > 0 is on-policy (learner_jax/truncation.py check_rollout).
    c.rollout.temperature = 1.0
    # Truncated sampling (vLLM's order: logits / T, min-p, top-k, top-p). Workers report the
    # processed log-probs and the learner scores under the same truncation
    # (learner_jax/truncation.py), so these are on-policy too.
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1  # -1 (or 0) = off
    c.rollout.min_p = 0.0
    c.rollout.eval_period = 10  # RL steps between held-out evaluations (0 = start and end)
    # Held-out evaluation: on the learner (its own decoder, KV cache) or on the fleet (eval
    # leases of exactly the version evaluated, learner_jax/rl/fleet_eval.py; the learner
    # does not wait): eval.n samples per prompt at eval.temperature (0 = greedy).
    c.eval = ConfigDict()
    c.eval.on = "learner"  # learner | fleet
    c.eval.n = 4
    c.eval.temperature = 0.0
    c.eval.audit = True  # fleet: re-score a sample of each evaluation's rows (the audit)
    # fleet: at the run's end, wait this long for the evaluations still pending (the last
    # step's version) before the workers are sent home; past it, a warning names them.
    c.eval.final_wait_s = 120.0
    c.rollout.wait_timeout_s = 900.0  # no batch for this long = the fleet is broken: stop

    # The binary's own fleet (learner_jax/local_fleet.py, learner_jax/rl/fleet.py): started
    # and released through a provisioner (bridge/fleet/), every start/stop logged with its
    # reason and cost in <workdir>/provisioner.jsonl. A dead worker is replaced; one kind
    # dying max_deaths times within death_window_s (a broken install) fails the run. With
    # controller.activation on, standby workers are released and one is added when short.
    c.fleet = ConfigDict()
    c.fleet.provisioner = "local"  # "local": processes here | "command": the templates below
    # skypilot: rented workers, one SkyPilot cluster each, from a profiles JSON (accelerator,
    # count, use_spot, cloud/region, price cap; configs/fleets/skypilot_l4_a100.json);
    # local_workers = the profiles' total count. README "Renting a fleet".
    c.fleet.skypilot_fleet = ""
    # local: worker i takes prices[i % n], throttle_s[i % n], so the default pair is a fast
    # $0.40/h worker and a slow (throttled) $0.15/h one.
    c.fleet.prices = (0.40, 0.15)
    c.fleet.throttle_s = (0.0, 0.5)
    c.fleet.max_num_seqs = 64
    c.fleet.threads = 1  # torch/OpenMP threads per worker on a shared CPU box
    # local: CPU ids the workers are pinned to, e.g. (1,) with the learner under
    # `taskset -c 0` (empty: not pinned); keeps the learner's step time steady on a small box.
    c.fleet.worker_cpus = ()
    c.fleet.kvcache_gib = 1
    # command: local_workers workers from shell templates with {url} {token_file} {secret}
    # {name} {workdir} (and {pid} in stop/status); pass {name} on as the worker's --name.
    # See bridge/fleet/command.py for a gcloud example.
    c.fleet.start_command = ""
    c.fleet.stop_command = ""
    c.fleet.status_command = ""  # optional: exit 0 = alive
    c.fleet.price_per_hour = 0.0  # command: $/h of one started worker
    c.fleet.max_workers = 0  # at most this many at once (0 = local_workers)
    c.fleet.max_usd_per_hour = 0.0  # at most this hourly price at once (0 = no limit)
    c.fleet.max_deaths = 3
    c.fleet.death_window_s = 120.0
    c.fleet.follow_period_s = 5.0  # how often the fleet is compared with the controller
    # A worker the controller refuses as too slow (controller.refuse_too_slow) for this long
    # is released (learner_jax/rl/fleet.py; longer than controller.retest_slow_after_s, so it
    # was re-measured once after its cold first lease; inf = never).
    c.fleet.standby_release_s = 90.0
    # Engines' prompt + answer limit (the worker's --max_model_len default); raised to
    # batch.max_prompt_len + batch.max_answer_len when that is longer.
    c.fleet.max_model_len = 512
    # SIGTERM -> kill: a stopped worker finishes or releases its lease within this (the
    # worker's --grace_s default).
    c.fleet.grace_s = 30.0

    c.bridge = ConfigDict()
    # Weight store the learner publishes to and workers read (bridge/store/weight_store.py): a path,
    # s3://bucket/path, gs://bucket/path, or a tensorstore kvstore spec as JSON (e.g. an S3
    # endpoint). '' = <workdir>/weights, which only workers on this machine can read.
    c.bridge.store = ""
    # Publish from a background thread (learner_jax/background_publish.py): the learner runs
    # the next step while the previous version is written and announced.
    c.bridge.async_publish = True
    # Weight broadcast (bridge/broadcast/): "chain" / "tree" = workers relay verified chunks to
    # each other, so the store's uplink carries one copy per version whatever the fleet size
    # (a remote worker's default loopback relay URL is replaced by the address it calls from;
    # behind NAT give it --relay_url); "store" = every worker reads the store; "auto" = store
    # for a store on this machine (the workdir's: a relay hop only adds latency there), chain
    # for a remote one (s3://, gs://), where the store's uplink is the bottleneck.
    c.bridge.broadcast = "auto"
    c.bridge.broadcast_fanout = 2  # tree fan-out
    # Delta versions (bridge/delta/): publish each version as the elements whose stored bytes
    # changed since the previous one (a few % of a bf16 model per RL step), a full anchor
    # every anchor_every versions; a tensor with more than max_density of its elements
    # changed is stored whole. enabled: "auto" = on for a remote store (s3://, gs://), where
    # the links are slow; "true" / "false".
    # dtype of the stored versions: "auto" = the compute dtype (model.dtype), so a bf16 run
    # ships bf16 (half the bytes of the fp32 master weights, and deltas stay sparse).
    c.bridge.publish_dtype = "auto"
    c.bridge.delta = ConfigDict()
    c.bridge.delta.enabled = "auto"
    c.bridge.delta.anchor_every = 16
    c.bridge.delta.max_density = 0.5

    c.controller = ConfigDict()
    c.controller.host = "127.0.0.1"
    c.controller.port = 0  # 0 = any free port
    c.controller.token_file = ""  # '' = generate <workdir>/join_token (mode 0600)
    # Freshness-aware leasing (bridge/control/lease_timing.py): a worker whose measured lease
    # latency exceeds the time its work stays fresh gets no leases (its output would be
    # dropped as stale); it is measured again every retest_slow_after_s.
    c.controller.refuse_too_slow = True
    c.controller.retest_slow_after_s = 60.0
    c.controller.reward_timeout_s = 5.0  # per completion, scored on the trusted side
    # Cost-aware activation (bridge/control/fleet_plan.py): only the cheapest set of workers
    # whose measured throughput covers (1 + margin) * R / T gets leases; the rest stand by,
    # billed at standby_price_fraction of their price (0 = released).
    c.controller.activation = False
    c.controller.activation_margin = 0.1
    c.controller.activation_period_s = 30.0
    c.controller.standby_price_fraction = 0.0
    # Abuse limits (bridge/control/limits.py; 0 turns one off): per worker and endpoint,
    # registrations per client IP, leases per worker, token lifetime after the last contact,
    # and how long a rotated-out join secret still works (rewrite controller.token_file).
    c.controller.rate_limit_per_s = 20.0
    c.controller.rate_limit_burst = 60.0
    c.controller.register_rate_per_s = 1.0
    c.controller.register_burst = 64.0
    # Per registering identity, a credential or a remote host (bridge/control/identity.py;
    # the operator's own machine is exempt): registrations at once, then per second, and a
    # remote host's live workers at a time (a credential holds one).
    c.controller.register_identity_burst = 4.0
    c.controller.register_identity_rate_per_s = 0.05
    c.controller.max_live_workers_per_address = 8
    c.controller.max_leases_per_worker = 4
    # Environment replays per worker (POST /v1/episode, bridge/control/episode_steps.py):
    # sustained per second and at once; past them a worker is answered 429 and waits.
    c.controller.episode_replays_per_s = 1000.0
    c.controller.episode_replay_burst = 4096.0
    c.controller.token_ttl_s = 900.0
    c.controller.join_secret_grace_s = 600.0
    # Fleet-scale pacing (docs/design/lease-path.md): the heartbeat interval handed out is
    # live workers / heartbeat_budget_per_s (within [5 s, worker_timeout_s / 3]); workers
    # refused because the admission window is full ask again within idle workers /
    # lease_retry_budget_per_s (bridge/control/refusal_pacing.py). Load then grows with
    # work, not with idle workers.
    c.controller.heartbeat_budget_per_s = 50.0
    c.controller.lease_retry_budget_per_s = 100.0
    # Behaviour log-prob audit (bridge/control/audit.py): besides the rows the learner's own
    # version sampled (every step), every audit_rescore_every RL steps up to
    # audit_rescore_rows rows of one older version are re-scored under that version read
    # back from the store (learner_jax/rl/rescore.py; 0 = off: it costs a version read and
    # transiently a second copy of the params).
    c.controller.audit_rescore_every = 10
    c.controller.audit_rescore_rows = 16
    # ... and, on every step, up to audit_rescore_rows rows per version of each worker not
    # yet judged (fewer than audit_min_tokens audited tokens, or a sampling Z past half the
    # threshold: learner_jax/rl/audit_focus.py), so a new worker is judged within a few of
    # its groups; False = the sampled re-score alone.
    c.controller.audit_focus = True
    # Sampling check (bridge/contracts/sampling_check.py): a worker whose audited tokens'
    # likelihood under the policy is |Z| past this did not sample them (greedy, best-of-n,
    # a reference answer with true log-probs): quarantined. 0 = off.
    c.controller.audit_sampling_z = 6.0
    # The same on the likely-token side at any token count (a picker with one-token answers
    # would last audit_min_tokens / 4 groups): a CUSUM of per-token log likelihood ratios
    # quarantines past this (23 = ln 1e10: an honest sampler's mean audit stats before a
    # false alarm >= 1e10). 0 = off.
    c.controller.audit_sampling_evidence = 23.0
    # Exact check (bridge/contracts/exact_check.py): every lease carries a fresh sampling
    # seed, workers sample by seeded Gumbel-max, and the learner recomputes every consumed
    # token under its version before it trains: a group with a token that is not the
    # sampler's choice (its gap past exact_margin + exact_margin_rel x max |logit|, the
    # slack a bf16 engine's numerics need) never trains. An identity with
    # exact_quarantine_tokens such tokens that are also exact_quarantine_fraction of its
    # checked tokens (or exact_flip_tokens near-tie flips that are exact_flip_fraction of
    # them) is quarantined (0 tokens = never).
    c.controller.exact_check = True
    c.controller.exact_margin = 0.02
    c.controller.exact_margin_rel = 0.08
    c.controller.exact_quarantine_tokens = 8
    c.controller.exact_quarantine_fraction = 0.01
    c.controller.exact_flip_tokens = 32
    c.controller.exact_flip_fraction = 0.05
    # Transport: serve HTTPS with this PEM certificate and key ('' = plain HTTP). Over plain
    # HTTP anyone on the path can rewrite the announced store URL, so workers calling from
    # a non-loopback address are refused (403) unless allow_plain_http (a trusted LAN only).
    # Workers trust a self-signed certificate with --tls_ca_file=CERT.
    c.controller.tls_cert = ""
    c.controller.tls_key = ""
    c.controller.allow_plain_http = False
    # Peers are sent to a worker's relay at the address it called the controller from (never
    # to another host it names: bridge/broadcast/relay_address.py), except these
    # comma-separated host names or IPs (a NAT's public name), kept as the worker gives them.
    c.controller.relay_hosts = ""
    # Comma-separated addresses or CIDRs of reverse proxies in front of the controller whose
    # X-Forwarded-For / X-Forwarded-Proto are believed ('' = none: a worker is known by the
    # address it connects from, never by one a header names).
    c.controller.trusted_proxies = ""
    # The controller in a process of its own (bridge/control/process.py): workers over HTTP,
    # the learner over loopback, so a long train step never delays a heartbeat.
    c.controller.own_process = True
    # At the run's end tell the workers "run over" (they leave and exit 0). False: say
    # nothing, so workers started by hand (local_workers=0) stay and rejoin the next run
    # served at the same controller.port and token_file, as after a crash (a standing pool
    # serving consecutive runs: bench/staleness_sweep.py). The binary's own workers stop.
    c.controller.tell_run_over = True

    # Prometheus text at GET /metrics on the controller's port (bridge/control/prometheus.py):
    # fleet gauges and per-endpoint latency histograms. Served to loopback callers only,
    # unless metrics_token_file names a file whose content a scraper sends as bearer token.
    c.controller.prometheus = True
    c.controller.metrics_token_file = ""

    # Metrics sinks besides <workdir>/metrics.jsonl and TensorBoard (learner_jax/wandb_sink.py):
    # Weights & Biases when project is set; mode "online" | "offline" | "disabled" | '' =
    # wandb's default (WANDB_MODE). The run id is kept in <workdir>/wandb_run_id (resume).
    c.metrics = ConfigDict()
    c.metrics.wandb = ConfigDict()
    c.metrics.wandb.project = ""
    c.metrics.wandb.entity = ""
    c.metrics.wandb.mode = ""

    c.log_every = 1
    return c
