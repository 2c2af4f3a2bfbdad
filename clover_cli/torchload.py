"""Pickled PyTorch files read tensors-only: every torch.load in clover goes through `load`."""

from __future__ import annotations

import pickle
from pathlib import Path

from .errors import CloverError


def load(path: Path, what: str):
    """torch.load(path) with weights_only=True onto the CPU: tensors, containers of them and plain values; a pickle
    that needs anything else (code to run) is refused. Raises CloverError in one line naming the file and `what`."""
    import torch

    try:
        return torch.load(Path(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise CloverError(f"{what} {path} is a pickle that holds more than tensors: refused (it could run code)")
        raise CloverError(f"{what} {path}: not a readable PyTorch file ({first[:120]})")
    except (OSError, EOFError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CloverError(f"{what} {path}: not a readable PyTorch file ({first[:120]})")
