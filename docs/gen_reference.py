"""Writes the docs' reference pages from the code, so they cannot drift from it.

    python docs/gen_reference.py [--out=docs/reference]

mkdocs runs it before every build (docs/hooks.py), and tests/docs_test.py checks that what
it writes covers every config key and metric named in DESIGN.md. Four pages:

- config.md: every config key declared in bridge/config/keys.py with its default, type,
  readers and doc (and the demo config's value where it sets another), then the task options
  the configs/ files set (a task's own keys, which its constructor checks).
- metrics.md: every metric name the code puts into a metrics row (a string key `area/name`
  of a dict literal or a subscript assignment in learner_jax/ and bridge/), where it is set,
  and the comment beside it.
- cli.md: every flag of the binaries (absl `flags.DEFINE_*`, argparse `add_argument`, and
  the worker's flags declared in bridge/config/keys.py).
- protocol.md: the controller's HTTP routes and the JSON schema of every pydantic model in
  bridge/control/protocol.py (`model_json_schema`).

Everything is read from source text with `ast` (or imported where the import is light:
the config schema, ml_collections configs, pydantic models), so it needs neither jax nor torch.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "docs", "reference")
BASE_CONFIG = "configs/tiny_arith.py"
# Where optional keys are read with `.get`: the learner's side of a config.
OPTIONAL_KEY_DIRS = ("learner_jax",)
METRIC_DIRS = ("learner_jax", "bridge")
# The binaries whose flags are listed: command -> source file.
BINARIES = {
    "python -m learner_jax.train": "learner_jax/train.py",
    "python -m rollout_gpu.worker": "rollout_gpu/worker.py",
    "python -m bridge.export": "bridge/export.py",
    "python -m learner_jax.evaluate": "learner_jax/eval_cli.py",
    "python -m bridge.status": "bridge/status.py",
    "python -m bridge.plan": "bridge/plan/__main__.py",
    "python -m bridge.control.trust.identity": "bridge/control/trust/identity.py",
    "python -m bridge.fleet.skypilot": "bridge/fleet/skypilot.py",
    "python -m rollout_gpu.relay": "rollout_gpu/relay.py",
}
PROTOCOL_MODULE = "bridge.control.protocol"
ROUTE_FILES = ("bridge/control/http/service.py", "bridge/control/http/fast_routes.py")
# `area/name`, e.g. reward/mean, eval/pass@1, grad_norm/<layer>.
METRIC_RE = re.compile(r"^[a-z][a-z0-9_]*/[A-Za-z0-9_@.<>{}\-]+$")
# String keys of that shape that are not metrics (file paths, content types).
PLAIN_RE = re.compile(r"^[a-z][a-z0-9_]*$")
# Names of the dicts a learner step's metrics are built in.
METRIC_VARS = ("out", "metrics")
NOT_METRICS = re.compile(r"^(application|text|model|data|manifests|adapters)/|\.(json|py|md)$")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _cell(text) -> str:
    """One Markdown table cell: no newlines, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value) -> str:
    return "`" + _cell(repr(value) if not isinstance(value, str) else json.dumps(value)) + "`"


# -- comments beside a line -------------------------------------------------------------------


def _comments(lines: list[str], lineno: int, end_lineno: int | None = None) -> str:
    """The comment on a statement's line(s) plus the comment block directly above it."""
    above = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.append(lines[i].strip().lstrip("#").strip())
        i -= 1
    above.reverse()
    inline = []
    for j in range(lineno - 1, (end_lineno or lineno)):
        code = lines[j]
        if "#" in code and not code.strip().startswith("#"):
            inline.append(_inline_comment(code))
    parts = [p for p in (" ".join(above), " ".join(c for c in inline if c)) if p]
    return " — ".join(parts)


def _inline_comment(line: str) -> str:
    """The text after a `#` that is not inside a string literal."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[k + 1 :].strip()
    return ""


# -- config keys -------------------------------------------------------------------------------


def _load_config(rel: str):
    spec = importlib.util.spec_from_file_location(
        "_cfg_" + rel.replace("/", "_")[:-3], os.path.join(ROOT, rel)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def flatten(config, prefix: str = "") -> dict[str, object]:
    """Every leaf key of a ConfigDict as a dotted path -> its default."""
    out = {}
    for key, value in config.items():
        path = prefix + key
        if hasattr(value, "items") and hasattr(value, "to_dict"):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def config_docs(rel: str) -> dict[str, str]:
    """Dotted key -> the comments written beside `c.a.b = ...` in a config file."""
    src = _read(rel)
    lines = src.splitlines()
    docs = {}
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        path = _attr_path(node.targets[0])
        if path and path[0] == "c" and len(path) > 1:
            docs[".".join(path[1:])] = _comments(lines, node.lineno, node.end_lineno)
    return docs


def _attr_path(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def optional_keys() -> dict[str, tuple[str, str]]:
    """Keys the learner reads with `.get("key", default)` on a config section:
    dotted key -> (default as written, where). Follows simple aliases within a function
    (`e = config.get("eval")`, `r = config.rollout`)."""
    found = {}
    for rel in _py_files(OPTIONAL_KEY_DIRS):
        tree = ast.parse(_read(rel))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            alias = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    pairs = [(node.targets[0], node.value)]
                    t, v = node.targets[0], node.value
                    if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple):
                        pairs = list(zip(t.elts, v.elts, strict=False))
                    for tgt, val in pairs:
                        path = _config_path(val, alias)
                        if isinstance(tgt, ast.Name) and path is not None:
                            alias[tgt.id] = path
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    base = _config_path(node.func.value, alias)
                    if base is None:
                        continue
                    key = ".".join([*base, node.args[0].value])
                    default = ast.unparse(node.args[1]) if len(node.args) > 1 else "None"
                    found.setdefault(key, (default, f"{rel}:{node.lineno}"))
    return found


def _config_path(node, alias: dict) -> list[str] | None:
    """The config section an expression names: config.a.b, config.get("a"), or an alias."""
    if isinstance(node, ast.Name):
        if node.id in ("config", "self.config"):
            return []
        return alias.get(node.id)
    if isinstance(node, ast.Attribute):
        if _attr_path(node) == ["self", "config"]:
            return []
        base = _config_path(node.value, alias)
        return None if base is None else [*base, node.attr]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
            base = _config_path(node.func.value, alias)
            return None if base is None else [*base, str(node.args[0].value)]
    return None


def _schema():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from bridge.config import keys

    return keys


def config_page() -> tuple[str, set[str]]:
    keys = _schema()
    schema = keys.SCHEMA
    demo = flatten(_load_config(BASE_CONFIG))
    out = [
        "# Config keys",
        "",
        "Generated from the code by `docs/gen_reference.py`; do not edit. Every key of the "
        "training binary's config, declared once in `bridge/config/keys.py`: its default, its "
        "type, who reads it (a dataclass whose field it is, or the binary itself) and its doc. "
        f"The demo config `{BASE_CONFIG}` builds on these defaults; where it sets another "
        "value the *demo* column shows it. Override any key on the command line: "
        "`--config.KEY=VALUE`. A key that is not declared here, or a value of another type, "
        "is refused before the run starts.",
    ]
    covered = set()
    for section in schema.sections.values():
        rows = [k for k in schema.config_keys() if k.section == section.path]
        if section.scope != "config" or not rows:
            continue
        title = f"`{section.path}`" if section.path else "Top level"
        out += ["", f"## {title}", "", _cell(section.doc), ""]
        out += [
            "| key | default | demo | type | read by | what it is |",
            "|---|---|---|---|---|---|",
        ]
        for key in rows:
            default = "optional" if key.optional else _code(key.default)
            shown = demo.get(key.path, key.default)
            differs = key.path in demo and (
                shown != key.default or type(shown) is not type(key.default)
            )
            readers = ", ".join(key.readers)
            out.append(
                f"| `{key.path}` | {default} | {_code(shown) if differs else ''} | "
                f"`{_cell(key.annotation)}` | {_cell(readers)} | {_cell(key.doc)} |"
            )
            covered.add(key.path)
    out += [
        "",
        "## Readers",
        "",
        "| reader | where |",
        "|---|---|",
        *(f"| {name} | `{_cell(where)}` |" for name, where in keys.READERS.items()),
    ]
    extra: dict[str, list[tuple[str, object, str]]] = {}
    for rel in sorted(_config_files()):
        cdocs = config_docs(rel)
        for key, value in flatten(_load_config(rel)).items():
            if key not in schema.keys and key in cdocs:  # set by this file, not inherited
                extra.setdefault(key, []).append((rel, value, cdocs.get(key, "")))
    out += [
        "",
        "## Task options the configs set",
        "",
        "A task's own keys (an open section: the task's constructor refuses the ones it does "
        "not know), where each config file sets them (configs built on it inherit them).",
        "",
        "| key | config | value | what it is |",
        "|---|---|---|---|",
    ]
    for key in sorted(extra):
        for rel, value, doc in extra[key]:
            out.append(f"| `{key}` | `{rel}` | {_code(value)} | {_cell(doc)} |")
        covered.add(key)
    return "\n".join(out) + "\n", covered


def _config_files() -> list[str]:
    return [f"configs/{n}" for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith(".py")]


def _py_files(dirs) -> list[str]:
    out = []
    for d in dirs:
        for dirpath, _, names in os.walk(os.path.join(ROOT, d)):
            for n in sorted(names):
                if n.endswith(".py"):
                    out.append(os.path.relpath(os.path.join(dirpath, n), ROOT))
    return sorted(out)


# -- metrics -----------------------------------------------------------------------------------


def _metric_name(node, plain: bool = False) -> str | None:
    """The metric a key names: `area/name` anywhere, a plain `name` where `plain` (the
    learner's own step metrics: entropy, loss, grad_norm, ...)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        name = node.value
    elif isinstance(node, ast.JoinedStr):
        name = "".join(
            v.value if isinstance(v, ast.Constant) else f"<{ast.unparse(v.value)}>"
            for v in node.values
        )
    else:
        return None
    if METRIC_RE.match(name) and not NOT_METRICS.search(name):
        return name
    if plain and PLAIN_RE.match(name):
        return name
    return None


def _metric_keys(node, in_learner: bool) -> list[tuple[ast.AST, bool]]:
    """(key node, plain names allowed) for each metric key a statement or call sets."""
    if isinstance(node, ast.Dict):
        return [(k, False) for k in node.keys if k is not None]
    if isinstance(node, ast.DictComp):
        return [(node.key, False)]
    if isinstance(node, ast.Assign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        keys = []
        for t in targets:
            if isinstance(t, ast.Subscript):
                named = isinstance(t.value, ast.Name) and t.value.id in METRIC_VARS
                keys.append((t.slice, in_learner and named))
        if (
            in_learner
            and isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in METRIC_VARS for t in targets)
            and isinstance(node.value, ast.Dict)
        ):
            keys += [(k, True) for k in node.value.keys if k is not None]
        return keys
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = node.func.value
        if node.func.attr == "incr" and node.args:  # the controller's cumulative counters
            return [(node.args[0], False)]
        if node.func.attr == "update" and isinstance(owner, ast.Name) and owner.id in METRIC_VARS:
            keys = [
                (ast.Constant(k.arg, lineno=k.lineno, end_lineno=k.end_lineno), in_learner)
                for k in node.keywords
                if k.arg
            ]
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    keys += [(k, in_learner) for k in arg.keys if k is not None]
            return keys
    return []


def metrics() -> dict[str, list[tuple[str, str]]]:
    """Metric name -> [(file:line, comment)] for every place that sets it in a row."""
    found: dict[str, list[tuple[str, str]]] = {}
    for rel in _py_files(METRIC_DIRS):
        src = _read(rel)
        lines = src.splitlines()
        in_learner = rel.startswith("learner_jax" + os.sep)
        for node in ast.walk(ast.parse(src)):
            keys = _metric_keys(node, in_learner)
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "COUNTERS" for t in node.targets
            ):  # a list of counter names, e.g. a split string
                value = node.value
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
                    value = value.func.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    keys += [
                        (ast.Constant(w, lineno=node.lineno, end_lineno=node.lineno), False)
                        for w in value.value.split()
                    ]
                elif isinstance(value, ast.Tuple | ast.List):
                    keys += [(e, False) for e in value.elts]
            for k, plain in keys:
                name = _metric_name(k, plain)
                if name:
                    doc = _comments(lines, k.lineno, k.end_lineno)
                    found.setdefault(name, []).append((f"{rel}:{k.lineno}", doc))
    return found


def metrics_page() -> tuple[str, set[str]]:
    found = metrics()
    out = [
        "# Metrics",
        "",
        "Generated from the code by `docs/gen_reference.py`; do not edit. Every name the code "
        "sets as a key `area/name` of a metrics dict (learner_jax/ and bridge/). A learner "
        "step's line in `<workdir>/metrics.jsonl` holds the learner's own metrics, the "
        "controller's fleet statistics for that step and, on evaluation steps, the eval "
        "metrics; the same keys go to TensorBoard (`<workdir>/tb`) and, when configured, "
        "Weights & Biases. Besides these: `step`, `policy_version`, `phase`, `learning_rate`.",
        "",
        "| metric | set at | comment there |",
        "|---|---|---|",
    ]
    for name in sorted(found):
        places = found[name]
        where = ", ".join(f"`{p}`" for p, _ in places[:3]) + (" ..." if len(places) > 3 else "")
        doc = next((d for _, d in places if d), "")
        out.append(f"| `{_cell(name)}` | {where} | {_cell(doc)} |")
    return "\n".join(out) + "\n", set(found) | {"step", "policy_version", "phase"}


# -- CLI flags ---------------------------------------------------------------------------------

_ABSL_KINDS = {
    "DEFINE_string": "string",
    "DEFINE_integer": "int",
    "DEFINE_float": "float",
    "DEFINE_bool": "bool",
    "DEFINE_boolean": "bool",
    "DEFINE_enum": "enum",
    "DEFINE_list": "list",
    "DEFINE_multi_string": "multi string",
    "DEFINE_config_file": "config file",
}


def flags_of(rel: str) -> list[dict]:
    """Every absl flag and argparse argument defined in a source file."""
    out = []
    for node in ast.walk(ast.parse(_read(rel))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        fn = node.func.attr
        kw = {k.arg: k.value for k in node.keywords}
        if fn in _ABSL_KINDS and node.args:
            args = node.args
            name = _const(args[0])
            kind = _ABSL_KINDS[fn]
            default = ast.unparse(args[1]) if len(args) > 1 else ast.unparse(kw.get("default"))
            help_node = kw.get("help") or (args[3] if fn == "DEFINE_enum" else None)
            if help_node is None and len(args) > 2:
                help_node = args[2]
            if fn == "DEFINE_enum" and len(args) > 2:
                try:
                    kind = "one of " + ", ".join(repr(x) for x in ast.literal_eval(args[2]))
                except ValueError:  # choices computed from other names
                    kind = "one of " + ast.unparse(args[2])
            required = "required" in kw and ast.unparse(kw["required"]) == "True"
        elif fn == "add_argument" and node.args:
            name = _const(node.args[0])
            if not isinstance(name, str) or not name.startswith("-"):
                continue
            name = name.lstrip("-")
            kind = ast.unparse(kw["type"]) if "type" in kw else "string"
            if "action" in kw:
                kind = _const(kw["action"]) or "flag"
            default = ast.unparse(kw["default"]) if "default" in kw else "None"
            help_node = kw.get("help")
            required = "required" in kw and ast.unparse(kw["required"]) == "True"
        else:
            continue
        if not isinstance(name, str):  # a name computed at run time (a loop variable)
            name = "<" + ast.unparse(node.args[0]) + ">"
        help_text = _const(help_node) if help_node is not None else ""
        if not isinstance(help_text, str):
            help_text = ast.unparse(help_node)
        out.append(dict(name=name, kind=kind, default=default, help=help_text, required=required))
    return out


def schema_flags() -> list[dict]:
    """The worker's flags as declared in bridge/config/keys.py (`SCHEMA.define_flags`)."""
    schema = _schema().SCHEMA
    out = []
    for key in schema.flag_keys():
        kind = "one of " + ", ".join(repr(c) for c in key.choices) if key.choices else key.base
        doc = key.doc if key.section == "worker" else f"{key.doc} (config: `{key.path}`)"
        out.append(
            dict(
                name=schema.flag_name(key),
                kind=kind,
                default=repr(key.default),
                help=doc,
                required=key.required,
            )
        )
    return out


def _const(node):
    return node.value if isinstance(node, ast.Constant) else None


def cli_page() -> tuple[str, dict[str, set[str]]]:
    out = [
        "# Command-line flags",
        "",
        "Generated from the code by `docs/gen_reference.py`; do not edit. The flags each "
        "binary defines (absl or argparse), with the default as written in the source. "
        "`python -m learner_jax.train` also takes `--config.KEY=VALUE` for every "
        "[config key](config.md).",
    ]
    names = {}
    for command, rel in BINARIES.items():
        fl = flags_of(rel)
        if "SCHEMA.define_flags(" in _read(rel):
            fl += schema_flags()
        names[command] = {f["name"] for f in fl}
        doc = (ast.get_docstring(ast.parse(_read(rel))) or "").strip().split("\n\n")[0]
        out += ["", f"## `{command}`", "", f"`{rel}`: {_cell(doc)}", ""]
        out += ["| flag | type | default | help |", "|---|---|---|---|"]
        for f in fl:
            default = "required" if f["required"] else f"`{_cell(f['default'])}`"
            out.append(f"| `--{f['name']}` | {_cell(f['kind'])} | {default} | {_cell(f['help'])} |")
    return "\n".join(out) + "\n", names


# -- wire protocol -----------------------------------------------------------------------------


def routes() -> list[tuple[str, str, str, str]]:
    """(method, path, request model, response model) of every route the service declares."""
    out = []
    for rel in ROUTE_FILES:
        if not os.path.exists(os.path.join(ROOT, rel)):
            continue
        for fn in ast.walk(ast.parse(_read(rel))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for dec in fn.decorator_list:
                if not (
                    isinstance(dec, ast.Call)
                    and isinstance(dec.func, ast.Attribute)
                    and dec.func.attr in ("get", "post", "put", "delete")
                    and dec.args
                    and isinstance(_const(dec.args[0]), str)
                    and _const(dec.args[0]).startswith("/")
                ):
                    continue
                kw = {k.arg: k.value for k in dec.keywords}
                response = ast.unparse(kw["response_model"]) if "response_model" in kw else ""
                body = [
                    ast.unparse(a.annotation)
                    for a in fn.args.args
                    if a.annotation is not None
                    and ast.unparse(a.annotation)[:1].isupper()
                    and ast.unparse(a.annotation) not in ("Request", "Response")
                ]
                out.append((dec.func.attr.upper(), _const(dec.args[0]), ", ".join(body), response))
    return out


def protocol_page() -> tuple[str, set[str]]:
    sys.path.insert(0, ROOT)
    module = importlib.import_module(PROTOCOL_MODULE)
    from pydantic import BaseModel

    models = [
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, BaseModel) and obj.__module__ == module.__name__
    ]
    out = [
        "# Wire protocol",
        "",
        "Generated from the code by `docs/gen_reference.py`; do not edit. The controller "
        "<-> worker protocol: the routes the controller serves (`bridge/control/http/service.py`) "
        "and the JSON schema of every pydantic model in `bridge/control/protocol.py` "
        "(`model_json_schema()`). A running controller also serves its OpenAPI schema at "
        "`/openapi.json`. Workers authenticate with `Authorization: Bearer <token>` from "
        "`/v1/register`.",
        "",
        "## Routes",
        "",
        "| method | path | request body | response |",
        "|---|---|---|---|",
    ]
    for method, path, body, response in routes():
        out.append(f"| {method} | `{path}` | {_cell(body) or '-'} | {_cell(response) or '-'} |")
    out += ["", "## Models", ""]
    for m in models:
        # Its own docstring only: an undocumented model would inherit BaseModel's.
        doc = inspect.cleandoc(m.__dict__.get("__doc__") or "")
        schema = m.model_json_schema()
        out += [f"### `{m.__name__}`", "", doc, "", "| field | type | default | description |"]
        out.append("|---|---|---|---|")
        required = set(schema.get("required", []))
        for name, prop in schema.get("properties", {}).items():
            default = "required" if name in required else _code(prop.get("default"))
            out.append(
                f"| `{name}` | {_cell(_schema_type(prop))} | {default} | "
                f"{_cell(prop.get('description', ''))} |"
            )
        out += [
            "",
            '??? note "JSON schema"',
            "",
            "    ```json",
            *("    " + line for line in json.dumps(schema, indent=2).splitlines()),
            "    ```",
            "",
        ]
    return "\n".join(out) + "\n", {m.__name__ for m in models}


def _schema_type(prop: dict) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " or ".join(_schema_type(p) for p in prop["anyOf"])
    if prop.get("type") == "array":
        return f"list[{_schema_type(prop.get('items', {}))}]"
    if "enum" in prop:
        return " / ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    return str(prop.get("type", "any"))


# -- writing -----------------------------------------------------------------------------------


def generate(out_dir: str = DEFAULT_OUT) -> dict:
    """Write the reference pages into out_dir; return what they cover (for the tests)."""
    os.makedirs(out_dir, exist_ok=True)
    config_md, config_keys = config_page()
    metrics_md, metric_names = metrics_page()
    cli_md, flag_names = cli_page()
    protocol_md, model_names = protocol_page()
    pages = {
        "config.md": config_md,
        "metrics.md": metrics_md,
        "cli.md": cli_md,
        "protocol.md": protocol_md,
    }
    for name, text in pages.items():
        path = os.path.join(out_dir, name)
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if old != text:  # unchanged files keep their mtime (mkdocs serve does not loop)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    return dict(config_keys=config_keys, metrics=metric_names, flags=flag_names, models=model_names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="directory the pages are written to")
    args = p.parse_args(argv)
    covered = generate(args.out)
    print(
        f"wrote {args.out}: {len(covered['config_keys'])} config keys, "
        f"{len(covered['metrics'])} metrics, "
        f"{sum(len(v) for v in covered['flags'].values())} flags, "
        f"{len(covered['models'])} protocol models"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
