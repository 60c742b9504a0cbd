"""The CuTe heads (cute.fused, cute.fused_ce): the LM head's backward GEMMs on the CuTe mainloop
through its float32 addend epilogues. On the CPU, their declaration and the host plumbing (an
emulated kernel launch); on an SM90 GPU with nvidia-cutlass-dsl (marked gpu), the epilogues'
bits against the Triton GEMM and every output and gradient against triton.fused, bitwise."""

import contextlib
import importlib.util

import pytest
import torch
from helpers import head_inputs

from opcontract import dispatch
from opcontract.backends import linear_cross_entropy as lce
from opcontract.backends import registry
from opcontract.backends.cute import dense_gemm as dg
from opcontract.backends.triton import softcap_logprob as slp
from opcontract.contracts import get_contract
from opcontract.dispatch.device import simulate

HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
HEADS = {"softcap_logprob": "cute.fused", "linear_cross_entropy": "cute.fused_ce"}
TRITON = {"softcap_logprob": "triton.fused", "linear_cross_entropy": "triton.fused_ce"}


@pytest.mark.parametrize("op,name", sorted(HEADS.items()))
def test_cute_heads_declare_the_triton_heads_plans(op, name):
    impl = registry.implementation(name)
    triton = registry.implementation(TRITON[op])
    assert impl.op == op and impl.backend == "cute" and impl.devices == ("cuda",)
    assert impl.capability == ((9, 0), (9, 0)) and impl.dtypes == ("bfloat16", "float16")
    assert impl.plan == triton.plan and impl.config_space == triton.config_space
    assert registry.declaration_problems(impl, get_contract(op)) == []
    # served by default (its GPU test shows triton.fused's bits)
    assert impl.priority["cuda"] > triton.priority["cuda"]


@pytest.mark.parametrize("op,name", sorted(HEADS.items()))
def test_cute_heads_declare_the_logits_acc_of_their_backward(op, name):
    """g reads its logits from a float32 acc from ACC_MIN_T rows: the CuTe heads' plan_memory
    counts that chunk (Muse Glimmer's head at T = 8192, 8191 and a short call)."""
    H, V = 6656, 202048
    for T in (8192, 8191, 512):
        sizes = {"T": T, "H": H, "V": V}
        call = registry.CallInfo(registry.DeviceInfo("cuda"), "bfloat16", sizes, {})
        cute = registry.implementation(name).plan_memory(call, {})
        base = slp.plan_memory(T, H, V, "bfloat16", {}, k_align=slp.GRAD_K_ALIGN["cute"])
        chunk = min(slp.acc_columns(T, V), slp.GRAD_CHUNK)
        tok = min(T, 1024)  # the default token chunk
        want = {
            "vocab_chunks": base["vocab_chunks"] + (T >= slp.ACC_MIN_T) * T * chunk * 4,
            "token_chunks": base["token_chunks"]
            + (tok >= slp.ACC_MIN_T) * tok * slp.acc_columns(tok, V) * 4,
        }
        assert cute == want, T
    assert registry.implementation(name).backward.keywords["logits_gemm"] == "cute"


def test_cute_head_rejected_with_a_reason_off_sm90():
    h, w, t = head_inputs(T=6, H=16, V=40, dtype=torch.bfloat16)
    r = dispatch.explain("softcap_logprob", h, w, t)
    assert "cute.fused" in r.rejected and r.implementation != "cute.fused"
    with simulate((9, 0), name="H200"):
        r = dispatch.explain("softcap_logprob", h, w, t)
    if HAVE_CUTLASS:
        assert "cute.fused" in r.accepted and r.implementation == "cute.fused"
    else:
        assert "CUTLASS DSL is not installed" in r.rejected["cute.fused"]
        assert 'pip install "opcontract[cute]"' in r.rejected["cute.fused"]
    with simulate((8, 0), name="A100"):
        r = dispatch.explain("softcap_logprob", h, w, t)
    assert r.implementation != "cute.fused"


def _emulated_launch(calls):
    """A stand-in for the kernel: c = a @ b.T in float64 (+ addend), cast once; records
    (output dtype, addend mode, c is the addend)."""

    def launch(key, a, b, c, bias, addend, num_ctas):
        out_dtype, mode = key[8], key[9]
        s = a.double() @ b.double().T
        if mode != "none":
            s = s + addend.double()
        c[:, : s.shape[1]] = s.to(c.dtype)
        calls.append((out_dtype, mode, c.data_ptr() == addend.data_ptr()))

    return launch


@pytest.fixture
def emulated(monkeypatch):
    calls = []
    monkeypatch.setattr(dg, "_launch", _emulated_launch(calls))
    monkeypatch.setattr(dg, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return calls


def test_gemm_addend_arguments_are_checked(emulated):
    a, b = torch.randn(16, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    acc = torch.randn(16, 8)
    with pytest.raises(ValueError, match="addend and bias are exclusive"):
        dg.gemm(a, b, torch.zeros(8).bfloat16(), addend=acc)
    with pytest.raises(ValueError, match=r"addend must be float32 \[16, 8\]"):
        dg.gemm(a, b, addend=acc.double())
    with pytest.raises(ValueError, match="seed needs an addend"):
        dg.gemm(a, b, seed=True)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        dg.gemm(a, b, out=torch.empty(16, 8, dtype=torch.float16))
    out = dg.gemm(a, b, out=acc, addend=acc)  # in place: c is the addend
    assert out is acc and emulated == [(torch.float32, "add", True)]
    plain = torch.empty(16, 8)  # the float32 sum, unrounded, no addend
    assert dg.gemm(a, b, out=plain) is plain and emulated[-1] == (torch.float32, "none", False)


@pytest.mark.parametrize("plan,modes", [("vocab_chunks", {"none", "add"}),
                                        ("token_chunks", {"add", "seed"})])  # fmt: skip
def test_head_backward_on_the_cute_gemms(emulated, plan, modes):
    """The plans' GEMMs reach the kernel as the addend epilogues they need (grad_hidden's
    float32 sum in place, grad_weight's seeded chain ending in the input dtype) and give the
    head's gradients (here with float64 products: close, not the kernel's bits)."""
    T, H, V = 300, 8, 4200  # two vocabulary chunks; two token chunks of 256
    h, w, t = head_inputs(T=T, H=H, V=V, dtype=torch.bfloat16)
    kw = dict(multiplier=0.3, softcap=20.0, ignore_index=-100)
    r = slp.forward_all(h, w, t, entropy=False, argmax=False, zsum=False, **kw)
    gl = torch.randn(T, generator=torch.Generator().manual_seed(3))
    args = (h, w, t, r.lse, None, gl, None, None)
    ref = slp.backward(*args, **kw, plan=plan, token_chunk=256)
    got = slp.backward(*args, **kw, plan=plan, token_chunk=256, grad_gemm="cute")
    assert {m for _, m, _ in emulated} == modes
    if plan == "vocab_chunks":  # grad_hidden summed in place in its float32 buffer
        assert (torch.float32, "add", True) in emulated
        assert (torch.bfloat16, "none", False) in emulated
    else:  # the buffer's running sum continues, and the last chunk writes the input dtype
        assert (torch.float32, "seed", True) in emulated
        assert emulated[-1] == (torch.bfloat16, "seed", False)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert 0 < b.double().norm() and rel < 1e-2, rel


def test_unaligned_token_count_reaches_the_gemm_in_place(emulated, monkeypatch):
    """T = 300 (not a multiple of 8, as one sequence's S - 1 next-token rows): grad_weight's
    K is padded once with zero rows, so no vocabulary chunk copies g.T or hidden.T, and the
    gradients are those of the Triton GEMM's plan (float64 stand-in: close)."""
    copies = []
    ready = dg._tma_ready

    def counting(t, cols):
        out = ready(t, cols)
        copies.append(out is not t)
        return out

    monkeypatch.setattr(dg, "_tma_ready", counting)
    T, H, V = 300, 8, 4200
    h, w, t = head_inputs(T=T, H=H, V=V, dtype=torch.bfloat16)
    kw = dict(multiplier=0.3, softcap=20.0, ignore_index=-100)
    r = slp.forward_all(h, w, t, entropy=False, argmax=False, zsum=False, **kw)
    gl = torch.randn(T, generator=torch.Generator().manual_seed(3))
    args = (h, w, t, r.lse, None, gl, None, None)
    got = slp.backward(*args, **kw, grad_gemm="cute")
    assert copies and not any(copies), copies
    ref = slp.backward(*args, **kw)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert rel < 1e-2, rel
    need = slp.plan_memory(T, H, V, "bfloat16", {}, k_align=slp.GRAD_K_ALIGN["cute"])
    assert need["vocab_chunks"] == 304 * 4096 * 2 + T * H * 4 + 304 * H * 2


@pytest.fixture
def apart(monkeypatch):
    """The logits' GEMM apart from every call's first row, in chunks of 256 columns."""
    monkeypatch.setattr(slp, "ACC_MIN_T", 1)
    monkeypatch.setattr(slp, "ACC_BYTES", 4 * 300 * 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_gemm_apart_gives_the_fused_kernels_bits(apart, dtype):
    """The acc stored by a GEMM run apart (Triton's here, the partials kernels' own gemm_k)
    and read back by the epilogue kernels: every forward output and both plans' gradients
    equal the fused kernels', bitwise (across column chunks and a ragged last one)."""
    T, H, V = 300, 96, 1000
    h, w, t = head_inputs(T=T, H=H, V=V, dtype=dtype)
    kw = dict(multiplier=0.3, softcap=20.0, entropy=True, argmax=True, zsum=True, sq=True)
    fused = slp.forward_all(h, w, t, **kw, logits=True)
    got = slp.forward_all(h, w, t, **kw, logits=True, logits_gemm="triton")
    for name, x, y in zip(fused._fields, fused, got, strict=True):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    gen = torch.Generator().manual_seed(3)
    gl, ge = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    args = (h, w, t, fused.lse, fused.mean_z, gl, ge, None)
    for plan in ("vocab_chunks", "token_chunks"):
        head = dict(multiplier=0.3, softcap=20.0, ignore_index=-100, plan=plan, token_chunk=256)
        want = slp.backward(*args, **head)
        for x, y in zip(want, slp.backward(*args, **head, logits_gemm="triton"), strict=True):
            assert torch.equal(x, y), plan


def test_cute_head_runs_the_logits_gemm_apart(emulated, apart):
    """cute.fused's forward and g reach the CuTe GEMM as plain float32 products (no addend),
    a chunk of columns at a time (float64 products here: close, not the kernel's bits)."""
    T, H, V = 300, 8, 1000
    h, w, t = head_inputs(T=T, H=H, V=V, dtype=torch.bfloat16)
    kw = dict(multiplier=0.3, softcap=20.0, ignore_index=-100)
    ref = slp.forward_all(h, w, t, **kw)
    got = slp.forward_all(h, w, t, **kw, logits_gemm="cute")
    assert emulated == [(torch.float32, "none", False)] * 4  # 256 + 256 + 256 + 232 columns
    assert torch.allclose(got.logprob, ref.logprob, rtol=1e-5, atol=1e-5)
    emulated.clear()
    gl = torch.randn(T, generator=torch.Generator().manual_seed(3))
    args = (h, w, t, ref.lse, None, gl, None, None)
    want = slp.backward(*args, **kw)
    grads = slp.backward(*args, **kw, grad_gemm="cute", logits_gemm="cute")
    assert emulated.count((torch.float32, "none", False)) == 4
    for a, b in zip(grads, want, strict=True):
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert 0 < b.double().norm() and rel < 1e-2, rel


# ---------------------------------------------------------------- GPU (SM90 + CUTLASS DSL)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_cute = pytest.mark.skipif(
    not (HAVE_CUTLASS and _sm90()), reason="needs nvidia-cutlass-dsl and an SM90 GPU"
)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("M,N,K", [(300, 6656, 4096), (4096, 640, 1344), (77, 200, 520)])
def test_cute_addend_epilogues_give_the_triton_gemms_bits(M, N, K):
    """c += a @ b into float32 (add), and a K range in two calls seeded by the first's float32
    sum, ending in bf16 (seed): the Triton kernel's ACCUMULATE and SEEDED bits, in place."""
    g = torch.Generator(device="cuda").manual_seed(4)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    b = (torch.randn(K, N, device="cuda", generator=g) * K**-0.5).bfloat16()
    c0 = torch.randn(M, N, device="cuda", generator=g)
    outs = {}
    for name, mm in slp.GRAD_GEMMS.items():
        acc = c0.clone()
        mm(a, b, acc, accumulate=True)
        plain = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        mm(a, b, plain)
        cut = (K // 2) // 256 * 256  # the edge on a promoted partial
        run = c0.clone()
        last = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        mm(a[:, :cut], b[:cut], run, accumulate=True, seeded=True)
        mm(a[:, cut:], b[cut:], run, accumulate=True, seeded=True, out=last)
        one = torch.empty_like(last)
        mm(a, b, c0.clone(), accumulate=True, seeded=True, out=one)
        assert torch.equal(last, one), name  # the chain is one call
        outs[name] = (acc, plain, last)
    for x, y in zip(outs["cute"], outs["triton"], strict=True):
        assert torch.equal(x, y)
    accs = {}  # the logits' GEMM apart: a @ rows.T, float32 unrounded
    for name, mm in slp.LOGITS_GEMMS.items():
        accs[name] = torch.empty(M, N, device="cuda")
        mm(a, b.T.contiguous(), accs[name])
    assert torch.equal(accs["cute"], accs["triton"])


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("plan", ["vocab_chunks", "token_chunks"])
@pytest.mark.parametrize("T,H,V", [(300, 512, 9000), (1100, 256, 4200), (2048, 1024, 20000)])
@pytest.mark.parametrize("acc_bytes", [None, 4 * 2048 * 2048])
def test_cute_heads_give_triton_fused_bits(plan, T, H, V, acc_bytes, monkeypatch):
    """Every output and both gradients of softcap_logprob (with entropy, argmax, the sum of
    squares) and linear_cross_entropy (label smoothing, token accuracy), cute against
    triton, bitwise; with the logits' GEMM apart from T = ACC_MIN_T, or from any T in
    chunks of 2048 columns or fewer (acc_bytes)."""
    if acc_bytes is not None:
        monkeypatch.setattr(slp, "ACC_MIN_T", 1)
        monkeypatch.setattr(slp, "ACC_BYTES", acc_bytes)
    h, w, t = (x.cuda() for x in head_inputs(T=T, H=H, V=V, dtype=torch.bfloat16, ignore=(1,)))
    calls = {
        "softcap_logprob": dict(multiplier=0.3, softcap=20.0, return_entropy=True,
                                return_predicted=True, return_log_sum_sq_probs=True),
        "linear_cross_entropy": dict(softcap=30.0, reduction="sum", label_smoothing=0.1,
                                     return_token_accuracy=True),
    }
    for op, params in calls.items():
        runs = {}
        for backend in ("cute", "triton"):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            f = dispatch.op(op, backend=backend, plan=plan, config={"token_chunk": 512})
            out = f(hh, ww, t, **params)
            ran = dispatch.last_provenance().implementation
            assert ran == (HEADS if backend == "cute" else TRITON)[op]
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
            diff = [o for o in outs if o.requires_grad]
            gen = torch.Generator(device="cuda").manual_seed(5)
            ups = [torch.randn(o.shape, device="cuda", generator=gen) for o in diff]
            runs[backend] = outs + list(torch.autograd.grad(diff, [hh, ww], ups))
        for x, y in zip(runs["cute"], runs["triton"], strict=True):
            assert torch.equal(x, y), (op, f"max diff {(x.double() - y.double()).abs().max()}")


@pytest.mark.gpu
@needs_cute
def test_g_from_a_cute_acc_gives_triton_bits(monkeypatch):
    """The backward's logits_gemm="cute" (what cute.fused serves from ACC_MIN_T rows): both
    gradients of linear_cross_entropy's head with label smoothing, against the fused g
    kernel, in both plans. Before the g kernels wrote their fmas out, 8 grad_weight elements
    differed here on the H100 and H200 (cute_head_g_parity_h200.json)."""
    monkeypatch.setattr(slp, "ACC_MIN_T", 1)
    monkeypatch.setattr(slp, "ACC_BYTES", 4 * 2048 * 2048)
    T, H, V = 300, 512, 9000
    h, w, t = (x.cuda() for x in head_inputs(T=T, H=H, V=V, dtype=torch.bfloat16, ignore=(1,)))
    kw = dict(multiplier=1.0, softcap=30.0, ignore_index=-100)
    r = slp.forward_all(h, w, t, **kw, zsum=True)
    g_lp, g_sm = lce.head_grads(torch.tensor(1.7, device="cuda"), t, ignore_index=-100,
                                reduction="sum", label_smoothing=0.1)  # fmt: skip
    for plan in ("vocab_chunks", "token_chunks"):
        args = (h, w, t, r.lse, None, g_lp, None, g_sm)
        want = slp.backward(*args, **kw, plan=plan, token_chunk=512)
        got = slp.backward(*args, **kw, plan=plan, token_chunk=512, logits_gemm="cute")
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y), plan
