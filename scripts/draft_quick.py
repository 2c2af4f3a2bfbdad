"""A quick draft model for the bundled `tiny` target, for trying and benchmarking `--draft model` (issue #16) until
a properly trained bundled draft exists: a smaller Llama with the target's tokenizer, its token embedding (tied
lm_head), final norm and first `--layers` decoder layers copied from the target, then distilled for a few minutes
on the target's own sampled chats (KL to the target's next-token distribution at every position).

    python scripts/draft_quick.py --out /tmp/tiny-draft --layers 1 --minutes 6

Writes a Hugging Face Llama directory (config, model.safetensors, tokenizer files) that `--draft-model` reads.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

BUNDLED = Path(__file__).resolve().parents[1] / "clover_cli" / "bundled" / "tiny"
PREFIX = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the user's questions. USER:")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED)
    target = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    cfg = target.config.to_dict()
    cfg["num_hidden_layers"] = args.layers
    cfg.pop("layer_types", None)
    dcfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    draft = LlamaForCausalLM(dcfg)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < args.layers}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    prefix = tok(PREFIX, add_special_tokens=True, return_tensors="pt").input_ids
    start, step = time.time(), 0
    while time.time() - start < args.minutes * 60:
        with torch.inference_mode():
            # half sampled, half greedy-ish (low temperature): what the target says, as the draft will see it
            temp = 1.0 if step % 2 == 0 else 0.3
            x = target.generate(prefix.repeat(args.batch, 1), do_sample=True, temperature=temp, top_k=0,
                                max_new_tokens=args.length, min_new_tokens=args.length,
                                pad_token_id=2, attention_mask=torch.ones_like(prefix.repeat(args.batch, 1)))
            teacher = target(x).logits.float()
        x = x.clone()
        teacher = teacher.clone()
        for _ in range(2):  # two steps per generated batch
            logits = draft(x).logits.float()
            loss = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher, -1), log_target=True,
                            reduction="batchmean") / x.shape[1]
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            step += 1
        with torch.no_grad():
            agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
        print(f"step {step} {time.time() - start:.0f}s kl {loss.item():.3f} top-1 agreement {agree:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.eval()
    draft.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(BUNDLED / name, out / name)
    print(f"wrote {out} ({sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
