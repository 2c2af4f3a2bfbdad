"""Every causal-LM architecture transformers knows, tiny and random: does clover run it exactly or refuse it?

    python scripts/arch_sweep.py [--only llama,gpt2] [--json out.json]

For each model type: a tiny config (hidden 64, 2 layers, vocabulary 96, overrides where a type needs them), the
model built from it, then what `clover chat` does at load (Target + check_exact). Accepted models are decoded
greedily with --draft none and ngram (tree budget 16) and compared with transformers' own generate. Outcomes:
exact / WRONG (accepted but different tokens: a bug) / refused (one line) / TRACEBACK (a bug) / no tiny model (the
type needs more than this script gives it: not counted).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from clover_cli.atomic import write_text  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            head_dim=16)


# What a type needs beyond BASE for a tiny config to be valid (None: leave that BASE key out)
OVERRIDES = {
    "falcon": {"head_dim": None, "new_decoder_architecture": True, "num_kv_heads": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "num_heads": 4},
    "zamba2": {"layer_types": ["linear_attention", "hybrid"], "layers_block_type": ["mamba", "hybrid"],
               "hybrid_layer_ids": [1], "head_dim": None},
    "mamba2": {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1},
    "plbart": {"encoder_attention_heads": 4, "decoder_attention_heads": 4, "d_model": 64},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_experts": 4, "moe_intermediate_size": 32},
}


def tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    over = OVERRIDES.get(model_type, {})
    kwargs = {k: v for k, v in {**BASE, **over}.items() if v is not None}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def run(model_type: str) -> str:
    from clover_cli.drafters.base import NoDrafter
    from clover_cli.drafters.ngram import NgramDrafter
    from clover_cli.decode.engine import Engine
    from clover_cli.decode.verify import StopCheck
    from clover_cli.errors import CloverError
    from clover_cli.target import Target, check_exact
    from helpers import hf_greedy, run_engine

    try:
        model = tiny(model_type)
        if model.get_output_embeddings() is None or model.config.vocab_size != 96:
            return "no tiny model"
    except Exception as e:
        return f"no tiny model ({type(e).__name__})"
    try:
        target = Target(model)
        check_exact(target)
    except CloverError as e:
        return f"refused: {e}"
    except Exception as e:
        return f"TRACEBACK at load: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    rng = random.Random(model_type)
    try:
        for kind in ("none", "ngram"):
            for _ in range(2):
                base = [rng.randrange(3, 96) for _ in range(rng.randint(3, 7))]
                prompt = base * 3
                try:
                    reference = hf_greedy(model, prompt, 20)
                except Exception:
                    return "no tiny model (its own generate fails)"
                engine = Engine(target, NoDrafter() if kind == "none" else NgramDrafter(), budget=16,
                                auto_budget=False)
                out, _ = run_engine(engine, prompt, StopCheck(20))
                if out != reference:
                    return f"WRONG ({kind})"
    except Exception as e:
        return f"TRACEBACK decoding: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return "exact"


def main():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    ap.add_argument("--json")
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(run(args.child)))
        return
    types = args.only.split(",") if args.only else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results = {}
    for t in types:  # each in its own process: a type that crashes or hangs costs only its own row
        try:
            p = subprocess.run([sys.executable, __file__, "--child", t], capture_output=True, text=True,
                               timeout=args.timeout)
            lines = p.stdout.strip().splitlines()
            results[t] = json.loads(lines[-1]) if p.returncode == 0 and lines else \
                f"no tiny model (the process ended with code {p.returncode})"
        except subprocess.TimeoutExpired:
            results[t] = f"no tiny model (over {args.timeout} s)"
        print(f"{t:28s} {results[t]}", flush=True)
    counts = {}
    for r in results.values():
        key = r.split(":")[0].split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    print(json.dumps(counts))
    if args.json:
        write_text(Path(args.json), json.dumps({"counts": counts, "results": results}, indent=1))


if __name__ == "__main__":
    main()
