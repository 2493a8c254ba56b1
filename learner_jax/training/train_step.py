"""The jitted learner steps: RL (policy loss from the registry) and SFT (next-token CE).

Both run the same machinery: the global batch is split into `micro_batches` micro-batches,
`jax.lax.scan` runs forward/backward on each and sums the gradients, then one optimizer
update is applied. So the global batch is independent of memory, and the update equals
the one-shot update on the whole batch (tests/learner_jax/training/train_step_test.py):
each micro-batch loss is weighted by its share of the loss's normalizer (sequences for
grpo / dr_grpo / gspo, tokens for dapo and SFT), which makes the weighted sum exactly the
full-batch loss, not a mean of means.

Micro-batch i takes rows i, i+k, i+2k, ... (strided), so every device's shard of the
global batch holds an equal part of every micro-batch: no data moves between devices.

The proximal log-probs of decoupled PPO (`losses.py`) are the learner's own params at the
start of the update. With one update per batch they equal the stop-gradient of the
forward pass that computes the loss, so the step reuses that pass instead of running a
second one (prox and logp are bitwise equal, ratio = 1 with its gradient intact).

RL log-probs are of softmax(logits / `temperature`), the distribution the workers sampled
from and whose log-probs they report (vLLM processed_logprobs), so importance weights of
on-policy tokens are 1 at any temperature. A batch with `pack` set (packing.py) runs the
model on packed rows and gathers the per-token results back to [B, T] before the losses.

MoE models (cfg.moe_layers): the objective adds `router_aux_loss_coef` x transformers'
load-balancing loss over the real tokens (moe.load_balancing_loss; metric `moe/aux_loss`).
A batch carrying the experts the worker's engine routed each token to (`routing`) is
replayed in the forward when `routing_replay` is 'rollout' (R3), and either way the step
reports how often the learner's own top-k agrees with it (`moe/routing_agreement`, per
layer and per row for the audit) and `mismatch/kl` under both routings
(`mismatch/kl_replay`, `mismatch/kl_no_replay`: one more forward, on the same tokens).

Einsum/shape letters: B batch (rows), T time, V vocab, k micro-batches, L MoE layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bridge.contracts import sampling_check
from bridge.control.trust import audit
from bridge.model.config import ModelConfig
from learner_jax import lora as lora_lib
from learner_jax.model import model, moe, sharding
from learner_jax.model import truncation as truncation_lib
from learner_jax.model.truncation import Truncation
from learner_jax.training import diagnostics, losses, packing
from learner_jax.training.train_state import TrainState

# Which count normalizes each loss (see losses.py "Aggregations"): the micro-batch weight.
_NORMALIZER = {"grpo": "sequences", "dr_grpo": "sequences", "gspo": "sequences", "dapo": "tokens"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One learner batch: one sequence (prompt + completion) per row, right-padded."""

    tokens: jax.Array  # int32 [B, T] model input
    positions: jax.Array  # int32 [B, T]
    segment_ids: jax.Array  # int32 [B, T] 0 = padding
    targets: jax.Array  # int32 [B, T] next token (tokens shifted left)
    loss_mask: jax.Array  # float32 [B, T] 1 where targets[b, t] is a completion token
    behavior_logp: jax.Array  # float32 [B, T] the worker's log p(targets), 0 elsewhere
    advantages: jax.Array  # float32 [B]
    seq_mask: jax.Array  # float32 [B] 0 drops a row (filtered group, batch padding)
    on_policy: jax.Array  # float32 [B] 1 = sampled by the learner's current version
    # Set by packing.pack_batch: the model then runs on packed rows and per-token results
    # are gathered back to this [B, T] layout (learner_jax/training/packing.py).
    pack: packing.Packing | None = None
    # MoE: int32 [B, T, L, k], the experts the worker's engine routed input token t to in
    # each MoE layer (model.check_routing); None when the worker recorded none.
    routing: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def make_batch(
    tokens,
    loss_mask,
    valid=None,
    behavior_logp=None,
    advantages=None,
    seq_mask=None,
    on_policy=None,
) -> Batch:
    """A numpy Batch from right-padded rows `tokens` [B, T+1].

    `loss_mask` [B, T+1] marks the completion tokens, `valid` [B, T+1] the real (non-pad)
    tokens (default: tokens != 0); targets are tokens shifted left by one, so a row of
    T+1 tokens trains T next-token predictions. `behavior_logp` [B, T] is aligned with the
    targets (the worker's log p of token t+1).
    """
    tokens = np.asarray(tokens, np.int32)
    loss_mask = np.asarray(loss_mask, np.float32)
    valid = (tokens != 0) if valid is None else np.asarray(valid, bool)
    if tokens.ndim != 2 or loss_mask.shape != tokens.shape or valid.shape != tokens.shape:
        raise ValueError(
            f"tokens {tokens.shape}, loss_mask {loss_mask.shape}, valid {valid.shape} "
            "must all be [B, T+1]"
        )
    b, t = tokens.shape[0], tokens.shape[1] - 1
    seg = valid[:, :-1].astype(np.int32)  # [B, T]
    pos = (np.maximum(np.cumsum(seg, axis=1) - 1, 0) * seg).astype(np.int32)
    lm = loss_mask[:, 1:] * valid[:, 1:] * valid[:, :-1]  # only real (input, target) pairs

    def vec(x, fill):
        return np.full((b,), fill, np.float32) if x is None else np.asarray(x, np.float32)

    return Batch(
        tokens=tokens[:, :-1],
        positions=pos,
        segment_ids=seg,
        targets=tokens[:, 1:],
        loss_mask=lm.astype(np.float32),
        behavior_logp=(
            np.zeros((b, t), np.float32)
            if behavior_logp is None
            else np.asarray(behavior_logp, np.float32)
        ),
        advantages=vec(advantages, 0.0),
        seq_mask=vec(seq_mask, 1.0),
        on_policy=vec(on_policy, 0.0),
    )


@dataclasses.dataclass(frozen=True)
class StepConfig:
    kind: str = "rl"  # 'rl' (policy loss) or 'sft' (next-token cross-entropy)
    loss: losses.LossConfig = losses.LossConfig()
    micro_batches: int = 1
    dtype: str = "float32"  # compute dtype; params stay in their param_dtype
    model_options: model.ModelOptions = model.ModelOptions()  # attention impl, remat
    # RL: the sampling temperature. Log-probs are of softmax(logits / temperature), the
    # distribution the workers sampled from and report (vLLM processed_logprobs).
    temperature: float = 1.0
    # RL: the sampler's min-p / top-k / top-p, applied after the temperature (truncation.py)
    truncation: Truncation = truncation_lib.NONE
    # LoRA (lora.py): the state's params are the adapters, `state.frozen` the base
    lora: lora_lib.LoraConfig | None = None
    # RL: the audit's sampling check (sum of log p + H and of Var[log p] per row: one more
    # pass over the [B, T, V] log-probs; bench/verify_cost.py). Off when the controller
    # does not judge by it (`controller.audit_sampling_z` = 0).
    sampling_check: bool = True
    # MoE: 'rollout' replays the batch's recorded routing in the forward (R3), 'off' routes
    # with the learner's own top-k (`model.moe.routing_replay`).
    routing_replay: str = "off"

    def __post_init__(self):
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(
                f"routing_replay must be one of {ROUTING_REPLAY}, got {self.routing_replay!r}"
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.kind not in ("rl", "sft"):
            raise ValueError(f"kind must be 'rl' or 'sft', got {self.kind!r}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.kind == "rl" and self.loss.name not in _NORMALIZER:
            raise ValueError(f"no micro-batch weighting known for loss {self.loss.name!r}")


ROUTING_REPLAY = ("off", "rollout")
ROWS = "audit_rows/"  # per-row outputs of an RL step ([B] arrays, not scalar metrics)


def batch_sharding(mesh: Mesh, rules: Sequence = sharding.DEFAULT_RULES) -> NamedSharding:
    """Rows over the mesh axes the rules give the logical 'batch' axis."""
    spec = nn.logical_to_mesh(PartitionSpec("batch"), sharding.normalize_rules(rules))
    return NamedSharding(mesh, spec)


def needs_reference(step_cfg: StepConfig) -> bool:
    """An RL step with a KL penalty: it takes the frozen reference policy's params."""
    return step_cfg.kind == "rl" and step_cfg.loss.kl_coef > 0


def _check_reference(step_cfg: StepConfig, ref) -> None:
    if (ref is not None) != needs_reference(step_cfg):
        raise ValueError("pass the reference params exactly when loss.kl_coef > 0 (RL)")


def _row_counts(mb: Batch) -> tuple[jax.Array, jax.Array]:
    """(kept sequences, loss tokens) of a batch, as the losses count them."""
    m = mb.loss_mask * mb.seq_mask[:, None]  # [B, T]
    return (m.sum(axis=1) > 0).sum().astype(jnp.float32), m.sum()


def _objective(cfg: ModelConfig, step_cfg: StepConfig) -> Callable:
    """(params, micro-batch) -> (loss, (weighted metrics, summed metrics))."""
    net = model.Transformer(
        cfg, dtype=jnp.dtype(step_cfg.dtype), options=step_cfg.model_options, lora=step_cfg.lora
    )

    replay = step_cfg.routing_replay == "rollout"

    def per_token(params, tokens, positions, segment_ids, targets, rngs, extra, routing):
        """((log p(target), entropy, argmax == target) per input token, [rows, len] each;
        the forward's model.Routing or None)."""
        rl = step_cfg.kind == "rl"  # SFT: the model's own distribution
        temperature, truncation = (
            (step_cfg.temperature, step_cfg.truncation) if rl else (1.0, truncation_lib.NONE)
        )
        # RL: also Var_p[log p] per position, for the audit's sampling check.
        return model.token_stats_and_routing(
            net, params, tokens, positions, segment_ids, targets, temperature, truncation, rngs,
            variance=rl and step_cfg.sampling_check and extra, routing=routing,
        )  # fmt: skip

    def stats_and_routing(params, mb: Batch, rngs=None, extra=True):
        """per_token on the batch's rows ([B, T] out, packed or not); `extra=False` skips
        the audit's variance pass (the reference policy's log-probs need none)."""
        if replay and mb.routing is None:
            raise ValueError("routing_replay='rollout' needs the batch's recorded routing")
        if mb.pack is not None and mb.routing is not None:
            raise ValueError("recorded routing is [B, T]-aligned: run MoE replay unpacked")
        q = mb if mb.pack is None else mb.pack  # packed: rows gathered back to [B, T] below
        routing = mb.routing if replay else None
        out, seen = per_token(
            params, q.tokens, q.positions, q.segment_ids, q.targets, rngs, extra, routing
        )
        if mb.pack is None:
            return out, seen
        return tuple(packing.unpack(x, mb.pack, mb.tokens.shape[1]) for x in out), seen

    def stats(params, mb: Batch, rngs=None, extra=True):
        return stats_and_routing(params, mb, rngs, extra)[0]

    def moe_terms(seen: model.Routing, mb: Batch, sums: dict):
        """The load-balancing loss over the forward's real tokens, and (with recorded
        routing) the agreement sums of the learner's own top-k with it."""
        q = mb if mb.pack is None else mb.pack
        real = (q.segment_ids > 0).reshape(-1)
        logits = seen.router_logits
        aux = moe.load_balancing_loss(
            logits.reshape(logits.shape[0], -1, logits.shape[-1]), real, cfg.num_experts_per_tok
        )
        if mb.routing is not None:
            agree = moe.routing_agreement(seen.experts, mb.routing)  # [B, T, L]
            # Recorded rows are the inputs with a real next token (bridge/contracts/
            # routing.py): a sequence's last token was never forwarded by the engine, and
            # its batch routing is a filler. (A row filling the whole width loses its last
            # pair here too: fewer rows checked, none misjudged.)
            seg = mb.segment_ids > 0
            recorded = seg & jnp.pad(seg[:, 1:], ((0, 0), (0, 1)))  # [B, T]
            tok = jnp.broadcast_to(recorded.astype(jnp.float32)[:, :, None], agree.shape)
            sums["moe/agree"] = (agree * tok).sum(axis=(0, 1))  # [L]
            sums["moe/agree_tokens"] = tok.sum(axis=(0, 1))
            sums[ROWS + "routing_agree"] = (agree * tok).sum(axis=(1, 2))
            sums[ROWS + "routing_tokens"] = tok.sum(axis=(1, 2))
        return aux

    def fn(params, mb: Batch, rngs=None, ref=None, kl_scale=None):
        (logp, entropy, correct, *var), seen = stats_and_routing(params, mb, rngs)
        m = mb.loss_mask * mb.seq_mask[:, None]  # [B, T]
        sums = {
            "entropy": jax.lax.stop_gradient((entropy * m).sum()),
            "tokens": m.sum(),
            "sequences": _row_counts(mb)[0],
        }
        aux = None if seen is None else moe_terms(seen, mb, sums)
        if step_cfg.kind == "sft":
            loss = -(logp * m).sum() / jnp.maximum(m.sum(), 1.0)
            sums["token_accuracy"] = (correct * m).sum()
            metrics = {"loss": jax.lax.stop_gradient(loss)}
            if aux is not None:
                loss = loss + cfg.router_aux_loss_coef * aux
                metrics["moe/aux_loss"] = jax.lax.stop_gradient(aux)
            return loss, (metrics, sums)
        prox = jax.lax.stop_gradient(logp)
        inputs = losses.LossInputs(
            prox_logp=prox,
            behavior_logp=mb.behavior_logp,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            seq_mask=mb.seq_mask,
            entropy=entropy if step_cfg.loss.entropy_coef > 0 else None,
            # The reference policy's log-probs (KL penalty): no dropout, no gradient.
            ref_logp=None if ref is None else jax.lax.stop_gradient(stats(ref, mb, extra=False)[0]),
            kl_scale=kl_scale,
        )
        loss, metrics = losses.compute_loss(logp, inputs, step_cfg.loss)
        if aux is not None:  # load balancing, as transformers adds it to the LM loss
            loss = loss + cfg.router_aux_loss_coef * aux
            metrics["moe/aux_loss"] = jax.lax.stop_gradient(aux)
        # The audit, mismatch/kl and the sampling check judge a worker against the policy
        # it sampled from, the dropout-free one: under LoRA dropout (rngs) they take a
        # deterministic pass of their own, else a dropout pass inflates honest workers'.
        if rngs is not None:
            logp, entropy, _, *var = jax.lax.stop_gradient(stats(params, mb))
            prox = logp
        # mismatch/kl: k3 estimate of KL(behavior || learner) on rows the learner's current
        # version sampled; anything above float noise is an engine/learner numerics gap.
        mm = m * mb.on_policy[:, None]
        row_k3, row_lr, row_n = audit.row_sums(prox, mb.behavior_logp, mm, xp=jnp)  # [B]
        sums["mismatch/kl"] = row_k3.sum()
        sums["mismatch/tokens"] = row_n.sum()
        # staleness/kl: the same estimate over every trained token, stale rows included:
        # what the bound S costs in off-policy distance (the on-policy rows add their
        # numerics gap, mismatch/kl's).
        all_k3, _, all_n = audit.row_sums(prox, mb.behavior_logp, m, xp=jnp)
        sums["staleness/kl"], sums["staleness/kl_tokens"] = all_k3.sum(), all_n.sum()
        if mb.routing is not None:
            # The same KL under the other routing (one more forward, no backward): the
            # replay's effect on train/inference mismatch, measured on the same tokens.
            # (Recorded routing never comes packed: stats_and_routing refuses that.)
            other, _ = per_token(
                params, mb.tokens, mb.positions, mb.segment_ids, mb.targets, None, False,
                None if replay else mb.routing,
            )  # fmt: skip
            other_logp = jax.lax.stop_gradient(other[0])
            other_k3 = audit.row_sums(other_logp, mb.behavior_logp, mm, xp=jnp)[0].sum()
            with_replay, without = (
                (sums["mismatch/kl"], other_k3) if replay else (other_k3, sums["mismatch/kl"])
            )
            sums["mismatch/kl_replay"], sums["mismatch/kl_no_replay"] = with_replay, without
        # Per-row sums for the controller's per-worker audit of behaviour log-probs
        # (bridge/control/trust/audit.py); the step returns them in batch row order.
        sums[ROWS + "k3"] = row_k3
        sums[ROWS + "logratio"] = row_lr
        sums[ROWS + "tokens"] = row_n
        # ... and the sampling check's (sum of log p + H, sum of V) over the same tokens:
        # did the policy pick them (bridge/contracts/sampling_check.py)?
        if step_cfg.sampling_check:
            ent = jax.lax.stop_gradient(entropy)
            row_dev, row_var, _ = sampling_check.row_sums(prox, ent, var[0], mm, xp=jnp)
            sums[ROWS + "dev"], sums[ROWS + "var"] = row_dev, row_var
            sums[ROWS + "evidence"] = sampling_check.row_evidence(prox, var[1], mm, xp=jnp)
        metrics.pop("tokens", None)
        return loss, (metrics, sums)

    return fn


def _split(batch: Batch, k: int) -> Batch:
    """[B, ...] -> [k, B/k, ...], micro-batch i = rows i, i+k, ... (see module docstring)."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _unsplit(x: jax.Array) -> jax.Array:
    """[k, B/k] per-micro-batch rows -> [B] in batch order (the inverse of `_split`)."""
    return jnp.swapaxes(x, 0, 1).reshape(-1)


def _combine(name: str, values: jax.Array, loss_w: jax.Array, token_w: jax.Array):
    """Reduce a per-micro-batch metric [k] to the full-batch value."""
    if name == "kl_coef":  # this step's beta, the same in every micro-batch
        return values[0]
    if name.endswith("max"):
        return values.max()
    if name.endswith("min"):
        return values.min()
    if name in ("loss", "pg_loss", "kl"):
        return (values * loss_w).sum()
    return (values * token_w).sum()


def _dropout_rngs(step_cfg: StepConfig, state: TrainState, i):
    """LoRA dropout's RNG for micro-batch `i` of this step; None (deterministic) without."""
    if step_cfg.lora is None or step_cfg.lora.dropout == 0:
        return None
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    return {"dropout": jax.random.fold_in(key, i)}


def make_step_fn(cfg: ModelConfig, optimizer: optax.GradientTransformation, step_cfg: StepConfig):
    """The unjitted step (state, batch) -> (state, metrics); see `jit_step`."""
    objective = _objective(cfg, step_cfg)

    def weighted(params, mb, w, frozen, rngs, ref, kl_scale):
        # LoRA: params are the adapters, differentiated; the frozen base is not.
        ref = None if ref is None else lora_lib.combine(frozen, ref)
        loss, aux = objective(lora_lib.combine(frozen, params), mb, rngs, ref, kl_scale)
        return loss * w, aux

    grad_fn = jax.value_and_grad(weighted, has_aux=True)
    k = step_cfg.micro_batches
    by = "tokens" if step_cfg.kind == "sft" else _NORMALIZER[step_cfg.loss.name]

    def step(state: TrainState, batch: Batch, ref=None, kl_scale=None):
        """`ref`: the reference policy's params (a tree like `state.params`) and `kl_scale`
        (a scalar, this step's factor on loss.kl_coef), which the KL penalty needs
        (`needs_reference`); None otherwise."""
        _check_reference(step_cfg, ref)
        if batch.size % k:
            raise ValueError(f"batch of {batch.size} rows does not split into {k} micro-batches")
        micro = _split(batch, k)
        seqs, toks = jax.vmap(_row_counts)(micro)  # [k] each
        counts = toks if by == "tokens" else seqs
        loss_w = counts / jnp.maximum(counts.sum(), 1.0)  # [k]
        token_w = toks / jnp.maximum(toks.sum(), 1.0)

        def body(grads, xs):
            mb, w, i = xs
            rngs = _dropout_rngs(step_cfg, state, i)
            (_, (metrics, sums)), g = grad_fn(
                state.params, mb, w, state.frozen, rngs, ref, kl_scale
            )
            return jax.tree.map(jnp.add, grads, g), (metrics, sums)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        xs = (micro, loss_w, jnp.arange(k))
        grads, (metrics, sums) = jax.lax.scan(body, zeros, xs)
        out = {name: _combine(name, v, loss_w, token_w) for name, v in metrics.items()}
        rows = {n: _unsplit(sums.pop(n)) for n in list(sums) if n.startswith(ROWS)}
        sums = {
            name: v.sum(axis=0) if name.startswith("moe/") else v.sum() for name, v in sums.items()
        }
        tokens = jnp.maximum(sums["tokens"], 1.0)
        out["entropy"] = sums["entropy"] / tokens
        out["tokens"] = sums["tokens"]
        out["sequences"] = sums["sequences"]
        if "moe/agree" in sums:  # per layer [L] summed over micro-batches
            agree, n = sums.pop("moe/agree"), jnp.maximum(sums.pop("moe/agree_tokens"), 1.0)
            out["moe/routing_agreement"] = agree.sum() / n.sum()
            for j, layer in enumerate(cfg.moe_layers):
                out[f"moe/routing_agreement/layer_{layer}"] = agree[j] / n[j]
        if step_cfg.kind == "sft":
            out["token_accuracy"] = sums["token_accuracy"] / tokens
        else:
            out["mismatch/kl"] = sums["mismatch/kl"] / jnp.maximum(sums["mismatch/tokens"], 1.0)
            out["mismatch/tokens"] = sums["mismatch/tokens"]
            out["staleness/kl"] = sums["staleness/kl"] / jnp.maximum(
                sums["staleness/kl_tokens"], 1.0
            )
            for name in ("mismatch/kl_replay", "mismatch/kl_no_replay"):
                if name in sums:  # a MoE batch with recorded routing: both, every step
                    out[name] = sums[name] / jnp.maximum(sums["mismatch/tokens"], 1.0)
        out["grad_norm"] = optax.tree.norm(grads)
        out.update(diagnostics.grad_norms_by_layer(grads))  # where a collapse starts
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        out["update_norm"] = optax.tree.norm(updates)
        out.update(rows)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, out

    return step


def jit_step(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    step_cfg: StepConfig,
    mesh: Mesh,
    shardings: TrainState,
    rules: Sequence = sharding.DEFAULT_RULES,
    donate: bool = True,
):
    """The step jitted with explicit in/out shardings: state as `shardings` (from
    `train_state.state_shardings`), batch rows as the 'batch' rule says, metrics replicated.
    Traced under the mesh and rules so the model's activation constraints apply.
    """
    ins = (shardings, batch_sharding(mesh, rules))
    if needs_reference(step_cfg):  # + the reference params and the KL's scale
        ins += (shardings.params, NamedSharding(mesh, PartitionSpec()))
    fn = jax.jit(
        make_step_fn(cfg, optimizer, step_cfg),
        in_shardings=ins,
        out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,) if donate else (),
    )

    def step(state: TrainState, batch: Batch, ref=None, kl_scale=1.0):
        _check_reference(step_cfg, ref)
        with sharding.use_mesh(mesh, rules):
            if ref is None:
                return fn(state, batch)
            return fn(state, batch, ref, jnp.asarray(kl_scale, jnp.float32))

    step.jitted = fn
    return step


def put_batch(batch: Batch, mesh: Mesh, rules: Sequence = sharding.DEFAULT_RULES) -> Batch:
    """Host arrays -> device arrays with rows sharded over the batch axes.

    Across processes (a mesh spanning hosts) each process transfers only the rows its own
    devices hold: `batch` has the global shape, and rows no local device holds are never
    read (a follower process leaves them zero, learner_jax/multihost/mirror.py).
    """
    out_sharding = batch_sharding(mesh, rules)
    if jax.process_count() == 1:
        return jax.device_put(batch, out_sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, out_sharding, lambda idx: x[idx]),
        jax.tree.map(np.asarray, batch),
    )
