"""What a config means for the learner: every typed dataclass built from the ConfigDict
(optimizers, step configs, checkpointing, the RL parts' settings, the fleet, the
controller, processes), the mesh, sharding rules, prompt format, and every check that can
fail before the workdir is touched (`validate`, which the training binary calls first).

One home for the translation config -> dataclasses, so the learner (learner_jax/learner.py),
the training binary (learner_jax/train.py), learner_jax/rl/ and tests read a config the
same way; library code takes the dataclasses. A config key, the dataclass field it fills and
the worker flag it becomes are one declaration (bridge/config/keys.py); `validate` refuses
keys not declared there and values of the wrong type first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import jax

from bridge.broadcast.topology import resolve_mode
from bridge.config.keys import SCHEMA
from bridge.contracts import staleness as staleness_rule
from bridge.contracts.prompt import PromptFormat
from learner_jax import lora
from learner_jax.evaluation import evaluate
from learner_jax.fleet import fleet, local_fleet
from learner_jax.model import model, sharding, truncation
from learner_jax.model.dtypes import compute_dtype
from learner_jax.multihost import distributed
from learner_jax.rl import batches
from learner_jax.training import advantages, checkpoint, losses, optim, train_step

PHASES = ("sft", "rl")


def optimizer_config(config, phase: str) -> optim.OptimizerConfig:
    o = config.optimizer
    common = dict(
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        end_lr_fraction=o.end_lr_fraction,
    )
    if phase == "sft":
        steps = max(config.sft.steps, 1)
        warmup = min(config.sft.warmup_steps, steps - 1)
        return optim.OptimizerConfig(
            learning_rate=config.sft.learning_rate,
            warmup_steps=warmup,
            total_steps=steps,
            **{**common, "end_lr_fraction": config.sft.get("end_lr_fraction", o.end_lr_fraction)},
        )
    steps = max(config.total_steps, 1)
    return optim.OptimizerConfig(
        learning_rate=o.learning_rate,
        warmup_steps=min(o.warmup_steps, steps - 1),
        total_steps=steps,
        **common,
    )


def step_config(config, phase: str) -> train_step.StepConfig:
    options = model_options(config)
    if phase == "sft":
        micro = config.sft.batch_size // config.sft.micro_batch_size
        return train_step.StepConfig(
            kind="sft",
            micro_batches=micro,
            dtype=compute_dtype(config),
            model_options=options,
            lora=lora.from_config(config),
        )
    rows = config.batch.groups_per_step * config.batch.samples_per_group
    return train_step.StepConfig(
        kind="rl",
        loss=loss_config(config),
        micro_batches=rows // config.batch.micro_batch_size,
        dtype=compute_dtype(config),
        model_options=options,
        temperature=float(config.rollout.temperature),
        truncation=truncation.from_rollout(config.rollout),
        lora=lora.from_config(config),
        sampling_check=float(config.controller.get("audit_sampling_z", 6.0)) > 0,
        routing_replay=config.model.moe.routing_replay,
    )


def model_options(config) -> model.ModelOptions:
    """Attention, rematerialization and log-prob chunking (attention.py, model.py, logprobs.py)."""
    return model.ModelOptions(
        attention=config.model.attention,
        remat=config.model.remat,
        logprob_chunk=config.model.logprob_chunk,
    )


def check_batch_sizes(config, mesh) -> None:
    """Fail before any compile when the batch does not split over micro-batches and mesh."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = config.batch.groups_per_step * config.batch.samples_per_group
    for name, total, micro in (
        ("batch", rows, config.batch.micro_batch_size),
        ("sft", config.sft.batch_size, config.sft.micro_batch_size),
    ):
        if micro <= 0 or total % micro or micro % shards:
            raise ValueError(
                f"{name}: micro-batch size {micro} must divide the global batch {total} "
                f"and be a multiple of data*fsdp = {shards}"
            )


def sharding_rules(config) -> sharding.Rules:
    """The config's `sharding_rules` if it sets them, else `sharding.DEFAULT_RULES`.

    The table has one home, learner_jax/model/sharding.py: library code (import, export,
    evaluation, tests) needs it without a config, and a config that wants another layout
    sets the key (a tuple of (logical axis, mesh axes) pairs) instead of copying the table.
    """
    return sharding.normalize_rules(config.get("sharding_rules") or sharding.DEFAULT_RULES)


def staleness_bounds(config) -> tuple[int, int, bool]:
    """(S_min, S_max, auto). `staleness` is an int S, fixed: (S, S, False); or "auto": the
    controller moves S within [`staleness_min`, `staleness_max`]
    (bridge/control/leasing/auto_staleness.py), so whatever keeps versions for S keeps S_max's."""
    s = config.staleness
    if s == "auto":
        lo, hi = config.get("staleness_min", 0), config.get("staleness_max", 0)
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
            raise ValueError(
                f'staleness="auto" needs ints 0 <= staleness_min <= staleness_max, got {lo}, {hi}'
            )
        return lo, hi, True
    if isinstance(s, bool) or not isinstance(s, int):
        raise ValueError(f'staleness must be an int S >= 0 or "auto", got {s!r}')
    return s, s, False


def partial_mode(config) -> str:
    """`rollout.partial`: "off" or "continue" (bridge/contracts/staleness.py)."""
    mode = str(config.rollout.get("partial", "off"))
    if mode not in staleness_rule.PARTIAL_MODES:
        raise ValueError(f"rollout.partial={mode!r}; one of {staleness_rule.PARTIAL_MODES}")
    return mode


def versions_kept(config) -> int:
    """How many newest versions the weight store keeps (bridge/contracts/staleness.py)."""
    return staleness_rule.versions_kept(staleness_bounds(config)[1], partial_mode(config))


def check_rl_schedule(config) -> None:
    """The staleness / publish_every schedule rule (bridge/contracts/staleness.py); with
    `staleness="auto"` S_min must meet it (S never goes below)."""
    error = staleness_rule.schedule_error(staleness_bounds(config)[0], config.publish_every)
    if error:
        raise ValueError(error)


def check_loss(config) -> None:
    """The KL penalty's reference policy (learner_jax/training/reference_policy.py) is held by the
    one learner process; a multi-process learner's followers do not load it."""
    if loss_config(config).kl_coef > 0 and several_processes(config):
        raise ValueError(
            f"loss.kl_coef={config.loss.kl_coef} is not supported with several learner "
            "processes (the reference policy lives in process 0 only); set loss.kl_coef=0 "
            "or run one process"
        )


def check_packing(config) -> None:
    """A packed row must hold the longest sequence a batch can have (prompt + answer)."""
    b = config.batch
    width = b.max_prompt_len + b.max_answer_len
    pack_len = b.get("pack_len", 0)
    if b.get("packing", False) and pack_len and pack_len < width:
        raise ValueError(
            f"batch.pack_len={pack_len} < max_prompt_len + max_answer_len = {width}: the "
            "longest sequence would not fit a packed row (0 = that width)"
        )
    if b.get("packing", False) and several_processes(config):
        # Each process holds only its own rows of a step (rl/mirror.py), while the packing
        # is computed from every row's length: the processes would pack differently.
        raise ValueError("batch.packing runs on one learner process only (for now)")


def several_processes(config) -> bool:
    d = config.get("distributed", {})
    return d.get("num_processes", 0) > 1 or d.get("auto", False)


def check_lora(config) -> None:
    """`learner.lora.*`, and LoRA on one learner process: adapter versions are gathered
    and written by one process (bridge/weights/adapter.py), and nothing of a LoRA run
    (the frozen base, adapter gathering, publishing) has run across processes."""
    if lora.from_config(config) is not None and several_processes(config):
        raise ValueError(
            "learner.lora.rank > 0 runs on one learner process only (for now): adapter "
            "versions are published by one process; use one process (its mesh may span "
            "all of its host's devices) or full-weight training (learner.lora.rank=0)"
        )


def prompt_format(config, task=None) -> PromptFormat:
    """The run's prompt format: config.prompt where it sets a format, else the task's own;
    `task.thinking` on/off sets the chat template's enable_thinking (auto: the template's
    default; bridge/contracts/thinking.py)."""
    from bridge.contracts import thinking

    fmt = _configured_format(config, task)
    mode = thinking.prompt_thinking(str(config.task.get("thinking", "auto")))
    if not mode:
        return fmt
    if fmt.kind != "chat":
        raise ValueError(
            f"task.thinking={mode!r} needs the chat format (the switch is the chat "
            f"template's enable_thinking); the prompt format is {fmt.kind!r}"
        )
    return dataclasses.replace(fmt, thinking=mode)


def _configured_format(config, task=None) -> PromptFormat:
    p = config.get("prompt")
    if p is None or not p.get("format"):
        if p is not None and (p.get("system") or p.get("thinking")):
            raise ValueError(
                "prompt.system/prompt.thinking are set but prompt.format is '': set "
                "prompt.format='chat' (they only apply to the chat template)"
            )
        return PromptFormat() if task is None else task.prompt_format
    # The tools a task declares stay declared when the config picks the chat format.
    tools = task.prompt_format.tools if task is not None and p.format == "chat" else ""
    return PromptFormat(
        kind=p.format, system=p.get("system", ""), thinking=p.get("thinking", ""), tools=tools
    )


def validate(config) -> None:
    """Every config error that can be found without touching the workdir, raised early."""
    SCHEMA.check(config)  # unknown keys (a typo would be ignored) and wrong types
    check_batch_sizes(config, make_mesh(config))
    sharding_rules(config)
    check_lora(config)  # learner.lora.*
    check_rl_schedule(config)
    partial_mode(config)
    truncation.check_rollout(config.rollout)
    check_loss(config)
    prompt_format(config)
    check_packing(config)
    distributed_config(config)
    fleet_config(config)
    checkpoint_config(config)
    advantage_config(config)
    resolve_mode(config.bridge.broadcast, "file")  # an unknown mode fails here
    for phase in PHASES:
        optimizer_config(config, phase)
        step_config(config, phase)


def make_mesh(config):
    """The config's mesh. Sizes that multiply to fewer than the devices present use the
    first ones (the 1x1x1 default runs anywhere); -1 fills with all devices."""
    shape = {k: int(v) for k, v in config.mesh.items()}
    devices = jax.devices()
    n = math.prod(shape.values())
    if n > 0 and n < len(devices):
        logging.warning("mesh %s uses %d of %d devices", shape, n, len(devices))
        devices = devices[:n]
    return sharding.make_mesh(shape, devices)


# -- config sections -> the dataclasses the parts take ----------------------------------------


def _fields(cls, section, **rename) -> dict:
    """The keys of `section` that name fields of `cls` (`rename`: field=key)."""
    d = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    names = {f.name for f in dataclasses.fields(cls)}
    out = {k: v for k, v in d.items() if k in names}
    out.update({field: d[key] for field, key in rename.items() if key in d})
    return out


def loss_config(config) -> losses.LossConfig:
    return losses.LossConfig(**config.loss.to_dict())


def advantage_config(config) -> advantages.AdvantageConfig:
    return advantages.AdvantageConfig(**_fields(advantages.AdvantageConfig, config.advantages))


def checkpoint_config(config) -> checkpoint.CheckpointConfig:
    return checkpoint.CheckpointConfig(**_fields(checkpoint.CheckpointConfig, config.checkpoint))


def distributed_config(config) -> distributed.DistributedConfig:
    """`config.distributed` (absent = one process)."""
    d = config.get("distributed")
    cls = distributed.DistributedConfig
    return cls() if d is None else cls(**_fields(cls, d))


def batch_shape(config) -> batches.BatchShape:
    b = config.batch
    return batches.BatchShape(
        b.groups_per_step, b.samples_per_group, b.max_prompt_len, b.max_answer_len
    )


def eval_config(config) -> evaluate.EvalConfig:
    """The learner's own evaluator (`eval.on=learner`): `eval.n` samples per prompt at
    `eval.temperature` (0 = greedy, one sample), as the fleet's evaluation would."""
    b, e = config.batch, config.get("eval")
    sampling = {}
    if e is not None:
        sampling = dict(temperature=float(e.get("temperature", 0.0)), n=int(e.get("n", 1)))
    seed = int(config.get("seed", 0))
    return evaluate.EvalConfig(
        b.max_prompt_len, b.max_answer_len, dtype=compute_dtype(config), seed=seed,
        **sampling,
    )  # fmt: skip


def fleet_config(config) -> local_fleet.FleetConfig:
    """`config.fleet`, with the engines' `max_model_len` raised to fit the batch's longest
    sequence (prompt + answer) when the configured one is shorter."""
    known = _fields(local_fleet.FleetConfig, config.fleet)
    for key in ("prices", "throttle_s"):
        if key in known:
            known[key] = tuple(float(x) for x in known[key])
    if "worker_cpus" in known:
        known["worker_cpus"] = tuple(int(x) for x in known["worker_cpus"])
    cfg = local_fleet.FleetConfig(**known)
    need = config.batch.max_prompt_len + config.batch.max_answer_len
    return dataclasses.replace(cfg, max_model_len=max(cfg.max_model_len, need))


def follow_config(config, fleet_cfg: local_fleet.FleetConfig) -> fleet.FollowConfig:
    lim = local_fleet.limits(fleet_cfg, config.local_workers)
    return fleet.FollowConfig(
        activation=config.controller.activation,
        period_s=fleet_cfg.follow_period_s,
        max_deaths=fleet_cfg.max_deaths,
        death_window_s=fleet_cfg.death_window_s,
        standby_release_s=fleet_cfg.standby_release_s,
        max_workers=lim.max_workers,
        max_usd_per_hour=lim.max_usd_per_hour,
        wait_s=fleet_cfg.grace_s + 5.0,  # SIGTERM'd local workers are killed at grace + 5
    )


def controller_config(config, vocab_size: int, eos_id: int, model_cfg=None):
    """The hosted controller's settings (bridge/control/config.py): `config.controller`'s
    keys of the same name, the batch shape, sampling, the weight broadcast and, for a MoE
    `model_cfg`, the shape its workers' recorded routing must have."""
    from bridge.control.config import ControllerConfig
    from bridge.control.intake.validation import RoutingRule
    from bridge.control.protocol import SamplingParams

    b, r = config.batch, config.rollout
    s_min, s_max, auto = staleness_bounds(config)
    return ControllerConfig(
        **_fields(ControllerConfig, config.controller),
        staleness=s_min,  # "auto" starts at S_min and moves up on evidence
        staleness_auto=auto,
        staleness_min=s_min,
        staleness_max=s_max,
        staleness_kl_max=float(config.get("staleness_kl_max", 0.0)),
        partial=partial_mode(config),
        groups_per_step=b.groups_per_step,
        group_size=b.samples_per_group,
        vocab_size=vocab_size,
        sampling=SamplingParams(
            temperature=float(r.temperature),
            top_p=float(r.get("top_p", 1.0)),
            top_k=int(r.get("top_k", -1)),
            min_p=float(r.get("min_p", 0.0)),
            max_tokens=b.max_answer_len,
            stop_token_ids=[eos_id],
        ),
        # a multi-turn episode (model and environment tokens) fits one learner row too
        max_completion_tokens=b.max_answer_len,
        max_prompt_tokens=b.max_prompt_len,
        seed=config.seed,
        broadcast=broadcast_mode(config),
        broadcast_fanout=config.bridge.broadcast_fanout,
        routing=RoutingRule() if model_cfg is None else routing_rule(config, model_cfg),
    )


def routing_rule(config, model_cfg):
    """What a MoE policy's recorded routing must look like at intake; required whenever the
    learner replays it (`model.moe.routing_replay`)."""
    from bridge.control.intake.validation import RoutingRule

    layers = tuple(getattr(model_cfg, "moe_layers", ()))
    if not layers:
        return RoutingRule()
    replay = config.model.moe.routing_replay
    return RoutingRule(
        num_layers=len(layers),
        k=model_cfg.num_experts_per_tok,
        num_experts=model_cfg.num_experts,
        required=replay == "rollout",
    )


def broadcast_mode(config) -> str:
    """`bridge.broadcast` with "auto" resolved against the run's store ('' = the workdir's)."""
    from bridge.store.weight_store import parse_spec

    spec = str(config.bridge.store or "")
    if not spec:  # <workdir>/weights
        return resolve_mode(config.bridge.broadcast, "file")
    driver = parse_spec(json.loads(spec) if spec.startswith("{") else spec)["driver"]
    return resolve_mode(config.bridge.broadcast, driver)


def server_options(config):
    """The controller's HTTP service (bridge/control/http/service.py): `controller.tls_cert` and
    `controller.tls_key` ('' = plain HTTP, which non-loopback workers are refused unless
    `controller.allow_plain_http`)."""
    from bridge.control.http.service import ServerOptions

    c = config.controller
    return ServerOptions(
        host=c.host,
        port=c.port,
        certfile=c.tls_cert or None,
        keyfile=c.tls_key or None,
        allow_plain_http=bool(c.allow_plain_http),
        relay_hosts=tuple(h.strip() for h in c.relay_hosts.split(",") if h.strip()),
        trusted_proxies=tuple(h.strip() for h in c.trusted_proxies.split(",") if h.strip()),
        prometheus=bool(c.get("prometheus", True)),
        metrics_token_file=c.get("metrics_token_file", "") or None,
    )
