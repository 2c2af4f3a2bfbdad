"""What `clover train` costs per token on this machine, without training anything: the target's feature extraction
(one forward of a --len-token conversation, what --cache-features stores) and one optimiser step of the heads on
random features (loss, backward, AdamW), in tokens per second. For budgeting a heads run before starting it.

    python scripts/train_throughput.py smollm2 --heads 5 --layers 2 --draft-vocab 8192
"""

from __future__ import annotations

import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--heads", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="0: the whole vocabulary")
    ap.add_argument("--len", type=int, default=1024, help="tokens per conversation")
    ap.add_argument("--batch", type=int, default=8, help="conversations per optimiser step")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from clover_cli.drafters.common import HeadsConfig
    from clover_cli.drafters.registry import build_heads
    from clover_cli.hub import resolve_model
    from clover_cli.loading import load
    from clover_cli.train import TrainConfig, heads_loss
    from clover_cli.train.features import _hidden

    model = load(resolve_model(a.model).path, device="cpu", dtype="auto").model.requires_grad_(False)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    x = torch.randint(0, vocab, (1, a.len))
    for _ in range(2):
        t = time.perf_counter()
        with torch.no_grad():
            _hidden(model, x)
        print(f"features: {a.len / (time.perf_counter() - t):.0f} tokens/s")

    cfg = HeadsConfig.for_target(model.config, architecture="clover2", num_heads=a.heads, num_layers=a.layers,
                                 name=a.model)
    cfg.draft_vocab_size = a.draft_vocab
    heads = build_heads(cfg, model)
    heads.init_from_target(model)
    heads.draft_vocab = torch.arange(a.draft_vocab) if a.draft_vocab else None
    heads.train()
    train_cfg = TrainConfig(model=a.model, out="unused", loss_vocab="draft" if a.draft_vocab else "full")
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-3)
    x = torch.randint(0, vocab, (a.batch, a.len))
    mask = torch.ones(a.batch, a.len)
    pre, post = torch.randn(a.batch, a.len, hidden), torch.randn(a.batch, a.len, hidden)
    for _ in range(3):
        t = time.perf_counter()
        loss, _ = heads_loss(heads, "clover", model, x, mask, pre, post, train_cfg)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"heads step: {a.batch * a.len / (time.perf_counter() - t):.0f} tokens/s")


if __name__ == "__main__":
    main()
