"""mkdocs hook: writes the generated reference pages (docs/gen_reference.py) before each
build, so `mkdocs build` and `mkdocs serve` always show the code as it is."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gen_reference  # noqa: E402


def on_pre_build(config, **kwargs):
    gen_reference.generate(os.path.join(config["docs_dir"], "reference"))
