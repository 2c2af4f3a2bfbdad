"""The target's features for training: last hidden states before and after its final norm, per batch or cached in
safetensors shards (--cache-features), under the autocast training uses."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import atomic

class FeatureCache:
    """--cache-features: the target's hidden states per conversation, in safetensors shards under --out/features."""

    def __init__(self, root: Path, model, ids, device, dtype):
        self.root, self.model, self.ids, self.device, self.dtype = root, model, ids, device, dtype
        self.root.mkdir(parents=True, exist_ok=True)
        self.shard_size = 256
        self.open: dict = {}  # shard -> safetensors handle: tensors read from the memory-mapped file on demand

    def _shard_path(self, s: int) -> Path:
        return self.root / f"shard_{s:05d}.safetensors"

    def _compute(self, s: int):
        from safetensors.torch import save_file

        path = self._shard_path(s)
        if path.is_file():
            return
        tensors = {}
        for i in range(s * self.shard_size, min(len(self.ids), (s + 1) * self.shard_size)):
            x = torch.tensor([self.ids[i]], device=self.device)
            with torch.no_grad(), _autocast(self.device):
                pre, post = _hidden(self.model, x)
            tensors[f"{i}.pre"] = pre[0].to(self.dtype).cpu()
            tensors[f"{i}.post"] = post[0].to(self.dtype).cpu()
        atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp)))

    def precompute(self, rank: int, world: int, barrier, report=None):
        """Every missing shard, before the first step (so that the steps' rate and ETA time training alone); several
        processes: each computes every world-th shard, then all wait for the others. report(done, total) after each
        shard this process computed."""
        shards = range(rank, math.ceil(len(self.ids) / self.shard_size), world)
        missing = [s for s in shards if not self._shard_path(s).is_file()]
        for k, s in enumerate(missing, 1):
            self._compute(s)
            if report is not None:
                report(k, len(missing))
        barrier()

    def _shard(self, s: int):
        """A batch mixes shards: each stays open (mapped, not loaded), so moving between them reads only its rows."""
        from safetensors import safe_open

        if s not in self.open:
            self._compute(s)
            self.open[s] = safe_open(str(self._shard_path(s)), framework="pt")
        return self.open[s]

    def get(self, rows):
        T = max(len(self.ids[i]) for i in rows)
        pres, posts = [], []
        for i in rows:
            shard = self._shard(i // self.shard_size)
            pre, post = shard.get_tensor(f"{i}.pre"), shard.get_tensor(f"{i}.post")
            pres.append(F.pad(pre, (0, 0, 0, T - pre.shape[0])))
            posts.append(F.pad(post, (0, 0, 0, T - post.shape[0])))
        return (torch.stack(pres).to(self.device, torch.float32), torch.stack(posts).to(self.device, torch.float32))


def _autocast(device):
    """bf16 autocast on GPUs, and on CPUs with native bf16 instructions (AVX512-BF16/AMX); fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(native))


def _hidden(model, x):
    from ..target import hidden_states

    return hidden_states(model, x)
