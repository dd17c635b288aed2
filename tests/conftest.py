"""Session-wide test set-up: Triton's interpreter for the kernel tests on machines without a GPU.

The interpreter (TRITON_INTERPRET=1) must be on when triton is first imported: triton's own
library functions (tl.sum, tl.max, ...) are decorated then, and transformers imports triton as
soon as a test imports it. So, without a GPU, triton is imported here under the interpreter and
the variable is unset again at once, so that no other test or child process sees it;
tests/triton_interpreter.py turns it back on while the kernel tests run.
"""

import importlib.util
import os


def _import_triton_for_the_interpreter() -> None:
    if importlib.util.find_spec("triton") is None:
        return
    import torch

    if torch.cuda.is_available():
        return  # compiled kernels: tests/test_triton_kernels_gpu.py
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_the_interpreter()
