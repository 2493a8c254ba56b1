"""The frozen reference policy of the KL penalty (`loss.kl_coef` > 0).

The reference is the policy as the RL phase starts (after the SFT warm start, or the
imported checkpoint when there is none), as in DeepSeekMath's GRPO and verl's
`use_kl_loss`: each RL step adds beta * k3(pi_ref || pi) per token (learner_jax/training/losses.py),
which anchors every decision to what the warm start did there. With on-policy samples the
k3 term's gradient on the logits is beta * (pi - pi_ref): unlike an entropy bonus it does
not vanish as an action's probability goes to 0, so an action the policy stopped sampling
at a rarely visited state is pulled back (BUILD_NOTES.md, issue 27: Kuhn poker).

It is a copy of the train state's `params` (with LoRA: the adapters, merged with the same
frozen base in the step), saved once to `<workdir>/reference_policy` when the RL phase
starts, so a resumed run keeps the same anchor (the checkpoint manager prunes the RL
boundary's own checkpoint).
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

DIRNAME = "reference_policy"


def kl_scale(loss_cfg, rl_step: int, total_steps: int) -> float:
    """The factor on `loss.kl_coef` at RL update `rl_step` (0-based): a cosine from 1 down
    to `loss.kl_end_fraction` over `total_steps`, then flat (1 throughout by default). A
    large anchor early keeps rare actions explored while the policy finds them; a small
    one late lets it commit to them (the KL's pull toward the warm start costs reward)."""
    end = loss_cfg.get("kl_end_fraction", 1.0)
    progress = min(rl_step / max(total_steps, 1), 1.0)
    return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def path(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), DIRNAME)


def snapshot(params: Any, shardings: Any) -> Any:
    """A copy of `params` in new buffers (the train step donates the state's)."""
    return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)


def save(workdir: str, params: Any) -> None:
    """Write the reference (complete when this returns; orbax writes it atomically). It
    replaces one left by an earlier start of this RL phase: the phase starts from these
    params now, and a resume past the boundary restores instead of saving."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path(workdir), params, force=True)
        ckptr.wait_until_finished()


def restore(workdir: str, abstract: Any) -> Any:
    """The saved reference, laid out like `abstract` (ShapeDtypeStructs with shardings)."""
    if not os.path.exists(path(workdir)):
        raise FileNotFoundError(
            f"loss.kl_coef > 0 needs the reference policy saved when the RL phase started "
            f"({path(workdir)}), and this run has none: its RL phase began without the KL "
            "penalty. Start a new workdir, or set loss.kl_coef=0"
        )
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path(workdir), abstract)
