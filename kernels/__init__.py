"""clover_kernels: Triton kernels for Clover-2 speculative decoding, each beside a torch reference.

Only what the target runs (clover_cli/target.py, on CUDA devices): tree attention and the KV commit.

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
