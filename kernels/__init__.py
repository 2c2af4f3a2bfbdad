"""clover_kernels: Triton kernels for Clover-2 speculative decoding, each beside a torch reference.

Installed under the import name `clover_kernels` (the source folder is `kernels/`; there is deliberately no
top-level `kernels` package). Every `*_triton` function takes the same arguments as its `*_ref` and returns the
same result; the references run anywhere (CPU included), the kernels on a CUDA device or, with
TRITON_INTERPRET=1 set before this package is first imported, through Triton's interpreter on CPU tensors.

    tree attention   pack_tree_mask, unpack_tree_mask, tree_attention_ref / tree_attention_triton
    verify/accept    verify_greedy_ref / _triton, verify_sample_ref / _triton, tree_max_depth
    KV commit        kv_commit_ref / kv_commit_triton, PointerTable
    head step        rmsnorm_*, cosine_gate_*, gated_fusion_*, topk_ref / topk_triton
"""

from ._triton import HAS_TRITON, interpreting, triton_available
from .heads import (cosine_gate_ref, cosine_gate_triton, gated_fusion_ref, gated_fusion_triton, rmsnorm_ref,
                    rmsnorm_triton, topk_ref, topk_triton)
from .kv_commit import PointerTable, kv_commit_ref, kv_commit_triton
from .tree_attention import pack_tree_mask, tree_attention_ref, tree_attention_triton, unpack_tree_mask
from .verify import (tree_max_depth, verify_greedy_ref, verify_greedy_triton, verify_sample_ref,
                     verify_sample_triton)

__all__ = [
    "HAS_TRITON", "interpreting", "triton_available",
    "pack_tree_mask", "unpack_tree_mask", "tree_attention_ref", "tree_attention_triton",
    "tree_max_depth", "verify_greedy_ref", "verify_greedy_triton", "verify_sample_ref", "verify_sample_triton",
    "PointerTable", "kv_commit_ref", "kv_commit_triton",
    "rmsnorm_ref", "rmsnorm_triton", "cosine_gate_ref", "cosine_gate_triton", "gated_fusion_ref",
    "gated_fusion_triton", "topk_ref", "topk_triton",
]
