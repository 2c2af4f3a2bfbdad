"""The n-gram drafter's prior: tri-gram counts of the model's own replies, kept in its directory (PRIOR_FILE)."""

from __future__ import annotations

import random
import shutil
from collections import Counter, defaultdict

import pytest
import torch

from clover_cli.drafters.ngram import NgramDrafter, load_prior, prior_table, save_prior
from clover_cli.store import PRIOR_FILE
from clover_cli.decode.engine import Engine
from clover_cli.decode.verify import StopCheck
from clover_cli.errors import CloverError
from clover_cli.target import Target
from helpers import hf_greedy, run_engine
from test_lossless import make_model
from test_reliability import one_line_error


def counts(rows):
    table = defaultdict(Counter)
    for a, b, c, n in rows:
        table[(a, b)][c] += n
    return table


def test_the_prior_drafts_where_the_conversation_has_no_counts():
    prior = prior_table(counts([(1, 2, 3, 5), (1, 2, 4, 1), (2, 3, 7, 2), (3, 7, 8, 1), (3, 7, 9, 9), (7, 9, 5, 1),
                                (7, 9, 6, 1), (7, 9, 10, 1), (7, 9, 11, 1), (7, 9, 12, 1), (7, 9, 13, 1),
                                (7, 9, 14, 1), (7, 9, 15, 1), (7, 9, 16, 1), (7, 9, 17, 1), (7, 9, 18, 1)]))
    assert (7, 9) not in prior  # its best next token has under MIN_CHAIN_P of the counts: no chain goes on from it
    tree = NgramDrafter(prior=prior).propose([1, 2], 16)
    assert tree.tokens[1:] == [3, 7, 9] and tree.parents[1:] == [0, 1, 2]
    assert tree.scores[1] > tree.scores[2] > tree.scores[3] > 0
    assert len(NgramDrafter().propose([1, 2], 16)) == 1  # nothing to draft without it
    # what the conversation itself says about a pair comes first: here 2 was followed by 5 after 1
    tree = NgramDrafter(prior=prior).propose([1, 2, 5, 0, 1, 2], 16)
    assert tree.tokens[1] == 5


def test_a_prior_file_round_trips_and_bad_ones_are_refused(tmp_path):
    table = counts([(1, 2, 3, 5), (1, 2, 4, 1), (2, 3, 7, 2)])
    save_prior(tmp_path / PRIOR_FILE, table)
    assert load_prior(tmp_path, vocab_size=8) == prior_table(table) == {(1, 2): (3, 5 / 6), (2, 3): (7, 1.0)}
    assert load_prior(tmp_path / "elsewhere", vocab_size=8) is None
    with pytest.raises(CloverError, match="larger vocabulary"):
        load_prior(tmp_path, vocab_size=7)
    from safetensors.torch import save_file

    for bad in ({"trigrams": torch.zeros(3, 3, dtype=torch.int64)}, {"other": torch.zeros(1, 4, dtype=torch.int64)},
                {"trigrams": torch.tensor([[1, 2, 3, 0]])}, {"trigrams": torch.tensor([[1, -2, 3, 1]])},
                {"trigrams": torch.zeros(2, 4)}):
        save_file(bad, str(tmp_path / PRIOR_FILE))
        with pytest.raises(CloverError, match="not a table"):
            load_prior(tmp_path, vocab_size=8)
    (tmp_path / PRIOR_FILE).write_bytes(b"\x07" * 100)
    with pytest.raises(CloverError, match="unreadable"):
        load_prior(tmp_path, vocab_size=8)


@pytest.mark.parametrize("seed", range(3))
def test_decoding_with_a_prior_is_lossless_and_uses_it(seed):
    """A prior made of the model's own greedy text (so that its chains get accepted) plus random counts: every
    output stays the target's own greedy output, and drafted tokens from the prior are accepted."""
    rng = random.Random(seed)
    model = make_model("llama", seed)
    start = [rng.randrange(3, 96) for _ in range(5)]
    own = start + hf_greedy(model, start, 60)  # the prompts below are pieces of it: their replies continue it
    rows = [(a, b, c, 3) for a, b, c in zip(own, own[1:], own[2:])]
    rows += [(rng.randrange(96), rng.randrange(96), rng.randrange(96), rng.randint(1, 4)) for _ in range(300)]
    prior = prior_table(counts(rows))
    target = Target(model)
    accepted = {True: 0, False: 0}
    for _ in range(4):
        prompt = own[:rng.randint(5, 7)]  # before the text starts repeating (what lookup alone drafts)
        n, budget = rng.randint(8, 40), rng.choice([4, 16])
        reference = hf_greedy(model, prompt, n)
        for with_prior in (True, False):
            engine = Engine(target, NgramDrafter(prior=prior if with_prior else None), budget=budget,
                            auto_budget=False)
            out, events = run_engine(engine, prompt, StopCheck(n))
            assert out == reference
            accepted[with_prior] += sum(ev.accepted for ev in events)
    assert accepted[True] > accepted[False]


def test_a_damaged_prior_beside_the_model_is_one_line(llama_dir, tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("CLOVER_COMPILE", "off")
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / PRIOR_FILE).write_bytes(b"\x07" * 100)
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello")
    one_line_error(run_cli("generate", str(model), "-f", str(prompt), "-n", "4", "--stats-file", "off"),
                   PRIOR_FILE)
    # a drafter that does not use the prior never reads it: plain decoding still works
    code, out, err = run_cli("generate", str(model), "-f", str(prompt), "-n", "4", "--stats-file", "off",
                             "--draft", "none")
    assert code == 0, err
    save_prior(model / PRIOR_FILE, counts([(1, 2, 3, 1)]))
    code, out, err = run_cli("generate", str(model), "-f", str(prompt), "-n", "4", "--stats-file", "off")
    assert code == 0, err


def test_the_prior_is_not_part_of_what_keys_the_compiled_step(llama_dir, tmp_path):
    """Writing (or rebuilding) a model's prior keeps its compiled step: the programs do not depend on it."""
    from clover_cli.store import package_key

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    before = package_key(model, torch.float32, 256)
    save_prior(model / PRIOR_FILE, counts([(1, 2, 3, 1)]))
    assert package_key(model, torch.float32, 256) == before
    (model / "extra.safetensors").write_bytes(b"")  # any other weights file does change it
    assert package_key(model, torch.float32, 256) != before
