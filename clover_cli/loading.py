"""Load a target model and its tokenizer with transformers: device, dtype, 8-/4-bit and device-map choices, and
clear errors."""

from __future__ import annotations

import atexit
import gc
import json
import pickle
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import torchload
from .errors import CloverError, one_line

# the files a tokenizer is made from (any one of them may be enough)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "tiktoken.model")
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


def check_bitsandbytes(device: torch.device, bits: int):
    """Fail in one line, before any loading, when bitsandbytes cannot quantize to `bits` (8 or 4) on `device`."""
    import logging

    flag = f"--load-in-{bits}bit"
    # bitsandbytes logs a warning for every 8-bit matmul of a non-fp16 input (all of them on CPU) and one about
    # optional CPU kernels at import: keep the terminal and --json runs clean.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
        from bitsandbytes.functional import int8_vectorwise_quant, quantize_4bit
    except Exception as e:  # ImportError, or a broken native library
        raise CloverError(f"{flag} needs a working bitsandbytes: {one_line(e)} "
                          f"(pip install 'clover-cli[quant]', or run without {flag})")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise CloverError(f"{flag} needs accelerate: pip install accelerate (the [train] extra has it)")
    try:  # a tiny quantization on the target device: the backend (CPU or this GPU) must really work
        probe = torch.ones(8, 64, dtype=torch.float16, device=device)
        if bits == 8:
            int8_vectorwise_quant(probe)
        else:
            quantize_4bit(probe, quant_type="nf4")
    except Exception as e:
        raise CloverError(f"bitsandbytes {getattr(bitsandbytes, '__version__', '?')} cannot run {bits}-bit "
                          f"quantization on {device}: {one_line(e)} (run without {flag})")


DEVICE_MAPS = ("auto", "balanced")


def parse_device_map(text: str) -> str | dict:
    """--device-map: auto or balanced (accelerate spreads the layers over the GPUs, then the CPU, then disk), or a
    JSON object (inline or in a file) from module names to a GPU index, "cuda:N", "cpu" or "disk"."""
    if text in DEVICE_MAPS:
        return text
    raw = text
    if not text.lstrip().startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise CloverError(f"--device-map must be auto, balanced, a JSON object or a JSON file, not {text!r}")
        try:
            raw = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CloverError(f"cannot read the --device-map file {text}: {getattr(e, 'strerror', None) or e}")
    try:
        mapping = json.loads(raw)
    except ValueError as e:
        raise CloverError(f"--device-map is not valid JSON: {one_line(e)}")
    if not isinstance(mapping, dict) or not mapping:
        raise CloverError("--device-map JSON must be an object from module names to devices")
    return {str(name): _placement(where, f"--device-map entry {name!r}") for name, where in mapping.items()}


def parse_max_memory(text: str) -> dict:
    """--max-memory: how much each device may hold, "0=20GiB,1=20GiB,cpu=64GiB" or the same as a JSON object."""
    from accelerate.utils import convert_file_size_to_int

    if text.lstrip().startswith("{"):
        try:
            pairs = json.loads(text)
        except ValueError as e:
            raise CloverError(f"--max-memory is not valid JSON: {one_line(e)}")
        if not isinstance(pairs, dict):
            raise CloverError("--max-memory JSON must be an object from devices to sizes")
        pairs = list(pairs.items())
    else:
        pairs = [part.partition("=")[::2] for part in text.split(",") if part.strip()]
    out = {}
    for key, size in pairs:
        where = _placement(key.strip() if isinstance(key, str) else key, f"--max-memory device {key!r}")
        if where == "disk":
            raise CloverError("--max-memory limits GPUs and the CPU; what does not fit them goes to disk")
        try:
            out[where] = convert_file_size_to_int(size.strip() if isinstance(size, str) else size)
        except (ValueError, TypeError):
            raise CloverError(f"--max-memory: {size!r} for {key} is not a size (e.g. 20GiB, 500MB or bytes)")
    if not out:
        raise CloverError(f"--max-memory must name devices and sizes, e.g. 0=20GiB,cpu=64GiB, not {text!r}")
    return out


def _placement(where, what: str):
    """A device as accelerate names it: a GPU index (int), "cpu" or "disk"."""
    if isinstance(where, str) and where.strip().isdigit():
        where = int(where)
    if isinstance(where, str) and where.startswith("cuda:") and where[5:].isdigit():
        where = int(where[5:])
    if isinstance(where, bool) or not (isinstance(where, int) or where in ("cpu", "disk")):
        raise CloverError(f"{what}: {where!r} is not a device (use a GPU index, cuda:N, cpu or disk)")
    if isinstance(where, int) and where >= torch.cuda.device_count():
        raise CloverError(f"{what}: GPU {where} asked for, but {torch.cuda.device_count()} GPU(s) exist here")
    return where


@dataclass
class Loaded:
    model: object
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    load_in_8bit: bool
    load_in_4bit: bool = False
    offload: object = None  # the temporary directory disk-offloaded weights may be written to, while it lives


def load(path: Path, device: str = "auto", dtype: str = "auto", load_in_8bit: bool = False,
         trust_remote_code: bool = False, allow_pickle: bool = False, load_in_4bit: bool = False,
         device_map: str | None = None, max_memory: str | None = None) -> Loaded:
    """The model and tokenizer in `path`: on one device, or spread by accelerate with `device_map` (auto, balanced
    or a JSON map; `max_memory` caps each device); in 8 or 4 bits (NF4) through bitsandbytes."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if load_in_8bit and load_in_4bit:
        raise CloverError("--load-in-8bit and --load-in-4bit exclude each other: choose one")
    if max_memory is not None and device_map is None:
        raise CloverError("--max-memory caps the devices of a --device-map: add --device-map auto (or balanced)")
    if device_map is not None and device != "auto":
        raise CloverError(f"--device-map places the layers itself: drop --device {device}")
    placed = parse_device_map(device_map) if device_map is not None else None
    memory = parse_max_memory(max_memory) if max_memory is not None else None
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    # weights_only: pickled .bin weights (--allow-pickle) hold tensors only; a pickle that would run code is refused
    kwargs = dict(dtype=dt, trust_remote_code=trust_remote_code, use_safetensors=not allow_pickle or None,
                  weights_only=True)
    offload = None
    if placed is not None:
        import logging

        logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)  # "some parameters are on the meta device"
        offload = tempfile.TemporaryDirectory(prefix="clover-offload-")  # weights not in safetensors go here
        kwargs.update(device_map=placed, max_memory=memory, offload_folder=offload.name)
    if load_in_8bit or load_in_4bit:
        check_bitsandbytes(dev, 8 if load_in_8bit else 4)
        from transformers import BitsAndBytesConfig

        if dt == torch.float32 and dev.type == "cuda":
            dt = torch.float16
        quant = (BitsAndBytesConfig(load_in_8bit=True) if load_in_8bit else
                 BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dt))
        kwargs.update(quantization_config=quant, dtype=dt)
        kwargs.setdefault("device_map", {"": str(dev)})
    try:  # first: the tokenizer reads it too, and would be blamed for a bad config.json
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        msg = one_line(e)
        if "trust_remote_code" in msg:
            msg = "it needs custom code from its repository; pass --trust-remote-code if you trust it"
        raise CloverError(f"cannot read the model config in {path}: {msg}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        if Path(path).is_dir() and not any(Path(path, name).is_file() for name in TOKENIZER_FILES):
            raise CloverError(f"cannot load the tokenizer from {path}: it holds none of {', '.join(TOKENIZER_FILES)}")
        raise CloverError(f"cannot load the tokenizer from {path}: {one_line(e, 500)}")
    try:
        with warnings.catch_warnings(), LoadReport() as report:
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if "device_map" not in kwargs:
            model.to(dev)
    except torch.cuda.OutOfMemoryError:
        raise CloverError(f"out of GPU memory loading {path}; try --load-in-4bit, --device-map auto, a smaller "
                          f"model or --device cpu")
    except ImportError as e:
        raise CloverError(f"cannot load {path}: {one_line(e)}")
    except pickle.UnpicklingError as e:
        raise torchload.refusal(path, "the model weights in", e) from None
    except SafetensorError as e:
        raise CloverError(f"cannot load the model from {path}: its safetensors weights are damaged or incomplete "
                          f"({one_line(e)}); fetch them again")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        msg = report.mismatch() or one_line(e)
        if "trust_remote_code" in msg:
            msg = "it needs custom code from its repository; pass --trust-remote-code if you trust it"
        raise CloverError(f"cannot load the model from {path}: {msg}")
    model.eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or tokenizer.pad_token_id
    if placed is not None:
        from .target import input_device

        dev = input_device(model)  # where the token ids go in: the first layers' device
    return Loaded(model, tokenizer, dev, dt, load_in_8bit, load_in_4bit, offload)


class LoadReport:
    """Keeps transformers' loading report while a model loads (it is logged, and the error raised after it only says
    "look at the above report!", which the user never sees: clover keeps transformers' logs quiet)."""

    NAME = "transformers.modeling_utils"  # the logger from_pretrained hands the report to

    def __enter__(self):
        import logging

        self.lines: list[str] = []
        self.logger = logging.getLogger(self.NAME)
        self.saved = self.logger.level, self.logger.propagate, self.logger.handlers[:]
        handler = logging.Handler()
        handler.emit = self._keep
        self.logger.handlers, self.logger.propagate = [handler], False
        self.logger.setLevel(logging.WARNING)
        return self

    def _keep(self, record) -> None:
        import logging

        self.lines.extend(str(record.getMessage()).splitlines())
        if record.levelno >= logging.ERROR:  # shown as before this capture (warnings stay quiet, as clover keeps them)
            logging.getLogger("transformers").handle(record)

    def __exit__(self, *exc):
        level, self.logger.propagate, self.logger.handlers = self.saved
        self.logger.setLevel(level)  # (clears the logger's cache of enabled levels; assigning .level would not)
        return False

    def mismatch(self) -> str | None:
        """The first weight whose shape differs between the checkpoint and the config, in one line; None if none."""
        import re

        for line in self.lines:
            m = re.match(r"\s*(\S+)\s*\|\s*MISMATCH\s*\|.*ckpt: torch\.Size\((\[[^]]*\])\) vs model: ?"
                         r"torch\.Size\((\[[^]]*\])\)", line)
            if m:
                more = sum("MISMATCH |" in ln for ln in self.lines) - 1
                return (f"its weights do not fit its config.json: {m.group(1)} is {m.group(2)} in the weights but "
                        f"{m.group(3)} by the config" + (f" (and {more} more)" if more > 0 else ""))
        return None


def check_token_ids(ids, tokenizer, rows: int, what: str = "the prompt holds") -> list:
    """`ids` (a prompt's token ids), or a one-line refusal when one of them has no embedding in the model: a tokenizer
    larger than the model's embedding (transformers itself adds a token to some: Qwen2's tokenizer class adds
    `<|endoftext|>` where the vocabulary has none) is fine until such a token is fed; fed, it failed in the middle of
    the first step."""
    if ids and max(ids) >= rows:
        bad = next(i for i in ids if i >= rows)
        raise CloverError(f"{what} {tokenizer.convert_ids_to_tokens(bad)!r} (id {bad}), a token the model has no "
                          f"embedding for (the tokenizer has {len(tokenizer)} tokens, the model embeds only {rows})")
    return ids




def keep_loaded() -> None:
    """Exempt every object alive now (a loaded model, tokenizer, drafter, compiled programs) from Python's cyclic
    garbage collector, for the rest of the process: a full pass over the bundled model's ~390k objects took 180-230 ms
    (CPU) and came now and then in the middle of a reply (docs/BENCHMARKS.md, 2026-11-27). Reference counting still
    frees them. They are handed back to the collector at exit, so that the interpreter's last collection still sees
    them (atexit, below): frozen, extension objects in cycles outlived it, and their bindings (triton's) wrote leak
    reports on stderr."""
    gc.freeze()


atexit.register(gc.unfreeze)  # nothing to do unless keep_loaded() froze something
