"""Chat data: ShareGPT parsing item by item, strict errors with line numbers, assistant-only masks."""

from __future__ import annotations

import json

import pytest

from clover_cli.data import _iter_json_array, is_heldout, iter_conversations, tokenize_conversation
from clover_cli.errors import CloverError
from clover_cli.templates import VICUNA_V11


def test_a_truncated_array_yields_every_complete_item():
    items = [{"id": str(i), "conversations": []} for i in range(5)]
    text = json.dumps(items, indent=2)
    cut = text[: text.index('"id": "4"') + 5]  # cut inside the last item, as the ShareGPT file is
    assert [it["id"] for _, it in _iter_json_array(cut, "x", strict=False)] == ["0", "1", "2", "3"]
    with pytest.raises(CloverError, match=r"x:\d+: malformed JSON"):
        list(_iter_json_array(cut, "x", strict=True))


def test_jsonl_with_unicode_line_separators(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "one\u2028two\x85three"},
                                     {"role": "assistant", "content": "ok\u2029"}]}] * 2
    p.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    convs = list(iter_conversations(str(p)))
    assert len(convs) == 2 and convs[0][1][0]["content"] == "one\u2028two\x85three"


def test_roles_are_cleaned_to_alternating_turns(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"id": "x", "conversations": [
        {"from": "gpt", "value": "leading assistant turn is dropped"},
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "dangling question is dropped"}]}]))
    [(cid, msgs)] = list(iter_conversations(str(p)))
    assert [m["role"] for m in msgs] == ["user", "assistant"] and cid == "x"


def test_assistant_mask_covers_exactly_the_replies(llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."},
            {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "That makes 8."}]
    ids, mask = tokenize_conversation(tok, msgs, VICUNA_V11)
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == " It is 5.</s> That makes 8.</s>"
    assert len(ids) == len(mask)


def test_heldout_split_is_fixed_and_small():
    ids = [f"conv{i}" for i in range(5000)]
    held = [i for i in ids if is_heldout(i)]
    assert 0.01 < len(held) / len(ids) < 0.03
    assert held == [i for i in ids if is_heldout(i)]  # a pure function of the id
