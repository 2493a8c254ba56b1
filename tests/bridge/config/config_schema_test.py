"""The config schema (bridge/config/): a key declared once reaches every place derived from
it (the default config, the dataclasses that read it, the worker's flags, the generated
reference), and a config with an undeclared key or a value of the wrong type is refused."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import types

import pytest
from absl import flags
from ml_collections import ConfigDict

from bridge.config import keys
from bridge.config.keys import READERS, SCHEMA
from bridge.config.schema import Key, Schema
from learner_jax import config_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "docs"))

import gen_reference  # noqa: E402


def tiny_arith():
    return config_file.load_config(os.path.join(ROOT, "configs", "tiny_arith.py"))


def _reader_class(reader: str):
    module, name = READERS[reader].split(":")
    return getattr(importlib.import_module(module), name)


def _worker_flags() -> dict:
    """The worker binary's flags (name -> default, help), read from absl in a fresh
    interpreter: the worker's flags must not meet the learner's in this one."""
    code = (
        "import json; from absl import flags; import rollout_gpu.worker; "
        "print(json.dumps({n: [f.default, f.help] for n, f in flags.FLAGS._flags().items()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_declared_key_reaches_each_place_derived_from_it():
    defaults = gen_reference.flatten(keys.default_config())
    page, covered = gen_reference.config_page()
    worker_flags = _worker_flags()
    for key in SCHEMA.keys.values():
        if key in SCHEMA.config_keys():
            assert key.path in covered and f"| `{key.path}` |" in page, key.path
            assert gen_reference._cell(key.doc) in page, key.path
            if not key.optional:
                assert key.path in defaults, key.path
                got = defaults[key.path]
                assert got == key.default and type(got) is type(key.default), key.path
        for reader in key.readers:
            if ":" not in READERS[reader]:  # a binary reads it, not a dataclass field
                continue
            field = {f.name: f for f in dataclasses.fields(_reader_class(reader))}[key.name]
            assert (field.default, field.metadata["config_key"]) == (key.default, key.path)
        name = SCHEMA.flag_name(key)
        if name:
            default, help_text = worker_flags[name]  # an enum's help starts with its values
            assert default == key.default and help_text.endswith(key.doc), (name, default)
    assert len(SCHEMA.flag_keys()) >= 25 and len(SCHEMA.config_keys()) >= 175


def test_a_key_declared_once_appears_in_every_derived_place(monkeypatch):
    """A new declaration, and nothing else: the default config, a dataclass naming it among
    its readers, the worker's flags and the reference all have it."""
    spare = Key(
        "fleet.spare_engines", 3, "Engines kept warm beside the busy ones.", ("Probe",),
        flag="spare_engines",
    )  # fmt: skip
    schema = Schema(keys.SECTIONS, [*SCHEMA.keys.values(), spare])

    assert schema.default_config().fleet.spare_engines == 3

    @dataclasses.dataclass(frozen=True)
    @schema.declared_fields
    class Probe:
        own: str = "x"

    (field,) = [f for f in dataclasses.fields(Probe) if f.name == "spare_engines"]
    assert Probe().spare_engines == 3 and field.metadata["doc"] == spare.doc
    assert Probe(spare_engines=5).spare_engines == 5

    fv = flags.FlagValues()
    holders = schema.define_flags(fv)
    fv(["worker", "--controller=http://c", "--token_file=t", "--spare_engines=7"])
    assert holders["spare_engines"].value == 7 and fv["spare_engines"].default == 3
    assert fv["spare_engines"].help == spare.doc

    module = types.SimpleNamespace(SCHEMA=schema, READERS={**READERS, "Probe": "a test:Probe"})
    monkeypatch.setattr(gen_reference, "_schema", lambda: module)
    page, covered = gen_reference.config_page()
    row = next(line for line in page.splitlines() if line.startswith("| `fleet.spare_engines`"))
    assert "fleet.spare_engines" in covered and "`3`" in row and spare.doc in row
    flag = next(f for f in gen_reference.schema_flags() if f["name"] == "spare_engines")
    assert flag["default"] == "3" and spare.doc in flag["help"]


def test_an_undeclared_key_is_refused():
    from learner_jax.run_config import validate

    c = tiny_arith()
    validate(c)
    c.fleet.max_modle_len = 1024  # a typo: without the check the run keeps 512, silently
    with pytest.raises(ValueError, match=r"unknown config key 'fleet.max_modle_len' "
                       r"\(did you mean 'fleet.max_model_len'\?\)"):  # fmt: skip
        validate(c)
    c = tiny_arith()
    c.totl_steps = 10
    with pytest.raises(ValueError, match=r"unknown config key 'totl_steps'"):
        validate(c)
    c = tiny_arith()
    c.task.max_turns = 3  # a task's own option: the task section is open
    assert SCHEMA.problems(c) == []
    with pytest.raises(KeyError, match=r"unknown config key 'fleet.spare'"):
        SCHEMA.default("fleet.spare")


def test_a_value_of_the_wrong_type_is_refused():
    from learner_jax.run_config import validate

    d = tiny_arith().to_dict()
    d["controller"]["port"] = "8470"
    d["batch"]["packing"] = 1
    d["loss"]["clip_eps_high"] = None  # declared `float | None`
    d["optimizer"]["learning_rate"] = 1  # an int is a float
    d["bridge"]["delta"] = "off"  # a section given a value
    with pytest.raises(ValueError) as raised:
        validate(ConfigDict(d))
    problems = sorted(p.strip() for p in str(raised.value).splitlines()[1:])
    assert problems == [
        "batch.packing=1: expected bool",
        "bridge.delta is a section of keys, got 'off'",
        "controller.port='8470': expected int",
    ]
    assert Key("a", 0, "").accepts(True) is False  # a bool is no count


def test_a_dataclass_cannot_redeclare_or_miss_its_keys():
    with pytest.raises(TypeError, match=r"FleetConfig.grace_s is declared by the config key"):

        @SCHEMA.declared_fields
        class FleetConfig:
            grace_s: float = 10.0

    with pytest.raises(TypeError, match="no declared config key names Unread"):

        @SCHEMA.declared_fields
        class Unread:
            pass


def test_keys_the_learner_reads_with_get_are_declared():
    """`config.x.get("key", default)` in learner_jax/ reads a key a config may leave out; it
    must still be declared (or belong to an open section), or a config setting it is refused."""
    undeclared = [
        path
        for path in gen_reference.optional_keys()
        if path not in SCHEMA.keys
        and path not in SCHEMA.sections
        and not getattr(SCHEMA.sections.get(path.rsplit(".", 1)[0]), "open", False)
    ]
    assert not undeclared, undeclared


def test_every_config_file_loads_and_passes_the_check():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".py"):
            c = config_file.load_config(os.path.join(ROOT, "configs", name))
            assert SCHEMA.problems(c) == [], name
