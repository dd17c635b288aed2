"""Import the Triton kernels under Triton's interpreter (TRITON_INTERPRET=1), for tests on CPU
tensors, without leaking the setting into other tests.

The variable is read when `triton.jit` decorates a kernel (triton itself was imported under it
by conftest.py) and again while an interpreted kernel runs, so it stays set for the duration
of the using module (a module-scoped fixture) and the kernel modules are imported afresh;
afterwards both are undone.
"""

import importlib
import os
import sys

import pytest

KERNEL_MODULES = ("paged_decode_attention", "paged_prefill_attention", "kv_cache_write",
                  "rms_norm", "rotary", "triton_backend")


def _forget_kernel_modules():
    package = importlib.import_module("tokstream.kernels")
    for name in KERNEL_MODULES:
        sys.modules.pop(f"tokstream.kernels.{name}", None)
        # `from tokstream.kernels import x` would otherwise still find the old module.
        package.__dict__.pop(name, None)


@pytest.fixture(scope="module")
def interpreted_kernels():
    """A namespace of freshly imported, interpreted kernel modules."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language.standard as library

    if not isinstance(library.sum, InterpretedFunction):
        pytest.skip("triton was imported for compiled kernels (a GPU is present): "
                    "tests/test_triton_kernels_gpu.py checks the kernels there")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _forget_kernel_modules()
    try:
        yield type("Kernels", (), {name: importlib.import_module(f"tokstream.kernels.{name}")
                                   for name in KERNEL_MODULES})
    finally:
        _forget_kernel_modules()
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
