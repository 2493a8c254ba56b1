"""The machinery of the config schema: a declared key, a declared section, and everything
derived from a list of them (bridge/config/keys.py holds the list).

A `Key` is declared once with its dotted path, default, type and doc, the components that
read it (`readers`) and, where the rollout worker takes it on its command line, its flag.
From those declarations `Schema` derives:

- `default_config()`: the ml_collections ConfigDict every configs/NAME.py builds on;
- `declared_fields`: a class decorator that adds to a dataclass one field (name, type,
  default, doc) per key that names the class among its readers, so the learner's,
  controller's and worker's dataclasses take their defaults from the declarations;
- `define_flags()`: the worker's absl flags (name, default, help);
- `check()`: a config's unknown keys and wrong types, refused with the key's path;
- the rows of docs/reference/config.md and cli.md (docs/gen_reference.py reads `keys`).

This module imports nothing heavy (ml_collections and absl only inside the functions that
need them): config files, the worker and the docs generator all load it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any

# Annotation -> the Python types a value of it may have (int is a float: `lr = 1` is fine).
_BASE_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}
UNION = "union"  # a key that takes one of several plain types
CONFIG, FLAGS = "config", "flags"  # where a section's keys live: the ConfigDict or argv


@dataclasses.dataclass(frozen=True)
class Section:
    """A group of keys: `path` ("fleet", "learner.lora"; "" = the top level).

    `open`: keys not declared here are allowed (a task's own options, checked by the task).
    `scope`: CONFIG (a part of the run's ConfigDict) or FLAGS (command-line flags only).
    """

    path: str
    doc: str
    open: bool = False
    scope: str = CONFIG


@dataclasses.dataclass(frozen=True)
class Key:
    """One setting. `type` is a Python annotation as text ("int", "float | None",
    "tuple[float, ...]"); left empty it is the default's type. `optional`: declared (a
    config may set it, the docs list it) but left out of the default config. `flag`: the
    rollout worker's flag of that name takes this key's default and doc (keys of a FLAGS
    section are flags of their own name). `choices`: an enum flag's values. `required`: a
    flag with no default that must be given."""

    path: str
    default: Any
    doc: str
    readers: tuple[str, ...] = ()
    type: str = ""
    optional: bool = False
    flag: str = ""
    choices: tuple[str, ...] = ()
    required: bool = False

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def section(self) -> str:
        return self.path.rsplit(".", 1)[0] if "." in self.path else ""

    @property
    def annotation(self) -> str:
        if self.type:
            return self.type
        if isinstance(self.default, tuple):
            kinds = {type(x).__name__ for x in self.default}
            return f"tuple[{kinds.pop()}, ...]" if len(kinds) == 1 else "tuple"
        return type(self.default).__name__

    @property
    def nullable(self) -> bool:
        return "None" in [p.strip() for p in self.annotation.split("|")]

    @property
    def bases(self) -> tuple[str, ...]:
        """The annotation's types without `None` and without a tuple's element type."""
        parts = [p.strip() for p in self.annotation.split("|") if p.strip() != "None"]
        return tuple(p.split("[", 1)[0] for p in parts)

    @property
    def base(self) -> str:
        """The one type of the annotation besides `None`; "union" for a choice of plain
        types (`staleness`: an int or "auto")."""
        bases = self.bases
        if len(bases) == 1:
            return bases[0]
        if bases and all(b in _BASE_TYPES for b in bases):
            return UNION
        raise ValueError(f"{self.path}: unsupported type {self.annotation!r}")

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.base == "tuple":
            return isinstance(value, tuple | list)
        if isinstance(value, bool) and "bool" not in self.bases:
            return False  # True is an int to Python, not to a config
        return any(isinstance(value, _BASE_TYPES[b]) for b in self.bases if b in _BASE_TYPES)


class Schema:
    """Sections and keys, checked for consistency when built, and what derives from them."""

    def __init__(self, sections: Iterable[Section], keys: Iterable[Key]):
        self.sections = {s.path: s for s in sections}
        self.keys: dict[str, Key] = {}
        for key in keys:
            if key.path in self.keys:
                raise ValueError(f"config key {key.path!r} is declared twice")
            if key.section not in self.sections:
                raise ValueError(f"config key {key.path!r}: its section is not declared")
            if key.base not in (*_BASE_TYPES, "tuple", UNION):
                raise ValueError(f"{key.path}: unsupported type {key.annotation!r}")
            if not key.required and not key.accepts(key.default):
                raise ValueError(f"{key.path}: default {key.default!r} is not a {key.annotation}")
            self.keys[key.path] = key
        flags = [self.flag_name(k) for k in self.flag_keys()]
        twice = {f for f in flags if flags.count(f) > 1}
        if twice:
            raise ValueError(f"worker flags declared twice: {sorted(twice)}")

    # -- lookups ------------------------------------------------------------------------------

    def key(self, path: str) -> Key:
        if path not in self.keys:
            raise KeyError(f"unknown config key {path!r}{self._did_you_mean(path)}")
        return self.keys[path]

    def default(self, path: str):
        """The declared default of `path`, for a field or flag whose name is not the key's."""
        return self.key(path).default

    def config_keys(self) -> list[Key]:
        """The keys of the run's ConfigDict, in declaration order."""
        return [k for k in self.keys.values() if self.sections[k.section].scope == CONFIG]

    def flag_keys(self) -> list[Key]:
        """The keys the rollout worker takes as flags, in declaration order."""
        return [k for k in self.keys.values() if self.flag_name(k)]

    def flag_name(self, key: Key) -> str:
        return key.flag or (key.name if self.sections[key.section].scope == FLAGS else "")

    def read_by(self, reader: str) -> list[Key]:
        return [k for k in self.keys.values() if reader in k.readers]

    def _did_you_mean(self, path: str) -> str:
        close = difflib.get_close_matches(path, list(self.keys), n=1, cutoff=0.75)
        return f" (did you mean {close[0]!r}?)" if close else ""

    # -- the default config -------------------------------------------------------------------

    def default_config(self):
        """Every non-optional config key at its default, as a fresh ConfigDict."""
        from ml_collections import ConfigDict, config_dict

        root = ConfigDict()
        for key in self.config_keys():
            if key.optional:
                continue
            node = root
            for part in key.section.split(".") if key.section else ():
                if part not in node:
                    node[part] = ConfigDict()
                node = node[part]
            if key.base == UNION:  # any of its types may replace the default
                value = config_dict.FieldReference(key.default, field_type=object)
            elif key.default is None:  # typed, so `--config.KEY=VALUE` parses to that type
                value = config_dict.placeholder(_BASE_TYPES[key.base][-1])
            else:
                value = key.default
            node[key.name] = value
        return root

    # -- a config's keys and types ------------------------------------------------------------

    def problems(self, config, prefix: str = "") -> list[str]:
        """What is wrong with `config`'s keys: undeclared ones (outside an open section),
        values of the wrong type, a section given a value or a value given a section."""
        out = []
        for name, value in config.items():
            path = prefix + name
            if path in self.sections:
                if not hasattr(value, "items"):
                    out.append(f"{path} is a section of keys, got {value!r}")
                else:
                    out += self.problems(value, path + ".")
            elif path in self.keys:
                key = self.keys[path]
                if hasattr(value, "items") and key.base != "tuple":
                    out.append(f"{path} is a {key.annotation}, got a section")
                elif not hasattr(value, "items") and not key.accepts(value):
                    out.append(f"{path}={value!r}: expected {key.annotation}")
            elif not self.sections[prefix[:-1]].open:  # prefix: a declared section's
                out.append(f"unknown config key {path!r}{self._did_you_mean(path)}")
        return out

    def check(self, config) -> None:
        """Raise ValueError naming every problem of `config` (see `problems`)."""
        found = self.problems(config)
        if found:
            raise ValueError(
                "config does not match the declared keys (bridge/config/keys.py):\n  "
                + "\n  ".join(found)
            )

    # -- dataclasses --------------------------------------------------------------------------

    def declared_fields(self, cls):
        """Class decorator, applied below `@dataclasses.dataclass`: adds one field per key
        that names `cls` among its readers (after the class's own fields), with the key's
        annotation and default; the field's metadata holds the key's path and doc."""
        keys = self.read_by(cls.__name__)
        if not keys:
            raise TypeError(f"no declared config key names {cls.__name__} among its readers")
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for key in keys:
            if key.name in annotations:
                raise TypeError(
                    f"{cls.__name__}.{key.name} is declared by the config key {key.path!r}; "
                    "remove it from the class"
                )
            annotations[key.name] = key.annotation
            field = dataclasses.field(
                default=key.default, metadata={"config_key": key.path, "doc": key.doc}
            )
            setattr(cls, key.name, field)
        cls.__annotations__ = annotations
        return cls

    # -- the worker's flags -------------------------------------------------------------------

    def define_flags(self, flag_values=None) -> dict[str, Any]:
        """Define every worker flag on `flag_values` (absl's FLAGS by default): flag name ->
        its FlagHolder."""
        from absl import flags

        fv = flag_values if flag_values is not None else flags.FLAGS
        define = {
            "bool": flags.DEFINE_bool,
            "int": flags.DEFINE_integer,
            "float": flags.DEFINE_float,
            "str": flags.DEFINE_string,
        }
        out = {}
        for key in self.flag_keys():
            name = self.flag_name(key)
            extra = {"required": True} if key.required else {}
            if key.choices:
                holder = flags.DEFINE_enum(
                    name, key.default, list(key.choices), key.doc, flag_values=fv, **extra
                )
            else:
                holder = define[key.base](name, key.default, key.doc, flag_values=fv, **extra)
            out[name] = holder
        return out
