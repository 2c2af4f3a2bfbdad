"""Prepacked CPU linears: same results as F.linear, used only where the engine asks, never stale; F.linear for the
row counts where it was timed faster."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from clover_cli import packed
from clover_cli.packed import PackedLinear, pack_linears, packed_linears
from clover_cli.target import Target
from helpers import hf_greedy
from test_lossless import make_model

pytestmark = pytest.mark.skipif(not packed.supported(), reason="this torch build has no oneDNN prepacked linear")


@pytest.fixture(autouse=True)
def every_row_count_packed(monkeypatch):
    """The packed path itself is what these tests check: CLOVER_PACKED=1 packs every row count, untimed (the timed
    choice's tests set CLOVER_PACKED=auto themselves)."""
    monkeypatch.setenv("CLOVER_PACKED", "1")


def _mlp(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96, bias=bias), nn.SiLU(), nn.Linear(96, 48, bias=bias))


def _reference(mlp, x):
    return F.linear(F.silu(F.linear(x, mlp[0].weight, mlp[0].bias)), mlp[2].weight, mlp[2].bias)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_matches_f_linear(rows, bias):
    mlp = _mlp(rows, bias)
    assert pack_linears(mlp) == 2 and all(type(m) is PackedLinear for m in (mlp[0], mlp[2]))
    x = torch.randn(3, rows, 64)
    with torch.inference_mode(), packed_linears():
        out = mlp(x)
    torch.testing.assert_close(out, _reference(mlp, x), rtol=1e-5, atol=1e-5)
    # each row is computed on its own: the same row alone gives the very same numbers
    with torch.inference_mode(), packed_linears():
        assert torch.equal(mlp(x[:, :1]), out[:, :1])


def test_outside_the_block_or_with_autograd_it_is_stock_f_linear():
    mlp = _mlp()
    x = torch.randn(4, 64)
    stock = _reference(mlp, x)
    pack_linears(mlp)
    calls = []
    real = packed._linear
    packed._linear = lambda *a: calls.append(1) or real(*a)
    try:
        with torch.inference_mode():
            assert torch.equal(mlp(x), stock)  # bit for bit: transformers' own generate is untouched
        with packed_linears():  # autograd on: training through a packed module must get gradients
            out = mlp(x.requires_grad_())
        out.sum().backward()
        assert mlp[0].weight.grad is not None and not calls
        with torch.inference_mode(), packed_linears():
            mlp(x.detach())
        assert len(calls) == 2
    finally:
        packed._linear = real


def test_a_changed_moved_or_copied_weight_is_packed_again():
    mlp = _mlp()
    pack_linears(mlp)
    x = torch.randn(2, 64)
    with torch.no_grad():
        mlp[0].weight.mul_(-1.5)  # an optimizer step, in place
        mlp[2].bias.add_(1.0)  # bias is read at every call, no repack needed
    with torch.inference_mode(), packed_linears():
        torch.testing.assert_close(mlp(x), _reference(mlp, x), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(mlp)
    again = pickle.loads(pickle.dumps(mlp))
    with torch.no_grad():
        twin[2].weight.zero_()
    with torch.inference_mode(), packed_linears():
        torch.testing.assert_close(twin(x), twin[2].bias.expand(2, -1))
        torch.testing.assert_close(again(x), _reference(mlp, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp(x), _reference(mlp, x), rtol=1e-5, atol=1e-5)
    for _ in range(5):  # a replaced weight may land where the old one was: still packed again
        mlp[0].weight.data = torch.randn_like(mlp[0].weight)
        mlp[0].weight.data = torch.randn_like(mlp[0].weight)
        with torch.inference_mode(), packed_linears():
            torch.testing.assert_close(mlp(x), _reference(mlp, x), rtol=1e-5, atol=1e-5)
    mlp.to(torch.bfloat16).to(torch.float32)  # a round trip through bf16 rounds the weights: the packed copy too
    with torch.inference_mode(), packed_linears():
        torch.testing.assert_close(mlp(x), _reference(mlp, x), rtol=1e-5, atol=1e-5)
    mlp.to(torch.float64)  # a dtype the packed path does not take: stock F.linear on the new weights
    assert not hasattr(mlp[0], "packed")  # and the old packed copy is not kept in memory
    with torch.inference_mode(), packed_linears():
        torch.testing.assert_close(mlp(x.double()), _reference(mlp, x.double()))


def test_tied_weights_stay_tied():
    emb = nn.Embedding(48, 64)
    head = nn.Linear(64, 48, bias=False)
    head.weight = emb.weight
    pack_linears(head)
    assert head.weight is emb.weight
    with torch.no_grad():
        emb.weight.mul_(2)  # the embedding changes: the head follows
    x = torch.randn(3, 64)
    with torch.inference_mode(), packed_linears():
        torch.testing.assert_close(head(x), x @ emb.weight.T, rtol=1e-5, atol=1e-5)


def test_the_packed_path_is_per_thread():
    import threading

    mlp = _mlp()
    pack_linears(mlp)
    x = torch.randn(2, 64)
    seen = []

    def other():
        with torch.inference_mode():
            seen.append(torch.equal(mlp(x), _reference(mlp, x)))  # not inside this thread's block: stock

    with torch.inference_mode(), packed_linears():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [True]


def test_what_is_not_packed():
    assert pack_linears(_mlp(), max_bytes=1000) == 0  # too big for the memory cap: left alone
    half = _mlp().to(torch.bfloat16)
    assert pack_linears(half) == 0 and type(half[0]) is nn.Linear

    class Custom(nn.Linear):  # e.g. bitsandbytes' Linear8bitLt: a subclass is never swapped
        pass

    net = nn.Sequential(Custom(4, 4), nn.Linear(4, 4))
    assert pack_linears(net) == 1 and type(net[0]) is Custom


def test_target_packs_its_model_and_transformers_generate_is_unchanged():
    model = make_model("llama", 3)
    prompt = [5, 17, 9, 33, 2, 61]
    before = hf_greedy(model, prompt, 24)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    target = Target(model)
    assert type(model.get_output_embeddings()) is PackedLinear
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([prompt])).logits, logits)
    assert hf_greedy(model, prompt, 24) == before
    _, mine = target.forward(torch.tensor(prompt))
    torch.testing.assert_close(mine, logits[0], rtol=1e-4, atol=1e-4)


def test_timed_choice_runs_f_linear_where_it_was_faster(monkeypatch):
    """Unless CLOVER_PACKED=1, pack_linears times F.linear against the packed product per weight shape for 1, 2, 3-4,
    5-8 and 9-16 rows, once per shape, and a PackedLinear runs F.linear (bit for bit) in the buckets where that was
    faster; 17 rows and more, and the buckets where packing won, run packed."""
    monkeypatch.setenv("CLOVER_PACKED", "auto")
    asked = []

    def fake_stock_faster(m, rows):  # stands in for the timing: F.linear "faster" for 1 and 3-4 rows only
        asked.append((tuple(m.weight.shape), rows))
        return rows in (1, 4)

    monkeypatch.setattr(packed, "stock_faster", fake_stock_faster)
    monkeypatch.setattr(packed, "_stock_buckets", {})
    mlp = _mlp(7)
    assert pack_linears(mlp) == 2
    assert sorted(asked) == sorted((shape, rows) for shape in ((96, 64), (48, 96)) for rows in packed.TIMED_ROWS)
    assert mlp[0].stock_buckets == (True, False, True, False, False)
    calls = []
    real = packed._linear
    monkeypatch.setattr(packed, "_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows, stock in ((1, True), (2, False), (3, True), (4, True), (5, False), (16, False), (17, False),
                        (70, False)):
        x = torch.randn(rows, 64)
        calls.clear()
        with torch.inference_mode(), packed_linears():
            out = mlp(x)
        assert (calls == []) == stock, (rows, calls)
        if stock:
            assert torch.equal(out, _reference(mlp, x))
        torch.testing.assert_close(out, _reference(mlp, x), rtol=1e-5, atol=1e-5)
    asked.clear()
    twin = _mlp(8)
    pack_linears(twin)  # the same shapes: timed once per process, the choice reused
    assert asked == [] and twin[2].stock_buckets == mlp[2].stock_buckets


def test_timed_choice_is_a_real_timing_and_leaves_the_seed_alone(monkeypatch):
    """stock_faster itself: it returns a bool from real timings of both products, without drawing from torch's global
    generator (seeded runs stay as they were)."""
    monkeypatch.setenv("CLOVER_PACKED", "auto")
    mlp = _mlp(9)
    pack_linears(mlp)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    assert all(isinstance(packed.stock_faster(mlp[0], rows), bool) for rows in packed.TIMED_ROWS)
    assert torch.equal(torch.rand(3), want)


def test_lazy_packing_waits_for_the_first_packed_forward(monkeypatch):
    """pack_linears(lazy=True) makes the PackedLinears at once but packs, warms and times them (0.5-2 s for the
    bundled model) only when one of them first runs packed, all of its call's linears together, or on
    finish_packing; outside the packed block they run F.linear and set nothing off."""
    monkeypatch.setenv("CLOVER_PACKED", "auto")
    monkeypatch.setattr(packed, "_stock_buckets", {})
    timed = []
    monkeypatch.setattr(packed, "stock_faster", lambda m, rows: timed.append(rows) or False)
    mlp = _mlp(11)
    assert pack_linears(mlp, lazy=True) == 2
    assert all(type(m) is PackedLinear and "packed" not in m.__dict__ for m in (mlp[0], mlp[2]))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(mlp(x), _reference(mlp, x))  # outside the block: stock, still lazy
    assert timed == [] and "packed" not in mlp[2].__dict__
    with torch.inference_mode(), packed.stock_linears(), packed_linears():
        assert torch.equal(mlp(x), _reference(mlp, x))  # a check at load runs stock, even inside the block
    assert timed == [] and "packed" not in mlp[2].__dict__
    with torch.inference_mode(), packed_linears():
        out = mlp(x)
    torch.testing.assert_close(out, _reference(mlp, x), rtol=1e-5, atol=1e-5)
    assert len(timed) == 2 * len(packed.TIMED_ROWS)  # both shapes timed, by the first linear's forward
    assert all(m.pending is None and "packed" in m.__dict__ and m.stock_buckets == (False,) * 5
               for m in (mlp[0], mlp[2]))
    other = _mlp(12)
    pack_linears(other, lazy=True)
    packed.finish_packing(other)
    assert all(m.pending is None and "packed" in m.__dict__ for m in (other[0], other[2]))


def test_a_session_packs_the_target_only_when_its_forwards_run_eager(llama_dir, monkeypatch, tmp_path):
    """The session's target is packed lazily: with --compile off (and whenever the compiled step is not active) it is
    packed at load, behind the chat's prompt, not in the first reply; while the compiled step runs every forward it
    stays unpacked (the load skips the cost)."""
    from clover_cli.step import manager
    from clover_cli.session import Options, Session

    def targets_pending(session):
        return [m.pending is not None for m in session.model.modules() if isinstance(m, PackedLinear)]

    eager = Session(Options(model=str(llama_dir), draft="ngram", compile="off"), quiet=True)
    assert targets_pending(eager) and not any(targets_pending(eager))
    # as if a compiled package had been found: the step is active from the start
    monkeypatch.setattr(manager.StepCompiler, "active", property(lambda self: True))
    skipped = Session(Options(model=str(llama_dir), draft="ngram", compile="off"), quiet=True)
    assert all(targets_pending(skipped))
    # heads whose programs are not attached run eager, through the target's lm_head: packed at load
    from transformers import AutoModelForCausalLM

    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads, save_heads

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    heads = build_heads(HeadsConfig.for_target(model.config, architecture="clover2", num_heads=2, num_layers=1), model)
    heads.init_from_target(model)
    save_heads(heads, tmp_path / "heads", "test heads")
    eager_heads = Session(Options(model=str(llama_dir), heads=str(tmp_path / "heads"), draft="clover",
                                  compile="off"), quiet=True)
    assert targets_pending(eager_heads) and not any(targets_pending(eager_heads))
    # and a context longer than the compiled programs hold runs its forwards eager past them: packed too
    monkeypatch.setattr(manager, "capacity_for", lambda context: 16)
    longer = Session(Options(model=str(llama_dir), draft="ngram", compile="off"), quiet=True)
    assert not any(targets_pending(longer))
