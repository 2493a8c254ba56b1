"""Orbax checkpoints of the learner: train state (params, optimizer state, step, RNG) plus an
opaque JSON cursor blob supplied by the caller (the controller's state goes there).

Layout: `<workdir>/checkpoints/<step>/{state,cursor}` written by one orbax
`CheckpointManager` (asynchronous saves, `max_to_keep`, `save_interval_steps`). A step
directory appears only after all its items are committed, so a run killed mid-save
resumes from the previous complete step. Restoring takes the abstract state with target
shardings, so every array comes back already laid out on the current mesh (which may
differ from the mesh it was saved from).

The state is saved as Flax's state dict (nested dicts, optax named tuples included), so
the checkpoint is a plain tree any tool (e.g. `bridge.export`) can read with
`checkpoint_manager.restore(step)` and no knowledge of our Python classes:
`state/params` is the Flax parameter tree of `bridge/model/layouts.py`.

A LoRA state (`train_state.TrainState.frozen` set) saves only what trains: `state/params`
is then the adapter tree and the frozen base is left out; the learner puts a reference to
the base in the cursor (`lora_base`: the HF directory and its weights' digest,
learner_jax/lora_state.py). Restoring takes the base from `target.frozen`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import serialization

from bridge.config.keys import SCHEMA

CHECKPOINT_SUBDIR = "checkpoints"
FROZEN = "frozen"  # TrainState field never saved (the LoRA base)


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class CheckpointConfig:
    """`config.checkpoint`: interval, keep, async_save (bridge/config/keys.py)."""

    def __post_init__(self):
        if self.interval < 0 or self.keep < 1:
            raise ValueError(f"need interval >= 0 and keep >= 1, got {self}")


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR)


class Checkpointer:
    """Saves and restores (train state, cursor) pairs; the state is any Flax-serializable tree."""

    def __init__(self, directory: str, cfg: CheckpointConfig = CheckpointConfig()):
        self.directory = os.path.abspath(directory)
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            # interval 0: should_save() is never true; forced saves still go through.
            save_interval_steps=max(cfg.interval, 1),
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self._interval = cfg.interval
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "cursor")
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def should_save(self, step: int) -> bool:
        # Plain modulo: orbax's own policy would also save the first step of every run.
        return self._interval > 0 and step % self._interval == 0

    def save(self, step: int, state: Any, cursor: dict | None = None, force: bool = False) -> bool:
        """Start saving `state` and `cursor` as `step` (returns at once when async).

        Saves only on interval steps unless `force`, and never over an existing step (a
        resumed run re-reaching its restore step); returns whether a save was started.
        The cursor must be JSON-serializable; it is checked here so a bad blob fails before
        anything is written.
        """
        if not force and not self.should_save(step):
            return False
        cursor = {} if cursor is None else cursor
        json.dumps(cursor)  # raises TypeError on a non-JSON cursor, before any write
        if int(step) in self._mngr.all_steps():
            return False
        return self._mngr.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_trained(state)),
                cursor=ocp.args.JsonSave(cursor),
            ),
            force=True,
        )

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, cursor) of `step` (default: latest), laid out like `target`.

        `target` is a state of the same structure whose leaves are arrays or
        `jax.ShapeDtypeStruct`s with `.sharding` set: the restored arrays get those
        shardings and dtypes.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(_abstract, _trained(target))
        restored = self._mngr.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                cursor=ocp.args.JsonRestore(),
            ),
        )
        saved = dict(restored["state"])
        if FROZEN in serialization.to_state_dict(target):  # not saved: the target's own
            saved[FROZEN] = serialization.to_state_dict(target)[FROZEN]
        state = serialization.from_state_dict(target, saved)
        return state, dict(restored["cursor"] or {})

    def restore_cursor(self, step: int | None = None) -> dict:
        """The cursor of `step` (default: latest) alone: what a resume checks before it
        restores the state (a LoRA run's base reference, learner_jax/lora_state.py)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._mngr.restore(
            int(step), args=ocp.args.Composite(cursor=ocp.args.JsonRestore())
        )
        return dict(restored["cursor"] or {})

    def wait_until_finished(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _trained(state: Any) -> dict:
    """The state dict that is saved: everything but a LoRA state's frozen base."""
    tree = serialization.to_state_dict(state)
    if isinstance(tree, dict):
        tree = {k: v for k, v in tree.items() if k != FROZEN}
    return tree


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
