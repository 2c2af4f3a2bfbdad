"""KV commit: move the accepted path's keys and values into place, all layers in one launch.

After a verify forward the cache holds the n tree tokens at [start, start + n) of every layer. Committing the
accepted path (node offsets path[0] = 0 < path[1] < ... , `count` of them) means, for every layer's K and V:

    cache[..., start + j, :] = cache[..., start + path[j], :]     for j in [0, count)

Cache representation: a list of per-layer tensors, as `clover_cli.target.TreeKVCache` keeps them (each
[1, Hkv, capacity, D], or any [..., T, D] whose leading dims flatten to one stride). The kernel receives a
*pointer table*: an int64 tensor with the address of every K buffer then every V buffer, so the layers need no
common allocation and TreeKVCache needs no change; all buffers must share shape, strides, dtype and device (a
stacked [layers, ...] tensor works too: its slices are such buffers). `PointerTable` builds the table once and
rebuilds it only when a buffer has been reallocated (the cache grew).

In place without a scratch copy: the path is increasing, so path[j] >= j. Each program owns one (buffer, head)
slice and moves rows in increasing j; when it writes row start + j, the rows still to be read (start + path[j']
for j' > j) lie above it, so nothing unread is overwritten. The one read-then-write reuse, a row read as slot j's
source (path[j] == j + 1) and overwritten as slot j + 1, is ordered by a barrier between each slot's load and
store, whichever threads of the program hold the row's elements.

`count` may be a Python int or a device tensor (e.g. verify's accept_len + 1): the kernel reads it on the device,
looping over `path.numel()` slots and skipping those at or past `count`, and entries with path[j] == j.
"""

from __future__ import annotations

import torch

from ._triton import interpreting, require_triton, tl, triton

__all__ = ["kv_commit_ref", "kv_commit_triton", "PointerTable"]


def _as_list(caches) -> list[torch.Tensor]:
    return list(caches.unbind(0)) if isinstance(caches, torch.Tensor) else list(caches)


def kv_commit_ref(k_caches, v_caches, start: int, path_indices: torch.Tensor, count):
    """Torch reference: one index_select per buffer (what TreeKVCache.commit does), in place."""
    count = int(count)
    if count == 0:
        return
    index = start + path_indices[:count].to(torch.int64)
    for buf in _as_list(k_caches) + _as_list(v_caches):
        buf[..., start:start + count, :] = buf.index_select(buf.dim() - 2, index.to(buf.device))


@triton.jit
def _kv_commit(Table, Path, CountPtr, count_value, start, s_head, s_pos, s_dim, D, slots,
               COUNT_ON_DEVICE: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr):
    buf = tl.program_id(0)
    head = tl.program_id(1)
    base = tl.load(Table + buf).to(tl.pointer_type(DTYPE)) + head.to(tl.int64) * s_head
    if COUNT_ON_DEVICE:
        count = tl.load(CountPtr).to(tl.int32)
    else:
        count = count_value
    d = tl.arange(0, BLOCK_D)
    for j in range(0, slots):
        src = tl.load(Path + j)
        # Lanes to move: all D of them when slot j is in the path and not already in place, else none.
        lanes = d < tl.where((j < count) & (src != j), D, 0)
        row = tl.load(base + (start + src) * s_pos + d * s_dim, mask=lanes)
        tl.debug_barrier()  # every thread's read of this slot's source precedes any later slot's write
        tl.store(base + (start + j) * s_pos + d * s_dim, row, mask=lanes)


_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
           torch.float64: "float64", torch.int8: "int8", torch.uint8: "uint8"}


class PointerTable:
    """The int64 address table of a list of buffers, rebuilt only when one of the buffers changes."""

    def __init__(self):
        self._key = None
        self.table = None

    def get(self, buffers: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(b.data_ptr() for b in buffers)
        if key != self._key:
            self.table = torch.tensor(key, dtype=torch.int64, device=buffers[0].device)
            self._key = key
        return self.table


def _geometry(buffers: list[torch.Tensor]):
    first = buffers[0]
    for b in buffers[1:]:
        if b.shape != first.shape or b.stride() != first.stride() or b.dtype != first.dtype \
                or b.device != first.device:
            raise ValueError("all K/V buffers must share shape, strides, dtype and device")
    if first.dim() < 2:
        raise ValueError("K/V buffers must be [..., T, D]")
    lead = first.shape[:-2]
    heads = 1
    for s in lead:
        heads *= s
    try:
        s_head = first.view(heads, *first.shape[-2:]).stride(0) if heads > 1 else 0
    except RuntimeError:
        raise ValueError("the leading dims of the K/V buffers must flatten to one stride")
    if first.dtype not in _DTYPES:
        raise ValueError(f"unsupported cache dtype {first.dtype}")
    return heads, s_head, first.stride(-2), first.stride(-1), first.shape[-1], first.dtype


def kv_commit_triton(k_caches, v_caches, start: int, path_indices: torch.Tensor, count,
                     table: PointerTable | None = None):
    """One launch over every (buffer, head): same arguments and effect as `kv_commit_ref`.

    table: a PointerTable kept by the caller across calls (avoids rebuilding the address table each time).
    """
    require_triton()
    buffers = _as_list(k_caches) + _as_list(v_caches)
    if not buffers or path_indices.numel() == 0:
        return
    heads, s_head, s_pos, s_dim, D, dtype = _geometry(buffers)
    if interpreting() and buffers[0].device.type != "cpu":
        # The interpreter runs on host copies of the arguments; the table's device addresses are not among them.
        raise ValueError("the Triton interpreter cannot follow a pointer table into device memory")
    ptrs = (table or PointerTable()).get(buffers)
    path = path_indices.to(device=buffers[0].device, dtype=torch.int64).contiguous()
    on_device = isinstance(count, torch.Tensor)
    count_ptr = count.to(device=path.device).reshape(()) if on_device else path
    _kv_commit[(len(buffers), heads)](
        ptrs, path, count_ptr, 0 if on_device else int(count), int(start), s_head, s_pos, s_dim, D,
        path.numel(), COUNT_ON_DEVICE=on_device, BLOCK_D=triton.next_power_of_2(D),
        DTYPE=getattr(tl, _DTYPES[dtype]),
    )
