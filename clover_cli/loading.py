"""Load a target model and its tokenizer with transformers: device, dtype and 8-bit choices, and clear errors."""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import torchload
from .errors import CloverError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CloverError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CloverError(f"device {device} asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CloverError(f"device {device} asked for, but only {torch.cuda.device_count()} GPU(s) exist")
    elif dev.type != "cpu":
        raise CloverError(f"unsupported device {device!r} (use auto, cpu, cuda or cuda:N)")
    return dev


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            # native bf16 from Ampere (compute capability 8) on; older GPUs would only emulate it, slowly
            return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise CloverError(f"unknown dtype {dtype!r} (use auto, float32, float16 or bfloat16)")
    return DTYPES[dtype]


def check_8bit(device: torch.device):
    """Fail in one line, before any loading, when bitsandbytes cannot quantize on `device`."""
    import logging

    # bitsandbytes logs a warning for every 8-bit matmul of a non-fp16 input (all of them on CPU) and one about
    # optional CPU kernels at import: keep the terminal and --json runs clean.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
        from bitsandbytes.functional import int8_vectorwise_quant
    except Exception as e:  # ImportError, or a broken native library
        raise CloverError(f"--load-in-8bit needs a working bitsandbytes: {_first_line(e)} "
                          f"(pip install bitsandbytes, or run without --load-in-8bit)")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise CloverError("--load-in-8bit needs accelerate: pip install accelerate")
    try:  # a tiny quantization on the target device: the backend (CPU or this GPU) must really work
        int8_vectorwise_quant(torch.ones(2, 8, dtype=torch.float16, device=device))
    except Exception as e:
        raise CloverError(f"bitsandbytes {getattr(bitsandbytes, '__version__', '?')} cannot run 8-bit "
                          f"quantization on {device}: {_first_line(e)} (run without --load-in-8bit)")


@dataclass
class Loaded:
    model: object
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    load_in_8bit: bool


def load(path: Path, device: str = "auto", dtype: str = "auto", load_in_8bit: bool = False,
         trust_remote_code: bool = False, allow_pickle: bool = False) -> Loaded:
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    # weights_only: pickled .bin weights (--allow-pickle) hold tensors only; a pickle that would run code is refused
    kwargs = dict(dtype=dt, trust_remote_code=trust_remote_code, use_safetensors=not allow_pickle or None,
                  weights_only=True)
    if load_in_8bit:
        check_8bit(dev)
        from transformers import BitsAndBytesConfig

        if dt == torch.float32 and dev.type == "cuda":
            dt = torch.float16
        kwargs.update(quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map={"": str(dev)},
                      dtype=dt)
    try:  # first: the tokenizer reads it too, and would be blamed for a bad config.json
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        msg = _first_line(e)
        if "trust_remote_code" in msg:
            msg = "it needs custom code from its repository; pass --trust-remote-code if you trust it"
        raise CloverError(f"cannot read the model config in {path}: {msg}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise CloverError(f"cannot load the tokenizer from {path}: {_first_line(e)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if not load_in_8bit:
            model.to(dev)
    except torch.cuda.OutOfMemoryError:
        raise CloverError(f"out of GPU memory loading {path}; try --load-in-8bit, a smaller model or --device cpu")
    except ImportError as e:
        raise CloverError(f"cannot load {path}: {_first_line(e)}")
    except pickle.UnpicklingError as e:
        raise torchload.refusal(path, "the model weights in", e) from None
    except SafetensorError as e:
        raise CloverError(f"cannot load the model from {path}: its safetensors weights are damaged or incomplete "
                          f"({_first_line(e)}); fetch them again")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        msg = _first_line(e)
        if "trust_remote_code" in msg:
            msg = "it needs custom code from its repository; pass --trust-remote-code if you trust it"
        raise CloverError(f"cannot load the model from {path}: {msg}")
    model.eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or tokenizer.pad_token_id
    return Loaded(model, tokenizer, dev, dt, load_in_8bit)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
