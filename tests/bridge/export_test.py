"""bridge.export: a real learner checkpoint -> HF dir that transformers and vLLM load.

The checkpoint comes from the learner itself (`learner_jax.train.run`, two SFT steps on a
2x2x2 mesh of the 8 virtual CPU devices, so the params are trained and saved sharded);
the export runs as the contract command in a subprocess with one device. The reference
is the learner's own Flax forward on its in-memory params; transformers (and, in the
slow test, vLLM) score the exported directory independently.
"""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from bridge import export
from bridge.model import hf_files, layouts, tiny_model
from bridge.model.config import ModelConfig
from learner_jax import train
from learner_jax.model import model, sharding
from learner_jax.training import checkpoint, optim, train_state
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Right-padded rows of different lengths (char tokenizer: 0 = pad, 1 = bos).
TEXTS = ["1+2=3", "12*34=408 and more", "7"]


def _config():
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import test_tiny

    c = test_tiny.get_config()
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    c.checkpoint.async_save = False
    return c


@pytest.fixture(scope="module")
def learner_run(tmp_path_factory):
    """(workdir, ModelConfig, trained Flax params as numpy) of a 2-step sharded SFT run."""
    wd = str(tmp_path_factory.mktemp("learner") / "run")
    learner = train.run(_config(), wd)
    assert learner.step == 2
    return wd, learner.model_cfg, jax.device_get(learner.state.params)


def _batch():
    tok = tiny_model.char_vocab()
    rows = [[tiny_model.BOS_ID] + [tok[ch] for ch in t] for t in TEXTS]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    valid = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], valid[i, : len(r)] = r, 1
    return ids, valid


def _flax_logits(cfg, params, ids, valid):
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape) * valid
    return np.asarray(model.Transformer(cfg).apply({"params": params}, ids, pos, valid))


def _hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _hf_logits(path, ids, valid):
    with torch.no_grad():
        out = _hf_model(path)(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(valid).long(),
        )
    return out.logits.float().numpy()


def _run_cli(*args):
    env = xla_env.child_env(JAX_PLATFORMS="cpu")  # one device: no mesh needed
    cmd = [sys.executable, "-m", "bridge.export", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_cli_export_matches_learner_forward(learner_run, tmp_path):
    wd, cfg, params = learner_run
    ckpt_dir, out = checkpoint.checkpoint_dir(wd), str(tmp_path / "hf")
    # The learner left its config + tokenizer beside the checkpoints; the export uses them.
    assert export.find_model_files(ckpt_dir) == os.path.join(ckpt_dir, export.MODEL_FILES_SUBDIR)
    p = _run_cli(f"--checkpoint_dir={ckpt_dir}", f"--output_dir={out}", "--max_shard_size=150KB")
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["step"] == 2 and result["dtype"] == "float32"

    # Sharded as asked, and the index describes exactly the files and tensors written.
    index = json.load(open(os.path.join(out, hf_files.SAFETENSORS_INDEX)))
    assert set(index["weight_map"]) == set(layouts.hf_shapes(cfg))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == result["files"]
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == files
    sizes = [os.path.getsize(os.path.join(out, f)) for f in files]
    assert max(sizes) < 150_000 + 10_000  # plus the JSON header
    nbytes = sum(int(np.prod(s)) * 4 for s in layouts.hf_shapes(cfg).values())
    assert index["metadata"]["total_size"] == nbytes
    assert ModelConfig.from_hf_dir(out) == cfg
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert os.path.isfile(os.path.join(out, name))

    # The export holds the trained weights, not the initial ones of <workdir>/model.
    ids, valid = _batch()
    ref = _flax_logits(cfg, params, ids, valid)
    init = _hf_logits(os.path.join(wd, "model"), ids, valid)
    got = _hf_logits(out, ids, valid)
    m = valid.astype(bool)
    assert np.abs(init[m] - ref[m]).max() > 1e-2
    np.testing.assert_allclose(got[m], ref[m], atol=1e-4, rtol=0)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.pad_token_id == tiny_model.PAD_ID and tok.eos_token_id == tiny_model.EOS_ID
    assert (
        tok(TEXTS[1], add_special_tokens=False)["input_ids"]
        == ids[1, 1 : len(TEXTS[1]) + 1].tolist()
    )


def test_bfloat16_export_is_the_rounded_fp32_export(learner_run, tmp_path):
    wd, cfg, params = learner_run
    ckpt_dir = checkpoint.checkpoint_dir(wd)
    out = export.export(export.ExportOptions(ckpt_dir, str(tmp_path / "bf16"), dtype="bfloat16"))
    assert out["dtype"] == "bfloat16"
    with open(os.path.join(out["output_dir"], "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    assert len(out["files"]) == 1  # default 2GB shards: the tiny model fits in one
    state = _hf_model(out["output_dir"], dtype=torch.bfloat16).state_dict()
    for name, ref in layouts.flax_to_hf(cfg, params):
        got = state[name].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got, ref.astype(ml_dtypes.bfloat16), err_msg=name)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A checkpoint dir with steps 1 and 3 (different sharded params) and no model files."""
    cfg = tiny_model.tiny_config("qwen3")
    opt = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, total_steps=4))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices())
    root = tmp_path_factory.mktemp("two_steps")
    ckpt_dir = str(root / "checkpoints")
    state = train_state.create_train_state(cfg, opt, mesh, seed=1)
    params = {}
    with checkpoint.Checkpointer(ckpt_dir, checkpoint.CheckpointConfig(async_save=False)) as c:
        for step in (1, 3):
            c.save(step, state, {"phase": "rl"}, force=True)
            params[step] = jax.device_get(state.params)
            # Different weights for the next step, keeping every array's sharding.
            state = state.replace(params=jax.tree.map(lambda x: 0.5 - 2.0 * x, state.params))
    model_dir = tiny_model.make_tiny_model(str(root / "model_files"), cfg)
    return ckpt_dir, model_dir, cfg, params


def test_step_selection(two_steps, tmp_path):
    ckpt_dir, model_dir, cfg, params = two_steps
    for step, want in ((None, 3), (1, 1)):
        out = export.export(
            export.ExportOptions(ckpt_dir, str(tmp_path / f"s{step}"), step, model_dir=model_dir)
        )
        assert out["step"] == want
        state = _hf_model(out["output_dir"]).state_dict()
        for name, ref in layouts.flax_to_hf(cfg, params[want]):
            np.testing.assert_array_equal(state[name].numpy(), ref, err_msg=name)


def test_bad_requests_change_nothing(two_steps, tmp_path):
    ckpt_dir, model_dir, _, _ = two_steps

    def refused(match, **kw):
        kw = {"checkpoint_dir": ckpt_dir, "output_dir": str(tmp_path / "out"), **kw}
        kw.setdefault("model_dir", model_dir)
        with pytest.raises(export.ExportError, match=match):
            export.export(export.ExportOptions(**kw))

    refused(r"step 2 is not in .*complete steps: \[1, 3\]", step=2)
    refused("does not exist", checkpoint_dir=str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    refused("no complete checkpoint", checkpoint_dir=str(tmp_path / "empty"))
    refused("no model config found", model_dir=None)  # two_steps has no hf_model/
    refused("dtype", dtype="int8")
    llama = tiny_model.make_tiny_model(str(tmp_path / "llama"), tiny_model.tiny_config("llama"))
    refused("do not match the LlamaForCausalLM config", model_dir=llama)
    wide = tiny_model.make_tiny_model(
        str(tmp_path / "wide"), tiny_model.tiny_config(hidden_size=96)
    )
    refused(r"has shape \(128, 64\), but the model config says \(128, 96\)", model_dir=wide)
    assert not os.path.exists(tmp_path / "out")  # nothing written by any refusal

    # A non-empty output is kept unless --overwrite, and only a model dir is overwritten.
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    refused("not empty", output_dir=str(busy))
    refused("does not look like a model dir", output_dir=str(busy), overwrite=True)
    assert os.listdir(busy) == ["notes.txt"]
    first = export.export(
        export.ExportOptions(ckpt_dir, str(tmp_path / "o"), 1, model_dir=model_dir)
    )
    refused("not empty", output_dir=first["output_dir"])
    again = export.ExportOptions(ckpt_dir, first["output_dir"], model_dir=model_dir, overwrite=True)
    assert export.export(again)["step"] == 3


def test_parse_size_and_shard_plan():
    assert export.parse_size("2GB") == 2 * 10**9
    assert export.parse_size("1.5GiB") == int(1.5 * 2**30)
    assert export.parse_size("500MB") == 500 * 10**6
    assert export.parse_size("4096") == 4096
    with pytest.raises(export.ExportError):
        export.parse_size("lots")
    # In order; a tensor bigger than the limit gets a shard of its own.
    plan = export.plan_shards({"a": 4, "b": 4, "c": 10, "d": 1, "e": 5}, 8)
    assert plan == [["a", "b"], ["c"], ["d", "e"]]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_the_export(learner_run, tmp_path, extra_vllm_engine):
    """A fresh vLLM engine on the exported dir scores prompts like transformers does and
    generates (greedy) the tokens transformers ranks first."""
    from vllm import SamplingParams

    wd, cfg, params = learner_run
    out = export.export(export.ExportOptions(checkpoint.checkpoint_dir(wd), str(tmp_path / "hf")))
    ids, valid = _batch()
    prompts = [ids[i, : valid[i].sum()].tolist() for i in range(len(ids)) if valid[i].sum() > 2]
    hf = _hf_model(out["output_dir"])
    llm = extra_vllm_engine(out["output_dir"], dtype="float32", max_model_len=128).llm
    sp = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, res in zip(prompts, results, strict=True):
        gen = list(res.outputs[0].token_ids)
        assert len(gen) >= 1
        full = torch.tensor([prompt + gen])
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=full).logits[0].float(), -1).numpy()
        want = logp[np.arange(len(prompt) - 1), prompt[1:]]
        got = [res.prompt_logprobs[j][t].logprob for j, t in enumerate(prompt) if j > 0]
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
        for j, t in enumerate(gen):  # each greedy token is transformers' argmax (to 1e-3)
            row = logp[len(prompt) - 1 + j]
            assert row[t] >= row.max() - 1e-3, (j, t, int(row.argmax()))


def test_model_files_are_found_and_copied_without_weights(tmp_path):
    src = tiny_model.make_tiny_model(str(tmp_path / "src"))
    (tmp_path / "src" / "model.safetensors.index.json").write_text("{}")
    ckpt = tmp_path / "run" / "checkpoints"
    with pytest.raises(export.ExportError, match="no model config found"):
        export.find_model_files(str(ckpt))
    # Fallback for checkpoints without a copy: the learner's <workdir>/model.
    fallback = tiny_model.make_tiny_model(str(tmp_path / "run" / "model"))
    assert export.find_model_files(str(ckpt)) == fallback

    dest = export.save_model_files(src, str(ckpt))
    assert dest == str(ckpt / export.MODEL_FILES_SUBDIR)
    assert export.find_model_files(str(ckpt)) == dest  # the copy wins over the fallback
    assert export.find_model_files(str(ckpt), model_dir=src) == src  # and --model_dir over both
    want = {"config.json", "generation_config.json", "tokenizer.json"}
    want |= {"tokenizer_config.json", "special_tokens_map.json"}
    assert set(os.listdir(dest)) == want  # no weights, no weight index
    # Saving again replaces the copy (a resumed run with another hf_dir) and leaves no debris.
    os.remove(os.path.join(src, "generation_config.json"))
    export.save_model_files(src, str(ckpt))
    assert set(os.listdir(dest)) == want - {"generation_config.json"}
    assert sorted(os.listdir(ckpt)) == [export.MODEL_FILES_SUBDIR]

    os.remove(os.path.join(dest, "tokenizer.json"))
    os.remove(os.path.join(dest, "tokenizer_config.json"))
    with pytest.raises(export.ExportError, match="no tokenizer files"):
        export.find_model_files(str(ckpt))
    with pytest.raises(FileNotFoundError):
        export.save_model_files(str(tmp_path / "nothing"), str(ckpt))
