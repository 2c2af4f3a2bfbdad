"""How often a model's greedy reply on its quantized weights (a GGUF's own blocks, or --quantize) is the reply on
its float32 weights, on `clover bench`'s prompts: the quantized kernels round the activations to int8 per group (as
llama.cpp does), so where two tokens are within that rounding of each other the choice may differ, and from there
the reply.

    python scripts/weights_agreement.py smollm2 --limit 27 -n 128           # the GGUF's blocks against float32
    python scripts/weights_agreement.py tiny --weights int4                 # --quantize int4 against float32

Both runs are clover's own plain greedy decoding (`--draft none`, the compiled step where it is built; on float32
weights transformers' greedy generate on them, up to float32 noise). Prints one JSON object: prompts whose
replies are identical, and for the others the token where they part and how far the two logits were apart there
in the float32 model.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date


def replies(model: str, opts: dict, prompts, n: int) -> tuple[list[list[int]], str, object]:
    from clover_cli.decode.verify import Sampling
    from clover_cli.session import Options, Session

    session = Session(Options(model=model, draft="none", **opts), quiet=True)
    session.compiler.start(background=False)
    out = []
    for prompt in prompts:
        ids = session.encode_chat(prompt["messages"])
        tokens = []
        for event in session.generate(ids, n, Sampling()):
            tokens += event.tokens
        out.append(tokens)
    return out, session.weights_text + ("; compiled" if session.compiler.active else "; eager"), session


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--weights", default="gguf", choices=("gguf", "int8", "int4"))
    ap.add_argument("--limit", type=int, default=None, help="First N bench prompts (default: all).")
    ap.add_argument("-n", type=int, default=128)
    a = ap.parse_args()

    import torch

    from clover_cli.bench import load_prompts

    prompts = load_prompts(None, a.limit)
    quantized_opts = {} if a.weights == "gguf" else {"quantize": a.weights}
    mine, what, _ = replies(a.model, quantized_opts, prompts, a.n)
    theirs, float_what, session = replies(a.model, {"dtype": "float32"}, prompts, a.n)
    parted = []
    for prompt, q, f in zip(prompts, mine, theirs):
        if q == f:
            continue
        at = next((i for i, (x, y) in enumerate(zip(q, f)) if x != y), min(len(q), len(f)))
        ids = session.encode_chat(prompt["messages"]) + f[:at]
        with torch.inference_mode():
            logits = session.model(torch.tensor([ids])).logits[0, -1]
        gap = None
        if at < min(len(q), len(f)):
            gap = float(logits[f[at]] - logits[q[at]])
        parted.append({"prompt": prompt.get("id") or prompt.get("category"), "token": at, "float32_logit_gap": gap})
    print(json.dumps({"model": a.model, "weights": what, "against": float_what, "prompts": len(prompts),
                      "max_new_tokens": a.n, "identical": len(prompts) - len(parted), "parted": parted,
                      "machine": platform.machine(), "date": date.today().isoformat()}, indent=1))


if __name__ == "__main__":
    main()
