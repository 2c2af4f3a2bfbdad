"""`clover train`: distill Clover-2 (or Medusa, or EAGLE) draft heads for a target model.

    data      ShareGPT conversations, rendered with the target's chat template; loss on assistant tokens only;
              a fixed held-out split (by conversation id) is never trained on. --regenerate replaces the assistant
              turns with the target's own greedy replies (self-distillation).
    features  the target runs once per batch (or once, into a safetensors shard cache, with --cache-features):
              last hidden states before and after its final norm; its distributions come from lm_head(after).
    loss      head i at position t predicts token t+2+i:
                  soft cross-entropy against softmax(lm_head(h_{t+1+i}))  +  reg_weight * SmoothL1(o_i, h_{t+1+i})
              weighted 0.7^i, over positions whose predicted token is an assistant token. With --loss-vocab draft
              both distributions cover the --draft-vocab tokens only (the target's renormalised over them).
              EAGLE (one model, teacher-forced on the target's own features as EAGLE-1 trains): its output at t
              regresses h_{t+1} from [e(tok_{t+1}); h_t + noise] (uniform noise of width 0.2 on the input features,
              as the reference adds), with the same soft cross-entropy and EAGLE-1's weights: the regression
              counts 10x the cross-entropy (its v_w 1.0, p_w 0.1).
    optimiser AdamW (0.9, 0.95), linear warmup then cosine decay (or --lr-schedule constant), grad-norm clip 0.5,
              bf16 autocast on GPU.
    scale     data-parallel through accelerate: under `accelerate launch clover train ...` every process holds the
              target and the heads (wrapped in DistributedDataParallel, which averages the gradients), and process
              r of n trains on batches r, r+n, r+2n, ... of each epoch's shuffled batch list, so an epoch takes 1/n
              of the steps. Regeneration and the feature cache are sharded over the processes (each writes its
              own files; the main process merges); evaluation, checkpoints and the heads are written by the main
              process only.
    output    a heads directory (config.json, model.safetensors, README.md model card) loadable with --heads DIR,
              plus checkpoint/ for --resume. Ctrl-C leaves the last complete checkpoint intact.

The package, by concern:
    config    TrainConfig, its checks, the learning-rate schedule and the constants they share
    data      the conversations: loading, the held-out split, regeneration, encoding, the draft vocabulary, batches
    features  the target's hidden states: computed per batch, or cached in safetensors shards
    loss      heads_loss (Clover-2, Medusa, EAGLE, as their SPEC.training says; EAGLE-3's own loss lives with its
              drafter)
    output    --out: its checks, its marker, the checkpoints, cleaning up after a failed run
    loop      run_training: the training loop, evaluation, progress
    publish   the model card, the evaluation line, pushing to the Hub
"""

from .config import TrainConfig, lr_factor, validate
from .data import draft_vocabulary
from .loop import run_training
from .loss import heads_loss

__all__ = ["TrainConfig", "draft_vocabulary", "heads_loss", "lr_factor", "run_training", "validate"]
