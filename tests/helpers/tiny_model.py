"""The dummy:tiny model in float32 with fixed random weights, for tests that drive a
ModelRunner directly (no engine, no processes)."""

import torch

from tokstream.model.source import resolve_model
from tokstream.model.weights import load_state_dict
from tokstream.worker.model import LlamaModel


def tiny_source():
    return resolve_model("dummy:tiny")


def tiny_model(source) -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(source.config, torch.float32)
    model.load_weights(load_state_dict(source, torch.float32, seed=1))
    return model
