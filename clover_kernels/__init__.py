"""clover_kernels: the kernels clover's target runs, each beside a torch reference.

On CUDA devices, Triton kernels (clover_cli/target.py): tree attention and the KV commit. On the CPU, the quantized
linears (clover_kernels.quant, C++ built on first use; clover_cli/quantized.py): imported on their own, not here.

Installed under the import name `clover_kernels` (the source folder is `kernels/`; there is deliberately no
top-level `kernels` package). Every `*_triton` function takes the same arguments as its `*_ref` and returns the
same result; the references run anywhere (CPU included), the kernels on a CUDA device or, with
TRITON_INTERPRET=1 set before this package is first imported, through Triton's interpreter on CPU tensors.

    tree attention   pack_tree_mask, unpack_tree_mask, tree_attention_ref / tree_attention_triton
    KV commit        kv_commit_ref / kv_commit_triton, PointerTable
"""

from ._triton import HAS_TRITON, interpreting, triton_available
from .kv_commit import PointerTable, kv_commit_ref, kv_commit_triton
from .tree_attention import pack_tree_mask, tree_attention_ref, tree_attention_triton, unpack_tree_mask

__all__ = [
    "HAS_TRITON", "interpreting", "triton_available",
    "pack_tree_mask", "unpack_tree_mask", "tree_attention_ref", "tree_attention_triton",
    "PointerTable", "kv_commit_ref", "kv_commit_triton",
]
