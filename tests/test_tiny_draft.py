"""The bundled draft model (clover_cli/bundled/tiny/draft): it loads on its own, shares the target's tokenizer,
is much smaller, and guesses the target's greedy next token far above chance (scripts/tiny/evaluate_draft.py
measures it properly; this is the cheap check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import clover_cli

TINY = Path(clover_cli.__file__).parent / "bundled" / "tiny"
DRAFT = TINY / "draft"
# docs/tiny_draft_eval.json: 0.88 held-out top-1 agreement; this asks for half of it (a fresh model: ~0)
MIN_AGREEMENT = 0.44
N_PROMPTS, N_NEW = 4, 32


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(TINY), AutoTokenizer.from_pretrained(DRAFT)


def test_draft_shares_the_targets_tokenizer_and_is_small(models):
    target, draft, tok, dtok = models
    assert draft.config.model_type == "llama"
    assert draft.config.vocab_size == target.config.vocab_size == len(tok)
    assert dtok.get_vocab() == tok.get_vocab()
    assert (dtok.bos_token_id, dtok.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert dtok.chat_template == tok.chat_template
    assert (DRAFT / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    assert n_d * 4 < n_t
    assert sum(p.stat().st_size for p in DRAFT.iterdir()) < 4e6


@pytest.fixture(scope="module")
def greedy(models):
    """The target's own greedy replies to a few bundled prompts, with its greedy next token at each position
    (teacher-forced): [(sequence, first reply position - 1, target's next tokens over the reply)]."""
    target, _, tok, _ = models
    rows = [json.loads(line) for line in (Path(clover_cli.__file__).parent / "bench_prompts.jsonl").open()]
    out = []
    with torch.inference_mode():
        for row in rows[:N_PROMPTS]:
            text = tok.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
            prompt = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, -256:]
            seq = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=N_NEW, pad_token_id=tok.eos_token_id)
            a, b = prompt.shape[1] - 1, seq.shape[1] - 1
            out.append((seq, a, target(input_ids=seq).logits[0, a:b].argmax(-1)))
    return out


def _agreement(draft, greedy) -> float:
    """Top-1 agreement of `draft` with the target's greedy next token over the target's greedy replies."""
    hit = cnt = 0
    with torch.inference_mode():
        for seq, a, t in greedy:
            d = draft(input_ids=seq).logits[0, a:a + len(t)].argmax(-1)
            hit += (t == d).sum().item()
            cnt += len(t)
    return hit / cnt


def test_draft_agrees_with_the_target_far_above_chance(models, greedy):
    _, draft, _, _ = models
    rate = _agreement(draft, greedy)
    assert rate >= MIN_AGREEMENT, rate
    # and the check can fail: the same architecture with fresh weights is near chance (1/8192)
    from transformers import AutoConfig, AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DRAFT)).eval()
    assert _agreement(fresh, greedy) < MIN_AGREEMENT / 4
