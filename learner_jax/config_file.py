"""Config files (configs/NAME.py, ml_collections `get_config()`) loaded by path, the way
`--config` loads them. configs/ is not a package, so a config that builds on another calls
`base_config(__file__, "tiny_arith")` rather than putting configs/ on sys.path. This module
imports nothing heavy: config files load it before absl has parsed any flag."""

from __future__ import annotations

import importlib.util
import os


def load_config(path: str):
    """`get_config()` of the config file at `path`."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"echo2_configs_{name}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no config file at {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def base_config(config_file: str, name: str):
    """`get_config()` of configs/NAME.py, the file beside `config_file` (pass `__file__`)."""
    return load_config(os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py"))
