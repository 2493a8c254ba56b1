"""Export a learner checkpoint as an HF model directory (transformers and vLLM load it).

    python -m bridge.export --checkpoint_dir=WORKDIR/checkpoints [--step=N] \
        --output_dir=DIR [--dtype=bfloat16] [--max_shard_size=2GB] [--model_dir=HF_DIR]
        [--merge (default) | --adapter_only] [--base_dir=HF_DIR]   (LoRA checkpoints)

Reads only `state/params` of one orbax step (latest by default) as host numpy arrays --
no optimizer state, no mesh, any number of devices -- converts them with the
`bridge.model.layouts` table and writes `model-0000k-of-0000n.safetensors` shards plus
`model.safetensors.index.json` (`weight_map`, `metadata.total_size`), next to the
config.json and tokenizer files of the model the learner was trained from.

Where those files come from: the learner copies the non-weight files of its HF
directory into `<checkpoint_dir>/hf_model/` when it starts (`save_model_files`), so a
checkpoint directory is self-contained even when `model.hf_dir` pointed elsewhere or
has moved. Checkpoints written without that copy fall back to `<workdir>/model` (the
tiny model `learner_jax.model.model_dir.prepare_model_dir` writes); `--model_dir` overrides both.

Everything is checked (step exists, files present, every parameter's shape matches the
config) before anything is written; the directory is assembled beside the output and
renamed into place, so a failed export leaves the output as it was. numpy only at
module level: orbax (and so jax) is imported inside `restore_params`. A LoRA run's checkpoint
(adapters only) is merged into its base or written as a PEFT adapter (bridge/adapters/merge.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping

import numpy as np

from bridge.adapters import merge as lora_merge
from bridge.adapters import peft_layout
from bridge.model import dtypes, hf_files, layouts
from bridge.model.config import ModelConfig

MODEL_FILES_SUBDIR = "hf_model"


class ExportError(ValueError):
    """The export was refused; nothing was written."""


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    checkpoint_dir: str
    output_dir: str
    step: int | None = None  # None = latest complete step
    dtype: str | None = None  # None = the checkpoint's parameter dtype
    max_shard_bytes: int = 2 * 10**9
    model_dir: str | None = None  # HF dir with config + tokenizer; None = found (see above)
    overwrite: bool = False  # replace an existing export (a dir holding config.json)
    adapter_only: bool = False  # LoRA checkpoint: write the PEFT adapter, not a merged model
    base_dir: str | None = None  # LoRA: the base HF dir; None = the checkpoint's reference

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in dtypes.WEIGHT_DTYPES:
            raise ExportError(f"dtype {self.dtype!r} not in {sorted(dtypes.WEIGHT_DTYPES)}")
        if self.max_shard_bytes <= 0:
            raise ExportError(f"max_shard_bytes must be > 0, got {self.max_shard_bytes}")


# -- model files (config + tokenizer) ----------------------------------------------------
def save_model_files(hf_dir: str, checkpoint_dir: str) -> str:
    """Copy the non-weight files of `hf_dir` into `<checkpoint_dir>/hf_model` (atomically)."""
    if not os.path.isfile(os.path.join(hf_dir, hf_files.CONFIG)):
        raise FileNotFoundError(f"{hf_dir} has no config.json")
    os.makedirs(checkpoint_dir, exist_ok=True)
    dest = os.path.join(checkpoint_dir, MODEL_FILES_SUBDIR)
    tmp = tempfile.mkdtemp(prefix=f".{MODEL_FILES_SUBDIR}-", dir=checkpoint_dir)
    try:
        # Weights (and their indices) are not copied: the export writes its own.
        for name in hf_files.model_files(hf_dir):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tmp, name))
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def find_model_files(checkpoint_dir: str, model_dir: str | None = None) -> str:
    """The directory whose config.json and tokenizer files describe the checkpoint."""
    candidates = (
        [model_dir]
        if model_dir
        else [
            os.path.join(checkpoint_dir, MODEL_FILES_SUBDIR),
            os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)), "model"),
        ]
    )
    for path in candidates:
        if os.path.isfile(os.path.join(path, hf_files.CONFIG)):
            if not hf_files.has_tokenizer(path):
                raise ExportError(f"{path} has a config.json but no tokenizer files")
            return path
    raise ExportError(
        f"no model config found for {checkpoint_dir} (looked for config.json in "
        f"{candidates}); pass --model_dir=<HF dir the learner was trained from>"
    )


# -- checkpoint -------------------------------------------------------------------------
def checkpoint_steps(checkpoint_dir: str) -> list[int]:
    """Complete steps of a learner checkpoint directory, ascending."""
    import orbax.checkpoint as ocp

    if not os.path.isdir(checkpoint_dir):
        raise ExportError(f"checkpoint directory {checkpoint_dir} does not exist")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with ocp.CheckpointManager(os.path.abspath(checkpoint_dir), options=options) as mngr:
        return sorted(int(s) for s in mngr.all_steps())


def resolve_step(checkpoint_dir: str, step: int | None) -> int:
    steps = checkpoint_steps(checkpoint_dir)
    if not steps:
        raise ExportError(f"no complete checkpoint in {checkpoint_dir}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ExportError(f"step {step} is not in {checkpoint_dir}; complete steps: {steps}")
    return step


def restore_params(checkpoint_dir: str, step: int) -> dict:
    """The Flax parameter tree of `step` as host numpy arrays (nothing else is read)."""
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(checkpoint_dir), str(step), "state")
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    if "params" not in tree:
        raise ExportError(f"{path} holds no 'params' item (keys: {sorted(tree)})")
    meta = tree["params"]
    # restore_type=np.ndarray: each array is read whole onto the host, whatever mesh
    # (and device count) it was saved from; partial_restore skips the optimizer state.
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    out = ckptr.restore(
        path,
        args=ocp.args.PyTreeRestore(
            item={"params": meta}, restore_args={"params": as_numpy}, partial_restore=True
        ),
    )
    return out["params"]


# -- safetensors ------------------------------------------------------------------------
def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped in order into shards of at most `max_bytes` (a bigger tensor: alone)."""
    shards: list[list[str]] = []
    used = max_bytes
    for name, n in sizes.items():
        if used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def _flax_paths(tree, prefix=()) -> set[tuple[str, ...]]:
    if not isinstance(tree, Mapping):
        return {prefix}
    return set().union(*(_flax_paths(v, (*prefix, k)) for k, v in tree.items()))


def _check_paths(cfg: ModelConfig, params: Mapping, what: str, model_dir: str) -> None:
    want = {row.flax_path for row in layouts.table(cfg)}
    have = _flax_paths(params)
    if want != have:
        missing = ["/".join(p) for p in sorted(want - have)]
        extra = ["/".join(p) for p in sorted(have - want)]
        raise ExportError(
            f"{what} do not match the {cfg.architecture} config of {model_dir}: "
            f"missing {missing[:4]} ({len(missing)}), unexpected {extra[:4]} ({len(extra)})"
        )


def _hf_config(model_dir: str, dtype: str) -> dict:
    with open(os.path.join(model_dir, hf_files.CONFIG)) as f:
        hf = json.load(f)
    hf["torch_dtype"] = dtype  # transformers < 5 and vLLM read this one
    hf["dtype"] = dtype  # transformers >= 5
    return hf


def write_hf_dir(
    path: str,
    cfg: ModelConfig,
    params: Mapping,
    dtype: str,
    model_dir: str,
    index_meta: dict,
    max_shard_bytes: int,
) -> dict:
    """Write shards, index, config and tokenizer files into the (empty) dir `path`.

    Shards are planned from the architecture's shapes and converted one shard at a time,
    so the host holds the restored params plus one shard, not a second copy of the model.
    """
    from safetensors.numpy import save_file

    rows = {row.hf_name: row for row in layouts.table(cfg)}
    itemsize = dtypes.itemsize(dtype)
    sizes = {n: int(np.prod(row.hf_shape)) * itemsize for n, row in rows.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    weight_map = {}
    for k, names in enumerate(shards):
        tensors = {}
        for name in names:
            row = rows[name]
            arr = row.transform.to_hf(np.asarray(layouts.get_leaf(params, row.flax_path)))
            if tuple(arr.shape) != row.hf_shape:
                raise ExportError(
                    f"checkpoint tensor {name} has shape {tuple(arr.shape)}, but the model "
                    f"config says {row.hf_shape}: the config files are not this model's"
                )
            tensors[name] = np.ascontiguousarray(arr, dtype=dtypes.WEIGHT_DTYPES[dtype])
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        os.chmod(os.path.join(path, fname), 0o644)  # safetensors writes 0600
        weight_map.update(dict.fromkeys(names, fname))
        del tensors
    index = {
        "metadata": {"total_size": sum(sizes.values()), **index_meta},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, hf_files.SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
    for name in hf_files.model_files(model_dir):
        if name != hf_files.CONFIG:  # written below, with the export's dtype
            shutil.copyfile(os.path.join(model_dir, name), os.path.join(path, name))
    with open(os.path.join(path, hf_files.CONFIG), "w") as f:
        json.dump(_hf_config(model_dir, dtype), f, indent=2)
    return index


def _check_output(opts: ExportOptions) -> None:
    out = opts.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"output {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not opts.overwrite:
            raise ExportError(f"output dir {out} is not empty (pass --overwrite to replace it)")
        if not os.path.isfile(os.path.join(out, "config.json")):
            # --overwrite deletes the directory: only ever one that holds a model.
            raise ExportError(f"refusing to overwrite {out}: it does not look like a model dir")


def export(opts: ExportOptions) -> dict:
    """Run the export; returns {"step", "output_dir", "dtype", "files", "total_size"}."""
    _check_output(opts)
    step = resolve_step(opts.checkpoint_dir, opts.step)
    model_dir = find_model_files(opts.checkpoint_dir, opts.model_dir)
    cfg = ModelConfig.from_hf_dir(model_dir)
    params = restore_params(opts.checkpoint_dir, step)
    if lora_merge.is_adapter_tree(params):  # a LoRA run: merge, or the adapter alone
        ref = lora_merge.restore_reference(opts.checkpoint_dir, step)
        if opts.adapter_only:
            return _export_adapter(opts, step, params, ref)
        try:
            params = lora_merge.merged_flax_params(cfg, params, ref, opts.base_dir)
        except (OSError, ValueError) as e:
            raise ExportError(f"cannot merge the adapters of step {step}: {e}") from e
    elif opts.adapter_only:
        raise ExportError(f"step {step} is a full-weight checkpoint: no adapter to export")
    _check_paths(cfg, params, f"step {step}'s parameters", model_dir)
    dtype = opts.dtype or np.asarray(params["embed"]["embedding"]).dtype.name
    if dtype not in dtypes.WEIGHT_DTYPES:
        raise ExportError(
            f"checkpoint parameters are {dtype}; pass --dtype={sorted(dtypes.WEIGHT_DTYPES)}"
        )

    out = os.path.abspath(opts.output_dir)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-export-", dir=parent)
    try:
        meta = {"step": step}
        index = write_hf_dir(tmp, cfg, params, dtype, model_dir, meta, opts.max_shard_bytes)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if os.path.isdir(out):
            shutil.rmtree(out)  # empty, or an old export allowed by --overwrite
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "step": step,
        "output_dir": out,
        "dtype": dtype,
        "files": sorted(set(index["weight_map"].values())),
        "total_size": index["metadata"]["total_size"],
    }


def _export_adapter(opts: ExportOptions, step: int, params: Mapping, ref: Mapping) -> dict:
    """Write the PEFT adapter directory (bridge/adapters/merge.py), atomically."""
    if os.path.isdir(opts.output_dir) and os.listdir(opts.output_dir):
        raise ExportError(f"output dir {opts.output_dir} is not empty")
    tensors = lora_merge.peft_tensors(params)
    out = os.path.abspath(opts.output_dir)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-export-", dir=os.path.dirname(out))
    try:
        peft_layout.write_adapter_dir(tmp, tensors, lora_merge.adapter_config_for(ref, tensors))
        os.chmod(tmp, 0o755)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = [peft_layout.WEIGHTS_FILE, peft_layout.CONFIG_FILE]
    size = sum(int(v.nbytes) for v in tensors.values())
    return {"step": step, "output_dir": out, "dtype": "float32", "files": files, "total_size": size}


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1.5GiB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text.upper().replace("IB", "iB"))
    if not m:
        raise ExportError(f"cannot parse size {text!r} (e.g. 2GB, 500MB, 1GiB, 4096)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_"))


def main(argv):
    del argv
    from absl import flags

    f = flags.FLAGS
    if not f.merge and not f.adapter_only:
        sys.exit("export failed: --nomerge needs --adapter_only (nothing else to write)")
    try:
        result = export(
            ExportOptions(
                checkpoint_dir=f.checkpoint_dir,
                output_dir=f.output_dir,
                step=f.step,
                dtype=f.dtype or None,
                max_shard_bytes=parse_size(f.max_shard_size),
                model_dir=f.model_dir or None,
                overwrite=f.overwrite,
                adapter_only=f.adapter_only,
                base_dir=f.base_dir or None,
            )
        )
    except ExportError as e:
        sys.exit(f"export failed: {e}")
    print(json.dumps(result))


def _define_flags():
    from absl import flags

    flags.DEFINE_string("checkpoint_dir", None, "Learner checkpoint dir.", required=True)
    flags.DEFINE_string("output_dir", None, "HF directory to write.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
    flags.DEFINE_enum(
        "dtype", "", [""] + sorted(dtypes.WEIGHT_DTYPES), "Weights dtype ('' = checkpoint's)."
    )
    flags.DEFINE_string("max_shard_size", "2GB", "Largest safetensors shard, e.g. 500MB.")
    flags.DEFINE_string("model_dir", "", "HF dir with config/tokenizer ('' = found).")
    flags.DEFINE_bool("overwrite", False, "Replace an existing export in output_dir.")
    flags.DEFINE_bool("merge", True, "LoRA checkpoint: merge the adapters into the base.")
    flags.DEFINE_bool("adapter_only", False, "LoRA checkpoint: write only the PEFT adapter.")
    flags.DEFINE_string("base_dir", "", "LoRA: base HF dir ('' = the checkpoint's reference).")


def cli() -> None:
    """`echo2-export` (pyproject's scripts): the same as `python -m bridge.export`."""
    from absl import app

    _define_flags()
    app.run(main)


if __name__ == "__main__":
    cli()
