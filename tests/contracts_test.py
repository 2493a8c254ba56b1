"""The fixed names users and checks rely on (the design notes' "Contracts"), checked fast.

Every named `python -m` command is a runnable module (an `if __name__ == "__main__"` block
or a package `__main__.py`) that defines its named flags; every named config key is in
the default config (configs/tiny_arith.py); every bench that writes the
`{"headline": {...}, "rows": [...]}` form writes the named headline keys. Nothing heavy
runs: flags are read from the source (argparse `add_argument("--x")` and absl
`DEFINE_*("x")` in the module and in what its main block imports), so the check costs
no import of jax, torch or vLLM.

Names being built elsewhere are listed as expected-later (xfail, not strict, with the
reason): they start passing when they land, and stay visible until then.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def later(reason: str):
    return pytest.mark.xfail(strict=False, reason=f"expected later: {reason}")


def gap(reason: str):
    return pytest.mark.xfail(strict=False, reason=f"known gap, not fixed yet: {reason}")


COMMANDS = [
    ("learner_jax.train", ("config", "workdir")),
    ("rollout_gpu.worker", ("controller", "token_file")),
    ("bridge.export", ("checkpoint_dir", "step", "output_dir")),
    ("bench.broadcast", ("out",)),
    ("bench.activation", ("out",)),
    ("bench.chaos", ("out",)),
    ("bridge.plan", ("fleet", "out")),
    ("bench.delta", ("out",)),
    ("bench.controller_load", ("sweep", "out")),
    ("bench.eval", ("out",)),
    ("bench.staleness_sweep", ("out",)),
    ("bench.lora", ("out",)),
    ("bench.memory", ("out",)),
    ("learner_jax.evaluate", ("checkpoint_dir", "hf_dir", "eval_file", "n", "k")),
    ("bench.verify_cost", ("out",)),
    ("bench.moe", ("out",)),
    pytest.param("bench.async_bias", ("out",), marks=later("bench.async_bias")),
    ("bench.gpu_learner", ("out",)),
    ("bench.broadcast", ("netns", "out")),
]

CONFIG_KEYS = [
    *"total_steps staleness publish_every local_workers model.hf_dir optimizer.learning_rate"
    " task.name seed controller.host controller.port controller.token_file".split(),
    *"bridge.broadcast task.reward_fn distributed.coordinator_address"
    " distributed.num_processes distributed.process_id".split(),
    *"bridge.delta.enabled bridge.delta.anchor_every bridge.delta.max_density eval.on eval.n"
    " eval.temperature task.eval_file task.thinking rollout.temperature rollout.top_p"
    " rollout.top_k rollout.min_p loss.off_policy learner.lora.rank learner.lora.alpha"
    " learner.lora.target_modules learner.lora.dropout model.logprob_chunk"
    " controller.tls_cert controller.tls_key controller.allow_plain_http"
    " metrics.wandb.project metrics.wandb.entity metrics.wandb.mode fleet.provisioner".split(),
    pytest.param("rollout.partial", marks=later("rollout.partial (off|continue)")),
    "staleness_min",
    "staleness_max",
    "controller.trusted_proxies",
    "model.moe.routing_replay",
]

# bench -> (the module that writes its JSON, the headline keys; None: `rows` only)
HEADLINES = [
    ("bench.delta", "bench.delta", None),  # keys per learning rate: test_bench_delta_...
    ("bench.lora", "bench.lora", ("bytes_ratio", "parity_ok", "swap_vs_full")),
    ("bench.memory", "bench.memory", ("exponent_auto", "peak_gb_8k_auto", "measured_8k")),
    (
        "bench.eval",
        "bench.eval",
        ("kv_speedup", "same_answers", "fleet_vs_learner_tokens_per_s"),
    ),
    (
        "bench.controller_load --sweep",
        "bench.controller_sweep",
        (
            "p99_ms_2000",
            "p99_ms_500_fast",
            "submissions_per_s_500_fast",
            "audit_clean",
            "errors_5xx",
        ),
    ),
    ("bench.staleness_sweep", "bench.staleness_sweep", None),
    pytest.param(
        "bench.verify_cost",
        "bench.verify_cost",
        ("sampler_tokens_per_s_ratio", "honest_mismatch_rate"),
    ),
    (
        "bench.moe",
        "bench.moe",
        ("moe_vs_dense_active_time", "ep_sharded_equals_single", "replay_kl_ratio"),
    ),
    pytest.param("bench.async_bias", "bench.async_bias", None, marks=later("bench.async_bias")),
    ("bench.gpu_learner", "bench.gpu_learner", None),
    (
        "bench.broadcast --netns",
        "bench.broadcast",
        ("netns_chain_vs_bound", "netns_delta_time_ratio"),
    ),
]


# ------------------------------------------------------------------------- source reading


def module_file(name: str) -> pathlib.Path | None:
    base = ROOT / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(
            isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators
        )
    )


def _imported_modules(nodes) -> list[str]:
    out = []
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    return out


def _defined_flags(tree: ast.AST) -> set[str]:
    flags = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        names = [v for v in names if isinstance(v, str)]
        if fname == "add_argument":
            flags |= {v[2:] for v in names if v.startswith("--")}
        elif fname.startswith("DEFINE_") and names:
            flags.add(names[0])
    return flags


def cli(name: str) -> tuple[bool, set[str]]:
    """(runnable with `python -m`, its flags) from the source of `name` and of the project
    modules its main block imports (a binary that hands off to another module's main)."""
    path = module_file(name)
    tree = ast.parse(path.read_text())
    mains = [n for n in tree.body if _is_main_guard(n)]
    runnable = path.name == "__main__.py" or bool(mains)
    flags = _defined_flags(tree)
    if "SCHEMA.define_flags(" in path.read_text():  # flags declared in bridge/config/keys.py
        from bridge.config.keys import SCHEMA

        flags |= {SCHEMA.flag_name(k) for k in SCHEMA.flag_keys()}
    for other in _imported_modules(mains):
        other_path = module_file(other)
        if other_path is not None and other_path != path:
            flags |= _defined_flags(ast.parse(other_path.read_text()))
    return runnable, flags


def string_constants(name: str) -> set[str]:
    tree = ast.parse(module_file(name).read_text())
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def default_config():
    spec = importlib.util.spec_from_file_location("tiny_arith", ROOT / "configs/tiny_arith.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,flags", COMMANDS)
def test_command_is_a_runnable_module_with_its_flags(name, flags):
    assert module_file(name) is not None, f"python -m {name}: no module"
    runnable, defined = cli(name)
    assert runnable, f"python -m {name}: no `if __name__ == '__main__'` block"
    missing = sorted(set(flags) - defined)
    assert not missing, f"python -m {name} defines no --{', --'.join(missing)}"


def test_the_flag_reader_sees_what_argparse_and_absl_define():
    """The reader itself: a flag it does not find fails the command test above."""
    assert {"out", "prompts", "no_fleet"} <= cli("bench.eval")[1]  # argparse
    assert {"config", "workdir"} <= cli("learner_jax.train")[1]  # absl + config_flags
    assert "eval_file" in cli("learner_jax.evaluate")[1]  # its main block's eval_cli
    assert "netns_made_up" not in cli("bench.broadcast")[1]


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_default_config_has_the_key(key):
    """`--config.KEY=VALUE` on a locked config only works for keys the config has."""
    node = default_config()
    for part in key.split("."):
        assert part in node, f"configs/tiny_arith.py has no {key}"
        node = node[part]


def test_moe_config_has_routing_replay():
    path = ROOT / "configs/qwen3_moe_shaped.py"
    spec = importlib.util.spec_from_file_location("qwen3_moe_shaped", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "routing_replay" in mod.get_config().model.moe


def test_named_commands_in_pyproject():
    """Each named command points at a function of the module its `python -m` form runs
    (read from the source: importing the binaries would define their flags)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})
    named = ("train", "worker", "export", "status", "eval", "plan")
    assert {f"echo2-{n}" for n in named} <= set(scripts)
    for target in scripts.values():
        module, func = target.split(":")
        tree = ast.parse(module_file(module).read_text())
        assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, target


def test_make_mutants_target():
    assert any(line.startswith("mutants:") for line in (ROOT / "Makefile").read_text().split("\n"))


@pytest.mark.parametrize("bench,writer,keys", HEADLINES)
def test_bench_writes_the_headline_form(bench, writer, keys):
    """The writer names `rows` (and `headline` with each named key) in its JSON."""
    assert module_file(writer) is not None, f"{bench}: no module {writer}"
    consts = string_constants(writer)
    assert "rows" in consts, f"{bench} writes no 'rows'"
    if keys is not None:
        assert "headline" in consts, f"{bench} writes no 'headline'"
        missing = sorted(set(keys) - consts)
        assert not missing, f"{bench}'s headline lacks {missing}"


def test_bench_eval_headline_from_its_rows():
    """bench.eval's JSON headline (its CPU-sized run: tests/bench/eval_bench_test.py) has
    exactly the three named keys, with and without the fleet arm."""
    from bench import eval as eval_bench

    rows = [
        {"arm": "learner_kv_cache", "tokens_per_s": 500.0, "same_as_cached": 2},
        {"arm": "learner_no_cache", "tokens_per_s": 5.0, "same_as_cached": 2},
        {"arm": "fleet_vllm", "tokens_per_s": 400.0, "same_as_cached": 1},
    ]
    head = eval_bench.headline(rows, prompts=2)
    assert head == {
        "kv_speedup": 100.0,
        "same_answers": False,
        "fleet_vs_learner_tokens_per_s": 0.8,
    }
    assert eval_bench.headline(rows[:2], prompts=2)["fleet_vs_learner_tokens_per_s"] is None


def test_bench_delta_headline_keys():
    """bench.delta names its keys `bytes_ratio_lr{lr}` after its `--lrs` (default: the two
    named learning rates), beside `bit_exact` and `apply_vs_full_swap`."""
    tree = ast.parse(module_file("bench.delta").read_text())
    [lrs] = [
        n.args[1]
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "attr", "") == "DEFINE_list"
        and n.args[0].value == "lrs"
    ]
    keys = {f"bytes_ratio_lr{c.value}" for c in lrs.elts}
    assert keys == {"bytes_ratio_lr1e-6", "bytes_ratio_lr1e-5"}
    assert {"headline", "rows", "bit_exact", "apply_vs_full_swap"} <= string_constants(
        "bench.delta"
    )
