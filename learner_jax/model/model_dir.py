"""The model directory a run trains: `model.hf_dir`, or the tiny random model the config
describes, written once into `<workdir>/model` (and checked on resume: a workdir never
resumes a model of another shape)."""

from __future__ import annotations

import os

from bridge.model import tiny_model
from bridge.model.config import ModelConfig
from learner_jax.multihost import distributed


def _tiny_config(config) -> ModelConfig:
    m = config.model
    shape = dict(
        num_layers=m.tiny_num_layers,
        hidden_size=m.tiny_hidden_size,
        intermediate_size=m.tiny_intermediate_size,
    )
    if m.get("tiny_tokenizer", "char") == "qwen3":  # Qwen3's tokenizer format + template
        if m.tiny_family != "qwen3":
            raise ValueError("model.tiny_tokenizer='qwen3' needs model.tiny_family='qwen3'")
        return tiny_model.qwen3_config(
            **shape, tie_word_embeddings=not m.get("tiny_never_stop", False)
        )
    return tiny_model.tiny_config(m.tiny_family, **shape)


def check_tiny_model_dir(config, workdir: str) -> None:
    """A workdir's tiny model must be the one the config asks for (resume never mixes shapes).

    Resuming reuses <workdir>/model and its checkpoints; a workdir made by an older or
    different config would otherwise resume a model of another shape, or skip training
    because its step counter is already past the new config's end.
    """
    path = os.path.join(workdir, "model")
    if config.model.hf_dir or not os.path.exists(os.path.join(path, "config.json")):
        return
    have = ModelConfig.from_hf_dir(path)
    want = _tiny_config(config)
    diff = [
        f"{f}: {getattr(have, f)} in the workdir, {getattr(want, f)} in the config"
        for f in ("family", "num_layers", "hidden_size", "intermediate_size")
        if getattr(have, f) != getattr(want, f)
    ]
    if diff:
        raise ValueError(
            f"{workdir} holds a run of a different tiny model ({'; '.join(diff)}); "
            "use a new --workdir (or delete this one) to start over"
        )


def prepare_model_dir(config, workdir: str) -> str:
    """config.model.hf_dir, or a tiny random model written once into <workdir>/model."""
    if config.model.hf_dir:
        return config.model.hf_dir
    check_tiny_model_dir(config, workdir)
    path = os.path.join(workdir, "model")
    # Several processes share the workdir: one writes the model, all read it after.
    if distributed.is_leader() and not os.path.exists(os.path.join(path, "config.json")):
        tiny_model.make_tiny_model(
            path,
            _tiny_config(config),
            seed=config.seed,
            tokenizer=config.model.get("tiny_tokenizer", "char"),
            never_stop=config.model.get("tiny_never_stop", False),
        )
    distributed.barrier(f"tiny_model:{os.path.abspath(path)}")
    return path
