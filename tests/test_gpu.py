"""GPU truth at moderate shapes (marked gpu: skipped without CUDA)."""

import pytest
import torch
from helpers import run_impl

from opcontract import dispatch
from opcontract.backends.registry import implementations
from opcontract.backends.torch.softcap_logprob import reference
from opcontract.conformance import run_kit
from opcontract.contracts import load_all

pytestmark = pytest.mark.gpu


def _triton_impls():
    return [(i.op, i.name) for i in implementations() if i.backend == "triton"]


@pytest.mark.parametrize("op,name", _triton_impls())
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_triton_conformance_on_gpu(op, name, dtype):
    """Every Triton implementation through the whole kit on the GPU."""
    c = load_all()[op]
    impl = next(i for i in implementations(op) if i.name == name)
    failed = [r for r in run_kit(impl, c, dtype, device="cuda") if not r.ok]
    assert not failed, failed


def test_rows_bitwise_equal_across_batch_sizes_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = 1024, 1024, 50_000
    h = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.3).bfloat16()
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    slp = dispatch.op("softcap_logprob")
    full = slp(h, w, t, multiplier=0.196, softcap=20.0)
    assert dispatch.last_provenance().implementation == "triton.fused"
    for n in (1, 2, 3, 17, 64, 129, 500):
        idx = torch.randperm(T, device="cuda", generator=g)[:n]
        assert torch.equal(slp(h[idx], w, t[idx], multiplier=0.196, softcap=20.0), full[idx]), n
    ref = reference(h[:64], w, t[:64], multiplier=0.196, softcap=20.0)
    assert ((full[:64].double() - ref).norm() / ref.norm()).item() < 2e-6


@pytest.mark.parametrize("N,K", [(8704, 6656), (6656, 4096), (39936, 6656), (6656, 19968)])
def test_parallel_partials_bitwise_on_muse_shapes(N, K):
    """triton.gemm's parallel K partials against its K loop, decode batch sizes, bf16."""
    from opcontract.backends.registry import implementation

    impl = implementation("triton.gemm")
    base = impl.default_config(None)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
    b = torch.randn(N, device="cuda", generator=g).bfloat16()
    for M in (1, 3, 16):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        for cfg in ({"block_m": 16, "block_n": 64, "num_warps": 4}, {}):
            seq = run_impl(impl, {**base, **cfg}, x=x, weight=w, bias=b)
            par = run_impl(impl, {**base, **cfg, "parallel_partials": True}, x=x, weight=w, bias=b)
            assert torch.equal(seq, par), (M, cfg)


@pytest.mark.parametrize("N,K", [(4096, 6656), (256, 6656), (19968, 6656), (6656, 4096)])
def test_decode_defaults_give_the_training_rows(N, K):
    """Untuned shapes (Muse Glimmer's separate q, k/v, MLP gate/up and o projections): a
    decode call of M <= 64 takes the small-M tiles (parallel partials where few tiles), a
    training call the large ones; each row's bits are the same."""
    from opcontract.backends.triton import dense_gemm as tdg

    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
    x = torch.randn(4096, K, device="cuda", generator=g).bfloat16()
    f = dispatch.op("dense_gemm", backend="triton")
    full = f(x, w)
    for M in (1, 5, 16, 17, 64):
        cfg = tdg.default_config(M, N)
        assert cfg["block_m"] == (16 if M <= 16 else 64)
        assert torch.equal(f(x[-M:], w), full[-M:]), M


def test_parallel_partials_counters_and_graph_replay():
    """Eager parallel partials (summed by each tile's last program) leave every arrival
    counter at zero and keep their bits across many launches back to back and on a second
    stream; captured in a CUDA graph (summed by a second launch) they replay to the same
    bits."""
    from opcontract.backends.registry import implementation
    from opcontract.backends.triton import dense_gemm as tdg

    impl = implementation("triton.gemm")
    cfg = {**impl.default_config(None), "block_m": 16, "block_n": 64, "num_warps": 4}
    cfg["parallel_partials"] = True
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(6656, 4096, device="cuda", generator=g) / 64).bfloat16()
    x = torch.randn(3, 4096, device="cuda", generator=g).bfloat16()
    want = run_impl(impl, {**cfg, "parallel_partials": False}, x=x, weight=w, bias=None)
    outs = [run_impl(impl, cfg, x=x, weight=w, bias=None) for _ in range(50)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        outs.append(run_impl(impl, cfg, x=x, weight=w, bias=None))
    torch.cuda.synchronize()
    assert all(torch.equal(o, want) for o in outs)
    # counters kept for the default stream only (a side stream's launch brings its own)
    assert len(tdg._ARRIVALS) >= 1 and not any(b.any() for b in tdg._ARRIVALS.values())
    static_x = x.clone()
    run_impl(impl, cfg, x=static_x, weight=w, bias=None)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run_impl(impl, cfg, x=static_x, weight=w, bias=None)
    for _ in range(3):
        static_y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, want)


def test_sweep_graph_timing_times_gpu_work():
    """Graph timing replays the captured call: a GEMV measures in microseconds, and a
    call that does four times the work measures longer."""
    from opcontract.tuning.sweep import time_ms

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w4 = torch.randn(4 * 8192, 4096, device="cuda", dtype=torch.bfloat16)
    one = time_ms(lambda: x @ w.T, "cuda", "graph")
    four = time_ms(lambda: x @ w4.T, "cuda", "graph")
    assert 0 < one < four


@pytest.mark.parametrize("variant", ["plain", "centred"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_rows_equal_across_the_weight_load_switch(variant, residual):
    """Calls of T <= 64 load the weight with the row, larger ones after the reduction: a
    row's bits must not depend on which (rows of T = 64 inside T = 8192, Muse Glimmer H)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8192, 6656, device="cuda", generator=g).bfloat16()
    r = torch.randn(8192, 6656, device="cuda", generator=g).bfloat16()
    w = (torch.randn(6656, device="cuda", generator=g) * 0.1).bfloat16()
    if residual:
        f = dispatch.op("fused_add_rms_norm", backend="triton")
        big, small = f(x, r, w, variant=variant), f(x[:64], r[:64], w, variant=variant)
        assert torch.equal(big.residual_out[:64], small.residual_out)
        big, small = big[0], small[0]
    else:
        f = dispatch.op("rms_norm", backend="triton")
        big, small = f(x, w, variant=variant), f(x[:64], w, variant=variant)
    assert torch.equal(big[:64], small)


@pytest.mark.parametrize("V, T", [(5000, 512), (202048, 32768)])
def test_embedding_backward_is_captured_in_a_cuda_graph(V, T):
    """No host sync in the Triton embedding backward: its step captures and replays, and
    the replay gives the eager bits (also at Muse Glimmer's vocabulary and a training T,
    where the sort takes its multi-pass path)."""
    from opcontract.backends.triton import normalized_embedding as tn

    g = torch.Generator(device="cuda").manual_seed(4)
    table = torch.randn(V, 6656, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, V, (T,), device="cuda", generator=g)
    dy = torch.randn(T, 6656, device="cuda", generator=g).bfloat16()
    _, _, rstd = tn.embedding_forward(ids, table, 1e-5, False)
    eager = tn.embedding_backward(dy, None, ids, table, rstd)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tn.embedding_backward(dy, None, ids, table, rstd)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tn.embedding_backward(dy, None, ids, table, rstd)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
