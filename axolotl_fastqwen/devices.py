"""Where things run: one definition of "the device" for the plugin, the patcher and the bench."""

from __future__ import annotations

import os

import torch


def default_device() -> torch.device:
    """The current CUDA device if there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def training_device() -> torch.device:
    """This process's device under a distributed launcher (LOCAL_RANK), else `default_device()`."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model`'s parameters are; `default_device()` for a model still on the meta device."""
    param = next(model.parameters(), None)
    return param.device if param is not None and param.device.type != "meta" else default_device()


def from_arg(name: str | None) -> torch.device:
    """A `--device` argument: as given (a bare "cuda" means the current GPU), else `default_device()`."""
    if not name:
        return default_device()
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
