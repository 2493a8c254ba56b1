"""The mutation-testing wiring (bench/mutants.py), without a mutation run: the targets file
names modules and test files that exist, every equivalents entry names a target module, the
generated mutmut configuration parses, and the report scores a small result as mutmut writes
it (exit codes, diffs), equivalents and stale equivalents included."""

import ast
import tomllib

from bench import mutants

DIFF_SURVIVOR = """--- bridge/contracts/pass_at_k.py
+++ bridge/contracts/pass_at_k.py
@@ -3,4 +3,4 @@
     values = [pass_at_k(n, c, k) for n, c in counts]
     if not values:
         raise ValueError("pass@k of no prompts")
-    return sum(values) / len(values)
+    return sum(values) * len(values)"""

DIFF_EQUIVALENT = """--- bridge/contracts/pass_at_k.py
+++ bridge/contracts/pass_at_k.py
@@ -2,7 +2,7 @@
-    if n - c < k:  # every k-subset holds a correct sample
+    if n + c < k:  # every k-subset holds a correct sample"""


def test_targets_name_existing_modules_and_test_files():
    targets, skip_lines = mutants.load_targets()
    assert targets and skip_lines
    for module, tests in targets.items():
        assert (mutants.REPO / module).is_file(), module
        assert module.split("/")[0] in mutants.PACKAGES, module  # mutmut copies only these
        assert tests, module
        for t in tests:
            assert (mutants.REPO / t).is_file(), t
            assert t.startswith("tests/") and t.endswith("_test.py"), t


def test_equivalents_name_target_modules_and_give_reasons():
    targets, _ = mutants.load_targets()
    prefixes = {mutants.module_name(m) + "." for m in targets}
    for name, entry in mutants.load_equivalents().items():
        assert any(name.startswith(p) for p in prefixes), name
        assert "__mutmut_" in name and entry["mutation"].strip() and entry["reason"].strip()


def test_restricted_runs_name_existing_functions_and_select_only_theirs():
    targets, _ = mutants.load_targets()
    for module, functions in mutants.load_functions().items():
        assert module in targets and functions, module
        tree = ast.parse((mutants.REPO / module).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
            f"{c.name}.{n.name}"
            for c in tree.body
            if isinstance(c, ast.ClassDef)
            for n in c.body
            if isinstance(n, ast.FunctionDef)
        }
        assert set(functions) <= defined, sorted(set(functions) - defined)
    m = "learner_jax/training/losses.py"
    pats = mutants.mutant_patterns(m, ["_k3", "LossConfig.correction"])
    codes = {
        "learner_jax.training.losses.x__k3__mutmut_1": 1,
        "learner_jax.training.losses.x__k3_other__mutmut_1": 0,  # another function's prefix
        "learner_jax.training.losses.xǁLossConfigǁcorrection__mutmut_2": 0,
        "learner_jax.training.losses.x_grpo_loss__mutmut_1": None,
    }
    assert mutants.selected(codes, pats) == {
        "learner_jax.training.losses.x__k3__mutmut_1": 1,
        "learner_jax.training.losses.xǁLossConfigǁcorrection__mutmut_2": 0,
    }
    assert mutants.selected(codes, []) == codes


def test_generated_mutmut_config_parses():
    targets, skip_lines = mutants.load_targets()
    module, tests = next(iter(targets.items()))
    cfg = tomllib.loads(mutants.mutmut_config(module, tests, skip_lines))["tool"]["mutmut"]
    assert cfg["only_mutate"] == [module]
    assert cfg["pytest_add_cli_args_test_selection"] == tests
    assert cfg["do_not_mutate_patterns"] == skip_lines


def test_report_scores_a_small_result():
    module = "bridge/contracts/pass_at_k.py"
    name = mutants.module_name(module)
    codes = {
        f"{name}.x_pass_at_k__mutmut_1": 1,  # killed
        f"{name}.x_pass_at_k__mutmut_2": 24,  # SIGXCPU: a timeout is caught
        f"{name}.x_pass_at_k__mutmut_9": 0,  # survived, listed as equivalent
        f"{name}.x_mean_pass_at_k__mutmut_12": 0,  # survived
        f"{name}.x_parse_ks__mutmut_3": 33,  # no selected test reaches it
    }
    diffs = {
        f"{name}.x_pass_at_k__mutmut_9": DIFF_EQUIVALENT,
        f"{name}.x_mean_pass_at_k__mutmut_12": DIFF_SURVIVOR,
        f"{name}.x_parse_ks__mutmut_3": "",
    }
    eq = {
        f"{name}.x_pass_at_k__mutmut_9": {
            "mutation": "if n + c < k:  # every k-subset holds a correct sample",
            "reason": "r",
        }
    }
    row = mutants.summarize_module(module, codes, eq, diffs)
    assert (row["total"], row["killed"], row["timeout"]) == (5, 1, 1)
    assert (row["survived"], row["no_tests"], row["equivalent"]) == (1, 1, 1)
    assert row["survivor_rate"] == 0.5  # 2 of the 4 non-equivalent mutants
    source = (mutants.REPO / module).read_text().splitlines()
    surv = row["survivors"][0]
    assert surv["mutation"] == "return sum(values) * len(values)"
    assert source[surv["line"] - 1].strip() == "return sum(values) / len(values)"
    assert source[row["equivalents"][0]["line"] - 1].strip().startswith("if n - c < k:")

    # The same name pointing at another mutation (the code moved): the entry no longer applies.
    moved = {f"{name}.x_pass_at_k__mutmut_9": {"mutation": "if n - c <= k:", "reason": "r"}}
    row2 = mutants.summarize_module(module, codes, moved, diffs)
    assert row2["equivalent"] == 0 and row2["survived"] == 2
    assert row2["stale_equivalents"] == [f"{name}.x_pass_at_k__mutmut_9"]

    row.update(tests=["t.py"], wall_s=1.0)
    result = {"headline": mutants.headline([row]), "rows": [row]}
    assert result["headline"]["survivor_rate"] == 0.5
    assert result["headline"]["survivor_rate_by_module"] == {module: 0.5}
    md = mutants.render_markdown(result)
    assert f"`{module}:{surv['line']}`" in md and "return sum(values) * len(values)" in md
    # A rerun keeps the earlier run's rate as `before` (2 survivors of 4 scored mutants).
    before = mutants.previous_run({**row, "tests": ["old_test.py"]})
    assert before == {"survivor_rate": 0.5, "survivors": 2, "scored": 4, "tests": ["old_test.py"]}
    md = mutants.render_markdown({**result, "rows": [{**row, "before": before}]})
    assert "| 50.0% | 50.0% (2/4) with `old_test.py` | 1 |" in md


def test_unknown_exit_codes_are_not_survivors():
    assert mutants.status_of(1) == "killed" and mutants.status_of(0) == "survived"
    assert mutants.status_of(-24) == "timeout" and mutants.status_of(77) == "suspicious"
