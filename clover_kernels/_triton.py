"""Import Triton when it is installed; otherwise stand-ins that let the kernel modules import (and their torch
references run) on machines without it. Calling a Triton entry point without Triton raises a clear error.

The interpreter (`TRITON_INTERPRET=1`) is chosen by Triton when a kernel is *decorated*, i.e. when this package is
imported: set the variable before the first `import clover_kernels`.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Stub:
        """Enough of `triton` / `triton.language` for the modules to define (never run) their kernels."""

        constexpr = None

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _Stub()


def interpreting() -> bool:
    """True when Triton kernels run through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """Whether the Triton kernels can run here: Triton is installed and there is a CUDA device or the interpreter."""
    if not HAS_TRITON:
        return False
    if interpreting():
        return True
    import torch

    return torch.cuda.is_available()


def require_triton():
    if not HAS_TRITON:
        raise RuntimeError("the Triton kernels need the `triton` package (pip install 'clover-cli[kernels]')")
