"""Fixtures of the controller tests: the run's tokenizer the controller encodes prompts and
decodes completions with (the tiny character-level one, no model weights needed)."""

import pytest

from bridge.contracts.prompt import TextCodec
from bridge.model import tiny_model


@pytest.fixture(scope="session")
def text_codec(tmp_path_factory) -> TextCodec:
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_model.save_tokenizer(str(path))
    return TextCodec(str(path))
