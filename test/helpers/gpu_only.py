"""The guard every GPU test file starts with: CUDA present and Triton compiling for it."""

import pytest
import torch


def skip_unless_compiled_triton_on_cuda() -> None:
    """Skip the calling test module (at import) without CUDA, or when Triton interprets: the GPU
    files test compiled kernels, and conftest.py turns the interpreter on unless told otherwise."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    triton = pytest.importorskip("triton")
    if triton.knobs.runtime.interpret:
        pytest.skip("GPU kernel tests need TRITON_INTERPRET=0", allow_module_level=True)
