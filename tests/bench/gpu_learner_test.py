"""bench.gpu_learner's reduced form end to end on CPU (its wiring: headline keys, MFU from
the rows' own numbers, nulls that say why, the attention references), and the per-layer
extrapolation its full form relies on."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from float_tolerance import EPS32, ULPS

from bench import gpu_learner, step_cost
from tests import xla_env

EPS_BF16 = 2.0**-7  # bfloat16's machine epsilon (8-bit significand)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_reduced(out, *flags):
    # One CPU device, with the suite's compile-time flags: this checks wiring, and every
    # train-step compile otherwise costs several seconds of the suite's two cores.
    env = xla_env.child_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_learner", "--reduced", f"--out={out}", *flags],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    return run_reduced(tmp_path_factory.mktemp("gpu_learner") / "out.json")


def rows_of(result, kind):
    return [r for r in result["rows"] if r["kind"] == kind]


def test_headline_keys_and_the_printed_table(reduced):
    result, stdout = reduced
    h = result["headline"]
    for key in ("mfu_0p6b", "mfu_1p7b", "cudnn_attention_max_rel_err", "peak_gb_8k_0p6b"):
        assert key in h
    for kind in ("memory", "matmul", "mfu", "attention", "publish"):
        assert f"[{kind}]" in stdout
    assert h["reduced"] is True and "headline" in stdout
    assert result["complete"] and not rows_of(result, "error")


def test_mfu_is_model_flops_over_step_time_over_the_measured_matmul(reduced):
    result, _ = reduced
    h = result["headline"]
    (matmul,) = rows_of(result, "matmul")
    assert matmul["tflops"] > 0 and h["matmul_tflops"] == matmul["tflops"]
    for name in ("0p6b", "1p7b"):
        (row,) = [r for r in rows_of(result, "mfu") if r["model"] == name]
        cfg = gpu_learner.model_config(name, row["layers"], reduced=True)
        flops = step_cost.model_flops_per_step(cfg, row["batch"], row["seq_len"])
        assert row["model_tflops_per_step"] == pytest.approx(flops / 1e12, rel=1e-12)
        assert row["step_s"] > 0 and math.isfinite(row["loss"])
        want = flops / row["step_s"] / (matmul["tflops"] * 1e12)
        assert h[f"mfu_{name}"] == pytest.approx(want, rel=1e-12)
        assert h[f"mfu_{name}_vs_spec"] is None  # no spec peak for a CPU
    # the 1.7B preset is the wider one (4x the per-layer matmul FLOPs at 1/16 width too)
    by = {r["model"]: r["model_tflops_per_step"] for r in rows_of(result, "mfu")}
    assert by["1p7b"] > by["0p6b"]


def test_nulls_say_why(reduced):
    result, _ = reduced
    h = result["headline"]
    notes = " ".join(h["notes"])
    assert h["cudnn_attention_max_rel_err"] is None and "cuDNN" in notes
    assert h["peak_gb_8k_0p6b"] is None and "no allocator statistics" in notes
    assert "no spec peak" in notes


def test_memory_rows_give_xla_plans_growing_with_t(reduced):
    result, _ = reduced
    mem = sorted(rows_of(result, "memory"), key=lambda r: r["seq_len"])
    assert [r["seq_len"] for r in mem] == [64, 128]
    for r in mem:
        assert r["peak_device_gb"] is None and "no allocator statistics" in r["peak_source"]
    assert 0 < mem[0]["xla_plan_gb"] < mem[1]["xla_plan_gb"]


def test_attention_paths_against_float64(reduced):
    result, _ = reduced
    h = result["headline"]
    att = {r["arm"]: r for r in rows_of(result, "attention")}
    # fp32 XLA vs the float64 numpy forward and backward: rounding only
    assert 0 < h["xla_fp32_vs_float64_max_rel_err"] <= ULPS * EPS32
    assert h["reference_vs_float64_max_rel_err"] == att["reference_fp32"]["max_rel_err_vs_float64"]
    assert 0 < h["reference_vs_float64_max_rel_err"] <= ULPS * EPS32
    # bf16 arms: off by bf16 rounding (inputs are exact in bf16; outputs and probabilities
    # are rounded), so clearly above fp32 rounding and within a few bf16 epsilons
    for arm in ("xla_bf16", "blockwise_bf16"):
        assert ULPS * EPS32 < att[arm]["max_rel_err_vs_float64"] <= 4 * EPS_BF16
    assert h["xla_bf16_attention_max_rel_err"] == att["xla_bf16"]["max_rel_err"]
    assert "cuDNN" in att["cudnn_bf16"]["skipped"]


def test_publish_rows(reduced):
    result, _ = reduced
    pub = rows_of(result, "publish")
    assert [r["version"] for r in pub] == [1, 2]
    cfg = gpu_learner.model_config("0p6b", pub[0]["layers"], reduced=True)
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    params = (
        v * d
        + d
        + cfg.num_layers * (d * (n + 2 * k) * hd + n * hd * d + 3 * d * f + 2 * d + 2 * hd)
    )
    assert pub[0]["gb"] == pytest.approx(2 * params / 2**30, rel=1e-12)  # bf16 on the wire
    assert result["headline"]["publish_s_0p6b"] == pub[1]["publish_s"] > 0


def test_fit_layers_measures_or_extrapolates_a_line():
    line = {4: 3.0 + 4 * 0.25, 8: 3.0 + 8 * 0.25}
    value, extrapolated = gpu_learner.fit_layers(line, 28)
    assert extrapolated and value == pytest.approx(3.0 + 28 * 0.25, rel=1e-12)
    assert gpu_learner.fit_layers({**line, 28: 1.0}, 28) == (1.0, False)
    with pytest.raises(ValueError):
        gpu_learner.fit_layers({4: 1.0}, 28)


def test_memory_fit_extrapolates_each_length():
    rows = [{"kind": "memory", "layers": n, "seq_len": t, "peak_source": "s",
             "peak_device_gb": 1.0 + n * t / 1024, "xla_plan_gb": None}
            for n in (4, 8) for t in (1024, 8192)]  # fmt: skip
    fitted = {r["seq_len"]: r for r in gpu_learner.memory_fit(rows, 28)}
    assert fitted[8192]["peak_device_gb"] == pytest.approx(1.0 + 28 * 8, rel=1e-12)
    assert fitted[1024]["peak_device_gb"] == pytest.approx(1.0 + 28, rel=1e-12)
    assert fitted[8192]["extrapolated"] and fitted[8192]["xla_plan_gb"] is None
    assert gpu_learner.memory_fit(rows, 8) == []  # measured there: nothing to fit
    assert np.isfinite([r["peak_device_gb"] for r in fitted.values()]).all()


def test_a_failing_attention_falls_back_to_blockwise_and_says_so(tmp_path):
    # An attention the step rejects (as a GPU runtime may reject cuDNN's): the MFU is still
    # measured, with blockwise, and the row and the notes carry the failure. Only the
    # matmul and one MFU point run.
    result, _ = run_reduced(
        tmp_path / "out.json", "--attention=no_such_kernel", "--models=0p6b",
        "--memory_layers=", "--attention_seq_lens=", "--publish_models=",
    )  # fmt: skip
    (row,) = rows_of(result, "mfu")
    assert row["attention"] == "blockwise" and "no_such_kernel" in row["attention_error"]
    assert result["headline"]["mfu_0p6b"] > 0 and result["complete"]
    assert any("no_such_kernel" in note for note in result["headline"]["notes"])
