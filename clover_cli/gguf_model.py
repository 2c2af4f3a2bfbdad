"""GGUF files (llama.cpp's format, what llama.cpp, Ollama and LM Studio users have on disk) as models clover runs.

A GGUF is read by transformers' own GGUF support (the `gguf` package dequantizes its tensors), once: the model and
its tokenizer are saved as an ordinary model directory (safetensors, config, tokenizer) in clover's cache, keyed by
the file's content (sha256) and the dtype it was dequantized to, so that every later run, and everything that takes
a model directory (the compiled step, the heads, train, bench), starts from that directory. Which file a content hash
belongs to is remembered by path, size and modification time, so a later run does not read the file again.

Problems get one line: a file that is not a GGUF, a truncated or damaged one (a tensor missing, a layer count its
tensors do not match), an architecture or quantization type transformers cannot read. A conversion is built in a
temporary directory and renamed into place: an interrupted or failed one leaves nothing half-written in the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from . import atomic
from .errors import CloverError
from .store import content_hash, converted_dir, lock_path

MAGIC = b"GGUF"
SOURCE_FILE = "clover-gguf.json"  # in a converted directory: which file it came from, and how
# what a conversion writes, in its record: an older one is converted again (2: no token past the file's vocabulary;
# files missing tensors or layers refused, where 1 made them models with random weights; 3: the file's quantized
# blocks repacked beside the weights, clover_cli/quantized.py)
CONVERTER = 3
DTYPES = ("float32", "float16", "bfloat16")


def is_gguf_name(name: str) -> bool:
    return name.lower().endswith(".gguf")


@dataclass
class GGUFInfo:
    path: Path
    architecture: str
    name: str | None
    types: dict[str, int]  # tensor type name -> how many tensors have it
    size: int
    tokens: int | None = None  # how many tokens its vocabulary lists (None: it has none)
    blocks: int = 0  # how many layers its tensors hold (blk.N.*)

    def describe(self) -> str:
        kinds = "/".join(sorted(self.types, key=lambda t: -self.types[t]))
        return f"{self.architecture}, {kinds}, {self.size / 2**20:.0f} MiB"


def inspect(path: Path) -> GGUFInfo:
    """What a GGUF file holds, read from its header; a one-line CloverError for anything transformers cannot load."""
    path = Path(path)
    size = check_magic(path)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CloverError("reading a GGUF file needs the gguf package: pip install gguf")
    try:
        reader = GGUFReader(str(path))
        arch = _field(reader, "general.architecture")
        name = _field(reader, "general.name")
        vocabulary = reader.fields.get("tokenizer.ggml.tokens")
        tokens = len(vocabulary.data) if vocabulary is not None else None
        types: dict[str, int] = {}
        end = 0
        blocks = set()
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
            if t.name.startswith("blk.") and t.name.split(".")[1].isdigit():
                blocks.add(int(t.name.split(".")[1]))
            end = max(end, int(t.data_offset) + int(t.n_bytes))
    except CloverError:
        raise
    except Exception as e:  # the reader fails in many ways on a cut or damaged file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CloverError(f"{path} is a damaged or truncated GGUF file ({first})")
    if end > size:
        raise CloverError(f"{path} is a truncated GGUF file: its tensors need {end} bytes, it has {size}")
    if not arch:
        raise CloverError(f"{path} is a damaged GGUF file: it names no architecture")
    supported = _supported_architectures()
    if not {arch, arch.replace("-", "_"), _RENAMED.get(arch)} & supported:
        raise CloverError(f"{path} holds a {arch} model, an architecture transformers cannot read from GGUF "
                          f"(it reads {', '.join(sorted(supported))})")
    unknown = sorted(t for t in types if not _can_dequantize(t))
    if unknown:
        raise CloverError(f"{path} holds {', '.join(unknown)} tensors, which the gguf package cannot dequantize")
    return GGUFInfo(path, arch, name, types, size, tokens, len(blocks))


def check_magic(path: Path) -> int:
    """The file's size, once it is known to start as a GGUF does; else a one-line CloverError."""
    if path.exists() and not path.is_file():  # a FIFO is not opened (it would wait for a writer), nor a device
        raise CloverError(f"{path} is not a regular file")
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise CloverError(f"{path}: no such file")
    except OSError as e:
        raise CloverError(f"cannot read {path}: {e.strerror or e}")
    if not path.is_file():
        raise CloverError(f"{path} is not a regular file")
    if head != MAGIC:
        raise CloverError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    return size


def _field(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) else None


# GGUF architecture names transformers reads as another model type (its own renames, in load_gguf_checkpoint)
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


def _supported_architectures() -> set[str]:
    """The architectures transformers reads from GGUF: its config mapping's (less the two sections of that mapping
    that are not architectures) and those of its newer GGUF loader."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    try:
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    except Exception:  # noqa: BLE001 - a transformers without it
        pass
    return names


def _can_dequantize(type_name: str) -> bool:
    """Whether the gguf package dequantizes tensors of this type (float types are read as they are)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name, None)
    if qtype is None:
        return False
    if type_name in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
        return True
    return qtype in getattr(gguf.quants, "_type_traits", {})


# ---------------------------------------------------------------------------------------------------------------
# converted directories (their keys and paths: clover_cli/store.py)


def is_converted(directory: Path) -> bool:
    """A finished conversion by this converter with these versions of transformers and gguf (either may change what
    a file converts to): its record says so, and its config and weights are there."""
    record = source_of(directory)
    return (record is not None and record.get("converter") == CONVERTER and record.get("versions") == _versions()
            and (directory / "config.json").is_file() and any(directory.glob("*.safetensors")))


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("transformers", "gguf"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


# ---------------------------------------------------------------------------------------------------------------
# conversion


def convert(path: Path, dtype: str = "float32", quiet: bool = False) -> Path:
    """The model directory made from the GGUF file `path` with weights in `dtype` (made now, or found in the cache).
    Raises CloverError in one line."""
    if dtype not in DTYPES:
        raise CloverError(f"a GGUF converts to one of {', '.join(DTYPES)}, not {dtype!r}")
    path = Path(path).expanduser()
    if not path.exists():
        raise CloverError(f"{path}: no such file")
    if not path.is_file():
        raise CloverError(f"{path} is not a regular file")
    check_magic(path)  # before the whole file is read for its hash: a file that is not a GGUF is told at once
    try:
        sha = content_hash(path)
    except OSError as e:
        raise CloverError(f"cannot read {path}: {e.strerror or e}")
    out = converted_dir(sha, dtype)
    if is_converted(out):
        return out
    info = inspect(path)
    say = (lambda text: None) if quiet else (lambda text: print(f"clover: {text}", file=sys.stderr, flush=True))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path(out.name)))  # one conversion of a file at a time: the second waits, finds it
        if not _try_lock(lock):
            say(f"waiting for another clover process converting {path.name}")
            lock.acquire()
    except (OSError, Timeout) as e:
        raise CloverError(f"cannot write the converted model into {out.parent}: {getattr(e, 'strerror', None) or e}")
    try:
        if is_converted(out):
            return out
        say(f"converting {path.name} ({info.describe()}) to {dtype} for transformers: once per file, cached in {out}")
        t0 = time.perf_counter()
        try:
            atomic.clean_stale(out)
            tmp = atomic.temp_dir(out)
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _write_converted(info, sha, dtype, tmp, quiet)
                if out.exists():  # a damaged or outdated conversion: nobody else writes it while the lock is held
                    shutil.rmtree(out)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:
            raise CloverError(f"cannot write the converted model into {out.parent}: {e.strerror or e}")
        say(f"converted in {time.perf_counter() - t0:.0f} s")
        return out
    finally:
        lock.release()


def _try_lock(lock) -> bool:
    try:
        lock.acquire(timeout=0)
        return True
    except Timeout:
        return False


def _write_converted(info: GGUFInfo, sha: str, dtype: str, tmp: Path, quiet: bool) -> None:
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # its "loading weights" and "writing shards" bars: the dequantizing one is ours
    # read from a folder holding the file alone: transformers also reads tokenizer and template files from the
    # folder a GGUF sits in, and whatever lies beside the user's file is not what the file says
    alone = Path(tempfile.mkdtemp(prefix="clover-gguf-"))
    name = "model.gguf"
    (alone / name).symlink_to(info.path.resolve())
    folder = str(alone)
    try:
        with warnings.catch_warnings(), _progress(quiet):
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            _check_layers(info, AutoConfig.from_pretrained(folder, gguf_file=name))  # before a model is built
            model, loading = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=getattr(torch, dtype), output_loading_info=True, **_dequantized())
    except (MemoryError, KeyboardInterrupt, CloverError):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:240]
        raise CloverError(f"transformers cannot load {info.path} ({info.architecture}): {first}")
    finally:
        shutil.rmtree(alone, ignore_errors=True)
    _check_complete(info, loading.get("missing_keys") or [])
    # what transformers records of the GGUF's quantization describes the file, not these dequantized weights, and
    # save_pretrained refuses a model that claims to be quantized
    model.config.__dict__.pop("quantization_config", None)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _drop_tokens_not_in_file(tmp, info.tokens)
    _write_blocks(info, model, tmp)
    record = {"converter": CONVERTER, "versions": _versions(), "gguf": str(info.path.resolve()), "name": info.name,
              "sha256": sha,
              "architecture": info.architecture, "tensor_types": info.types, "dtype": dtype, "size": info.size}
    (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _write_blocks(info: GGUFInfo, model, tmp: Path) -> None:
    """The file's quantized tensors, decoded, checked against the weights transformers made of them and repacked for
    clover's CPU kernels (clover_cli/quantized.py), beside the converted weights: what `--dtype auto` runs on a CPU.
    A file of float tensors only has none."""
    from gguf import GGUFReader

    from .quantized import BLOCKS_FILE, GGUF_TYPES, gguf_blocks, write_blocks

    if not set(info.types) & set(GGUF_TYPES):
        return
    blocks, left = gguf_blocks(GGUFReader(str(info.path)), model)
    if blocks:
        write_blocks(tmp / BLOCKS_FILE, blocks, left)


def _check_layers(info: GGUFInfo, config) -> None:
    """The layers the metadata makes must be the layers the tensors hold: transformers builds the model from the
    metadata, gives the layers the file lacks random weights (where the metadata leaves the count out, the model
    class's default: 32 for llama) and leaves out the tensors of layers it does not count."""
    layers = getattr(config, "num_hidden_layers", None)
    if info.blocks and isinstance(layers, int) and layers != info.blocks:
        raise CloverError(f"{info.path} is a damaged GGUF file: its metadata makes {layers} layers "
                          f"({info.architecture}.block_count) where its tensors hold {info.blocks}")


def _check_complete(info: GGUFInfo, missing) -> None:
    """transformers gives a weight the file lacks random values and carries on: a file missing a tensor would
    become a model of noise. One line instead."""
    if missing:
        names = sorted(missing, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise CloverError(f"{info.path} is a damaged GGUF file: {len(names)} weights of its {info.architecture} "
                          f"model are not in it ({shown})")


def _dequantized() -> dict:
    """from_pretrained's arguments that unpack every weight into plain floats: where transformers can keep a GGUF's
    weights in their blocks (its GGUF quantizer, with the `kernels` package installed), it would, and a directory of
    packed blocks is not a model clover runs."""
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers before its GGUF quantizer: it always dequantizes
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _drop_tokens_not_in_file(directory: Path, count: int | None) -> None:
    """Remove from the saved tokenizer the tokens past the file's own vocabulary. transformers builds a byte-level
    vocabulary from a GGUF as GPT-2's tokenizer, which adds GPT-2's `<|endoftext|>` (its default unknown, BOS and EOS
    token) when the file has no such token, as Llama 3's has not: one token more than the model embeds, which the
    file never had and nothing in it names, and a tokenizer clover rightly refuses beside that model."""
    if not count:
        return
    path, config_path = directory / "tokenizer.json", directory / "tokenizer_config.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    added = spec.get("added_tokens") or []
    extra = {t.get("content") for t in added if t.get("id", 0) >= count}
    if not extra:
        return
    spec["added_tokens"] = [t for t in added if t.get("id", 0) < count]
    text = json.dumps(spec, ensure_ascii=False, indent=2)
    path.write_text(text, encoding="utf-8")  # not atomic: in the conversion's temporary directory, renamed whole
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        config["added_tokens_decoder"] = {k: v for k, v in decoder.items() if not (k.isdigit() and int(k) >= count)}
    for key, value in list(config.items()):
        if key.endswith("_token") and value in extra:
            config[key] = None
        elif key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
            config[key] = [t for t in value if t not in extra]
    text = json.dumps(config, ensure_ascii=False, indent=2) + "\n"
    config_path.write_text(text, encoding="utf-8")  # not atomic: in the conversion's temporary directory


class _progress:
    """transformers reads a GGUF's tensors under a tqdm bar of its own: drawn on a terminal, silent otherwise."""

    def __init__(self, quiet: bool):
        self.quiet = quiet or not sys.stderr.isatty()

    def __enter__(self):
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        from tqdm.auto import tqdm

        self.module, self.saved = gguf_utils, gguf_utils.tqdm
        if self.quiet:
            gguf_utils.tqdm = lambda iterable, *a, **k: tqdm(iterable, *a, **{**k, "disable": True})
        else:
            gguf_utils.tqdm = lambda iterable, *a, **k: tqdm(iterable, *a, **{**k, "desc": "dequantizing",
                                                                              "leave": False, "file": sys.stderr})
        return self

    def __exit__(self, *exc):
        self.module.tqdm = self.saved
        return False


def source_of(directory: Path) -> dict | None:
    """The record of the GGUF a converted directory was made from, or None for any other directory."""
    try:
        record = json.loads((Path(directory) / SOURCE_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None
