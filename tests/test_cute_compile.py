"""The CuTe DSL GEMM (cute.gemm, and the LM heads' logits GEMM with an addend) compiles for
sm_90a without a GPU: CUTLASS DSL compiles for the target CUTE_DSL_ARCH names. What the CPU
can check of a CuTe kernel is that every variant the dispatcher may launch compiles; its bits
are checked on the GPU (tests/test_cute_backend.py, tests/test_cute_head.py). Skipped without
``pip install "opcontract[cute]"`` (CUTLASS DSL and TVM FFI)."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("tvm_ffi") is None,
    reason='CUTLASS DSL or TVM FFI not installed: pip install "opcontract[cute]"',
)

# (dtype, tile_m, tile_n, group_m, has_bias, overlap, a MN-major, b MN-major, out, addend)
KEYS = [
    (torch.bfloat16, 128, 128, 8, False, 1, False, False, None, "none"),  # the default
    (torch.bfloat16, 64, 128, 1, True, 0, False, False, None, "none"),
    (torch.float16, 128, 64, 4, False, 0, True, False, None, "none"),  # a transposed a
    (torch.bfloat16, 128, 128, 8, False, 1, False, True, torch.float32, "add"),  # heads
    (torch.bfloat16, 128, 128, 8, False, 0, True, False, torch.float32, "seed"),
]


@pytest.fixture(autouse=True)
def _target_without_a_gpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@pytest.mark.parametrize("key", KEYS, ids=lambda k: "-".join(map(str, k[1:])))
def test_cute_gemm_compiles_for_sm90(key):
    from opcontract.backends.cute import dense_gemm

    fn = dense_gemm.compile_kernel(key)
    assert callable(fn)
