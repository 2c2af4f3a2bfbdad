"""The one place clover reads a `torch.save` file: tensors and plain containers only (`weights_only=True`), so a
crafted file cannot run code when it is loaded. A model's pickled `.bin` weights (`--allow-pickle`) are read by
transformers with `weights_only=True` too; `refusal` words its refusal the same way."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from .errors import CloverError


def load(path: Path, what: str):
    """The contents of the torch.save file `path` (`what` it is, e.g. "optimizer state", names it in errors),
    holding tensors, numbers, strings and containers of them. Anything more (a pickled object that would run code
    while loading) is refused in one line, as is a file that is missing, damaged or cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refusal(path, what, e) from None
    except FileNotFoundError:
        raise CloverError(f"{what} {path} is missing") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or ["?"])[0]
        raise CloverError(f"{what} {path} is unreadable ({why[:120]})") from None


def refusal(path: Path, what: str, e: pickle.UnpicklingError) -> CloverError:
    """The one-line error for a pickle that holds more than tensors and plain data."""
    return CloverError(f"refusing {what} {path}: it holds more than tensors and plain data, and clover never "
                       f"loads code from a file ({_detail(e)})")


def _detail(e: Exception) -> str:
    """The line of torch's weights-only refusal that says what was found (its other lines are boilerplate)."""
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    found = [line for line in lines if not line.startswith(boiler)]
    return (found or lines or [type(e).__name__])[0].removeprefix("WeightsUnpickler error:").strip()[:160]
