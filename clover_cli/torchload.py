"""The one place clover reads a `torch.save` file: tensors and plain containers only (`weights_only=True`), so a
crafted file cannot run code when it is loaded. A model's pickled `.bin` weights (`--allow-pickle`) are read by
transformers with `weights_only=True` too; `refusal` words its refusal the same way."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from .errors import CloverError


def load(path: Path, what: str, mmap: bool = False):
    """The contents of the torch.save file `path` (`what` it is, e.g. "optimizer state", names it in errors),
    holding tensors, numbers, strings and containers of them. Anything more (a pickled object that would run code
    while loading) is refused in one line, as is a file that is missing, damaged or cannot be read. With `mmap` the
    tensors are mapped, not read: a cheap check of a file loaded later."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if _names_code(e):
            raise refusal(path, what, e) from None
        raise CloverError(f"{what} {path} is damaged or not a torch.save file ({_detail(e)})") from None
    except RuntimeError as e:
        if mmap and "mmap can only be used" in str(e):  # not the zip format: only a full read can tell what it is
            return load(path, what)
        raise CloverError(f"{what} {path} is damaged ({_sentence(e)})") from None
    except FileNotFoundError:
        raise CloverError(f"{what} {path} is missing") from None
    except EOFError:
        raise CloverError(f"{what} {path} is damaged (it ends too early: empty or cut short)") from None
    except OSError as e:
        raise CloverError(f"{what} {path} is unreadable ({e.strerror or _sentence(e)})") from None
    except Exception as e:  # torch's reader fails in other ways too on a damaged file
        raise CloverError(f"{what} {path} is damaged ({_sentence(e)})") from None


def refusal(path: Path, what: str, e: pickle.UnpicklingError) -> CloverError:
    """The one-line error for a pickle that holds more than tensors and plain data."""
    return CloverError(f"refusing {what} {path}: it holds more than tensors and plain data, and clover never "
                       f"loads code from a file ({_detail(e)})")


def _sentence(e: Exception) -> str:
    """The first sentence of an error's message (torch's go on with advice that does not apply)."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return first.split(". ")[0].rstrip(".")[:160]


def _names_code(e: pickle.UnpicklingError) -> bool:
    """Whether torch refused the pickle for what it would import or call (rather than for being damaged)."""
    return any(w in _detail(e).lower() for w in ("global", "reduce", "call", "build"))


def _detail(e: Exception) -> str:
    """The line of torch's weights-only refusal that says what was found (its other lines are boilerplate)."""
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    found = [line for line in lines if not line.startswith(boiler)]
    return (found or lines or [type(e).__name__])[0].removeprefix("WeightsUnpickler error:").strip()[:160]
