"""The guards GPU test files start with: CUDA present and Triton compiling for it; CUDA and the
GPU bundle for the files that run SGLang's own code there."""

import importlib.util

import pytest
import torch

# pytestmark of the files that import SGLang's GPU path (sgl_kernel comes with the bundle)
NEEDS_CUDA_AND_THE_BUNDLE = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sgl_kernel") is None,
    reason="needs CUDA and the GPU bundle (docs/gpu_bundle.md)",
)


def skip_unless_compiled_triton_on_cuda() -> None:
    """Skip the calling test module (at import) without CUDA, or when Triton interprets: the GPU
    files test compiled kernels, and conftest.py turns the interpreter on unless told otherwise."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    triton = pytest.importorskip("triton")
    if triton.knobs.runtime.interpret:
        pytest.skip("GPU kernel tests need TRITON_INTERPRET=0", allow_module_level=True)
