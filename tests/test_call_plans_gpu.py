"""The Triton call plans on the GPU: the bits of the full path, and the full path wherever a
plan can't serve a call (misaligned or strided inputs, another stream, a graph capture)."""

import pytest
import torch

from opcontract import dispatch
from opcontract.dispatch import call_cache

pytestmark = pytest.mark.gpu

H, INTER, Q = 6656, 19968, 4096


@pytest.fixture(autouse=True)
def _fresh_memo():
    call_cache.clear()
    yield
    call_cache.clear()


def _randn(*shape, g, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()


def _plans() -> list:
    return [
        e.plan
        for e in call_cache._MEMO.values()
        if getattr(e, "plan", None) not in (None, call_cache.UNTRIED)
    ]


def _full(f, *args, **kwargs):
    """The call through the full path (the memo, and so the plan, cleared first)."""
    call_cache.clear()
    return f(*args, **kwargs)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _cases(g):
    x1, x3 = _randn(1, H, g=g), _randn(2, 3, H, g=g)
    r1, w = _randn(1, H, g=g), _randn(H, g=g, scale=0.1)
    gu, gate, up = _randn(1, 1, 2 * INTER, g=g), _randn(4, INTER, g=g), _randn(4, INTER, g=g)
    wq, wo = _randn(Q, H, g=g, scale=1 / 80), _randn(H, Q, g=g, scale=1 / 64)
    xq, xi = _randn(1, 1, Q, g=g), _randn(1, INTER, g=g)
    wd = _randn(H, INTER, g=g, scale=1 / 140)  # 266 MB: its partials are summed apart
    rms, add = dispatch.op("rms_norm"), dispatch.op("fused_add_rms_norm")
    swiglu, gemm = dispatch.op("swiglu"), dispatch.op("dense_gemm")
    two = {"parallel_partials": True, "block_m": 16, "block_n": 64, "num_warps": 4}
    gemm_two = dispatch.op("dense_gemm", config=two)
    return {
        "rms_norm T=1": (rms, (x1, w), {"variant": "plain", "eps": 1e-5}),
        "rms_norm [2, 3, H]": (rms, (x3, w), {"variant": "centred", "eps": 1e-6}),
        "add_norm T=1": (add, (x1, r1, w), {"variant": "plain", "eps": 1e-5}),
        "swiglu packed [1, 1, 2I]": (swiglu, (gu,), {"layout": "packed"}),
        "swiglu separate": (swiglu, (gate, up), {}),
        "dense_gemm q_proj M=1": (gemm, (x1, wq), {}),
        "dense_gemm o_proj [1, 1, Q]": (gemm, (xq, wo), {}),
        "dense_gemm fused partials": (gemm_two, (x1, wq), {}),
        "dense_gemm partials summed by a 2nd launch": (gemm_two, (xi, wd), {}),
    }


CASES = [
    "rms_norm T=1",
    "rms_norm [2, 3, H]",
    "add_norm T=1",
    "swiglu packed [1, 1, 2I]",
    "swiglu separate",
    "dense_gemm q_proj M=1",
    "dense_gemm o_proj [1, 1, Q]",
    "dense_gemm fused partials",
    "dense_gemm partials summed by a 2nd launch",
]


@pytest.mark.parametrize("case", CASES)
def test_plan_gives_the_full_paths_bits(case):
    g = torch.Generator(device="cuda").manual_seed(0)
    f, args, kwargs = _cases(g)[case]
    with torch.no_grad():
        full = _full(f, *args, **kwargs)
        prov = dispatch.last_provenance()
        f(*args, **kwargs)  # the second call of a signature runs the plan
        assert len(_plans()) == 1, "no plan was made"
        fresh = [torch.randn_like(a, dtype=torch.float32).to(a.dtype) for a in args]
        planned = f(*fresh, **kwargs)
        assert dispatch.last_provenance() == prov
        again = _full(f, *fresh, **kwargs)
    assert _equal(planned, again)
    assert not _equal(planned, full)  # fresh inputs, fresh outputs: the plan read them
    shapes = [t.shape for t in (planned if isinstance(planned, tuple) else (planned,))]
    assert shapes == [t.shape for t in (again if isinstance(again, tuple) else (again,))]


def test_kept_partials_serve_calls_queued_back_to_back():
    """A fused M = 1 plan keeps its partials on its stream: calls queued without a sync, each
    on other inputs, still give the full path's bits."""
    g = torch.Generator(device="cuda").manual_seed(3)
    cfg = {"parallel_partials": True, "block_m": 16, "block_n": 64, "num_warps": 4}
    gemm = dispatch.op("dense_gemm", config=cfg)
    wq = _randn(Q, H, g=g, scale=1 / 80)
    xs = [_randn(1, H, g=g) for _ in range(8)]
    with torch.no_grad():
        gemm(xs[0], wq)
        queued = [gemm(x, wq) for x in xs]  # the plan, back to back
        assert len(_plans()) == 1
        want = [_full(gemm, x, wq) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(queued, want, strict=True))


def test_plans_decline_misaligned_strided_and_other_streams():
    g = torch.Generator(device="cuda").manual_seed(1)
    rms, gemm = dispatch.op("rms_norm"), dispatch.op("dense_gemm")
    buf, w = _randn(2 * H + 8, g=g), _randn(H, g=g, scale=0.1)
    wq = _randn(Q, H, g=g, scale=1 / 80)
    x = buf[:H].view(1, H)
    with torch.no_grad():
        rms(x, w)
        rms(x, w)  # plan made
        odd = buf[1 : H + 1].view(1, H)  # 2-byte aligned: Triton compiles another binary
        got = rms(odd, w)
        assert torch.equal(got, _full(rms, odd.clone(), w))
        rows = buf[: 2 * H].view(2, H)[:, : H - 8]  # strided rows
        w8 = w[: H - 8]
        rms(rows.contiguous(), w8)
        rms(rows.contiguous(), w8)  # plan made for [2, H - 8]
        got = rms(rows, w8)
        assert torch.equal(got, _full(rms, rows.contiguous(), w8))
        x1 = _randn(1, H, g=g)
        gemm(x1, wq)
        gemm(x1, wq)
        want = gemm(x1, wq)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = gemm(x1, wq)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got, want)


def test_graph_capture_replays_the_bits():
    g = torch.Generator(device="cuda").manual_seed(2)
    gemm, rms = dispatch.op("dense_gemm"), dispatch.op("rms_norm")
    x, wq, w = _randn(1, H, g=g), _randn(Q, H, g=g, scale=1 / 80), _randn(Q, g=g, scale=0.1)
    with torch.no_grad():
        for _ in range(3):
            want = rms(gemm(x, wq), w)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                rms(gemm(x, wq), w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rms(gemm(x, wq), w)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
