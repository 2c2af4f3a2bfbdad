"""The heads' training loss: soft cross-entropy against the target's distribution plus feature regression, per head
(Clover-2, Medusa) or per step (EAGLE). What a family reads and how its terms weigh is its file's SPEC.training
(families.Training); a family with a loss of its own (EAGLE-3's, in drafters/eagle3.py) names it there."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import TrainConfig, training


def heads_loss(heads, arch: str, model, x, mask, pre, post, cfg: TrainConfig):
    """Total loss and per-head (loss, top-1 agreement with the target, positions) for one batch of heads of --arch
    `arch`."""
    B, T = x.shape
    lm_head = model.get_output_embeddings()
    trained = training(arch)
    reg_weight = cfg.reg_weight * trained.reg_scale
    if trained.loss is not None:
        return trained.loss(heads, model, x, mask, post, cfg)
    inner = getattr(heads, "module", heads)  # under DistributedDataParallel
    # --loss-vocab draft: both distributions over the draft vocabulary only (the tokens the heads can propose),
    # the target's renormalised there: a head's projection costs draft_vocab / vocab_size of the whole one's
    vocab = getattr(inner, "draft_vocab", None) if cfg.loss_vocab == "draft" else None
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if vocab is not None:
        weight, bias = weight[vocab], (bias[vocab] if bias is not None else None)
    feature = pre if trained.features == "pre" else post
    if trained.noise and inner.training:  # EAGLE: the post-norm features, noised while training
        feature = feature + (torch.rand_like(feature) - 0.5) * trained.noise
    if trained.tokens:  # Clover-2, EAGLE: the features with the tokens, at their rotary positions
        pos = torch.arange(T, device=x.device)[None].expand(B, T)
        rope = inner.rotary(model)(feature, pos)
        outs = heads(feature, x, inner.token_embedding(model), rope, pos)  # forward: a DDP wrapper syncs gradients
    else:  # Medusa: the features alone
        outs = heads(feature)
    # The target's distribution at every position whose next token is an assistant token, computed once and
    # shared by all heads (head i reads it i positions further on). The soft cross-entropy of a head output o is
    #     -sum_v p(v) log q(v) = logsumexp(W o) - sum_v p(v) (W o)_v = logsumexp(W o) - (p W) . o
    # so the target side reduces to its expected output embedding pW, one [H] vector per position.
    need = torch.zeros_like(mask, dtype=torch.bool)
    need[:, :-1] = mask[:, 1:] > 0
    with torch.no_grad():
        t_logits = lm_head(post[need].to(lm_head.weight.dtype)).float()
        t_arg = t_logits.argmax(-1)
        t_prob = torch.softmax(t_logits if vocab is None else t_logits[:, vocab], -1)
        del t_logits
        t_emb = t_prob @ weight.float()
        t_bias = t_prob @ bias.float() if bias is not None else None
        del t_prob
        row_of = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row_of[need] = torch.arange(t_emb.shape[0], device=mask.device)
    total = pre.new_zeros(())
    per_head = []
    for i, out in enumerate(outs):
        n = T - 2 - i
        m = mask[:, 2 + i:2 + i + n] > 0 if n > 0 else None  # the token predicted at t is t+2+i
        if m is None or not m.any():
            # no position for this head in the batch: a zero term keeps its parameters in the graph, as
            # DistributedDataParallel needs every parameter to get a gradient on every process
            total = total + 0.0 * out.float().sum()
            per_head.append((0.0, 0.0, 0))
            continue
        student = out[:, :n][m]
        teacher = post[:, 1 + i:1 + i + n][m]
        rows = row_of[:, 1 + i:1 + i + n][m]
        s_logits = F.linear(student.to(weight.dtype), weight, bias)
        dot = (t_emb[rows] * student.float()).sum(-1) + (t_bias[rows] if t_bias is not None else 0.0)
        ce = (torch.logsumexp(s_logits.float(), -1) - dot).mean()
        reg = F.smooth_l1_loss(student.float(), teacher.float(), reduction="none").mean(-1).mean()
        loss_i = ce + reg_weight * reg
        total = total + (cfg.decay ** i) * loss_i
        s_arg = s_logits.argmax(-1) if vocab is None else vocab[s_logits.argmax(-1)]
        acc = (s_arg == t_arg[rows]).float().mean().item()
        per_head.append((loss_i.item(), acc, int(m.sum())))
    return total, per_head
