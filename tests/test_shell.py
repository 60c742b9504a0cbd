"""The op shell generated from the contracts: one torch.library op per contract, fullgraph
compile, opcheck, autocast, leading batch dims, the eager fast path."""

import pytest
import torch

from opcontract import ContractViolation, dispatch
from opcontract.conformance.checks import named_outputs, with_optional_outputs
from opcontract.conformance.inputs import make_inputs
from opcontract.contracts import get_contract, load_all
from opcontract.dispatch import shell as shell_mod
from opcontract.dispatch.shell import op_shell
from opcontract.nn import StrictLinear

OPS = sorted(load_all())
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _call(op, dtype="float32", sizes=None, seed=0, case=0):
    c = get_contract(op)
    inputs, params = make_inputs(
        c, c.conformance.cases[case], dtype, sizes=sizes, seed=seed, device=DEVICE
    )
    return c, inputs, with_optional_outputs(c, params)


def _forward_backward(c, fn, inputs):
    """Outputs, then gradients of a fixed weighted sum of the differentiable outputs."""
    leaves = {
        k: (v.clone().requires_grad_() if k in c.grads and v is not None else v)
        for k, v in inputs.items()
    }
    outs = named_outputs(c, fn(**leaves))
    loss = sum(
        (o.double() * _ramp(o)).sum() for n, o in outs.items() if c.outputs[n].differentiable
    )
    if c.grads:
        loss.backward()
    grads = [leaves[k].grad for k in c.grads if leaves[k] is not None]
    return [o.detach() for o in outs.values()] + grads


def _ramp(o):
    return torch.linspace(-1, 1, o.numel(), dtype=torch.float64, device=o.device).reshape(o.shape)


@pytest.mark.parametrize("op", OPS)
def test_fullgraph_compile_gives_the_eager_bits(op):
    c, inputs, params = _call(op)
    f = dispatch.op(op)

    def step(**kw):
        return f(**kw, **params)

    torch._dynamo.reset()
    eager = _forward_backward(c, step, inputs)
    compiled = _forward_backward(c, torch.compile(step, fullgraph=True), inputs)
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_a_block_of_every_op_traces_without_graph_breaks():
    torch.manual_seed(0)
    V, H, I = 50, 32, 48  # noqa: E741
    table = torch.randn(V, H)
    wn1, wn2 = torch.randn(H) * 0.1, torch.randn(H) * 0.1
    up = StrictLinear(H, 2 * I, bias=False)
    down = StrictLinear(I, H, bias=False)
    head = torch.randn(V, H) * 0.5
    emb, norm = dispatch.op("normalized_embedding"), dispatch.op("rms_norm")
    add_norm, act = dispatch.op("fused_add_rms_norm"), dispatch.op("swiglu")
    loss_fn, logprob = dispatch.op("linear_cross_entropy"), dispatch.op("softcap_logprob")

    def block(ids, targets):
        h = emb(ids, table)  # [B, T, H]
        x = norm(h, wn1, variant="centred", eps=1e-5)
        m = down(act(up(x), layout="packed"))
        y, _ = add_norm(m, h, wn2, variant="plain", eps=1e-8)
        loss = loss_fn(y, head, targets, softcap=20.0, multiplier=0.5)
        return loss, logprob(y, head, targets, softcap=20.0)

    ids = torch.randint(0, V, (2, 5))
    targets = torch.randint(0, V, (2, 5))
    explained = torch._dynamo.explain(block)(ids, targets)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        for p in (*up.parameters(), *down.parameters()):
            p.grad = None
        loss, lp = fn(ids, targets)
        (loss + lp.sum()).backward()
        results.append((loss.detach(), lp.detach(), up.weight.grad, down.weight.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _op_args(op):
    c, inputs, params = _call(op)
    sh = op_shell(op)
    return c, sh, (*inputs.values(), *params.values(), "", "strict", "")


@pytest.mark.parametrize("op", OPS)
def test_opcheck_forward_op(op):
    c, sh, args = _op_args(op)
    grads = [i for i, n in enumerate(c.inputs) if n in c.grads and args[i] is not None]
    args = tuple(a.clone().requires_grad_() if i in grads else a for i, a in enumerate(args))
    torch.library.opcheck(sh.fwd, args)


@pytest.mark.parametrize("op", [op for op in OPS if get_contract(op).grads])
def test_opcheck_backward_op(op):
    c, sh, args = _op_args(op)
    inputs = dict(zip(c.inputs, args, strict=False))
    params = dict(zip(c.params, args[len(c.inputs) :], strict=False))
    out = sh.call_forward(inputs, params, "", "strict", "")
    named = {**inputs, **dict(zip((*c.outputs, *c.residuals), out, strict=True))}
    saved = [named[s] for s in c.backward.saves]
    g = [torch.ones_like(named[n]) for n in sh.diff]
    flat = tuple(inputs.values())
    sizes = [flat[i].shape[j] for i, j in sh.size_source]
    needs = [inputs[n] is not None for n in sh.grads]
    dtype = str(flat[sh.dtype_source].dtype).removeprefix("torch.")
    torch.library.opcheck(
        sh.bwd, (*saved, *g, sizes, needs, *params.values(), dtype, "", "strict", "")
    )


# ----------------------------------------------------------------------------- batch dims
_LEAD = {"T": (3, 4), "M": (2, 6)}


@pytest.mark.parametrize("op", OPS)
def test_leading_batch_dims_equal_the_flattened_call(op):
    c = get_contract(op)
    bdim = c.batch_dims
    lead = _LEAD[bdim]
    _, inputs, params = _call(op, sizes={bdim: lead[0] * lead[1]})
    batched = {n for n, s in c.inputs.items() if s.shape and s.shape[0] == bdim}
    shaped = {
        k: (v.reshape(*lead, *v.shape[1:]) if k in batched and v is not None else v)
        for k, v in inputs.items()
    }
    f = dispatch.op(op)
    flat = _forward_backward(c, lambda **kw: f(**kw, **params), inputs)
    nested = _forward_backward(c, lambda **kw: f(**kw, **params), shaped)
    for a, b in zip(flat, nested, strict=True):
        if b.dim() >= len(lead) and tuple(b.shape[: len(lead)]) == lead:
            b = b.reshape(-1, *b.shape[len(lead) :])
        assert torch.equal(a, b)
    with pytest.raises(ContractViolation) as e:  # leading dims that disagree
        first, *rest = [n for n in c.inputs if n in batched and inputs[n] is not None]
        if not rest:
            pytest.skip("one batched input")
        bad = {**shaped, rest[0]: inputs[rest[0]]}
        f(**bad, **params)
    assert e.value.argument == rest[0]


def test_strict_linear_accepts_any_leading_dims():
    lin = StrictLinear(16, 8)
    x = torch.randn(2, 3, 16)
    assert torch.equal(lin(x), lin(x.reshape(6, 16)).reshape(2, 3, 8))
    assert torch.equal(lin(x[0, 0]), lin(x[0, :1])[0])  # a 1-D input, as nn.Linear


# ----------------------------------------------------------------------------- autocast
def test_strict_linear_under_autocast_matches_nn_linear_dtype_and_strict_bits():
    torch.manual_seed(0)
    first, strict = torch.nn.Linear(64, 64), StrictLinear(64, 32)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", torch.bfloat16):
        h = first(x)
        y = strict(h)
        stock = torch.nn.functional.linear(h, strict.weight, strict.bias)
    assert y.dtype == stock.dtype == torch.bfloat16
    want = dispatch.op("dense_gemm")(h, strict.weight.bfloat16(), strict.bias.bfloat16())
    assert torch.equal(y, want)


def test_norms_promote_under_autocast():
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(32)
    with torch.autocast("cpu", torch.bfloat16):
        y = dispatch.op("rms_norm")(x, w, variant="centred")
    assert y.dtype == torch.float32
    assert torch.equal(y, dispatch.op("rms_norm")(x.float(), w, variant="centred"))


def test_autocast_leaves_what_the_contract_does_not_admit_to_it():
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(ContractViolation) as e:
        dispatch.op("dense_gemm")(torch.randn(3, 8, dtype=torch.float64), torch.randn(4, 8))
    assert e.value.argument in ("x", "weight")


def test_embedding_ignores_autocast():
    table = torch.randn(10, 16)
    ids = torch.tensor([1, 2, 9])
    with torch.autocast("cpu", torch.bfloat16):
        y = dispatch.op("normalized_embedding")(ids, table)
    assert y.dtype == torch.float32


# ----------------------------------------------------------------------------- fast path
def _spy(monkeypatch, obj, name):
    calls = []
    real = getattr(obj, name)

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(obj, name, spy)
    return calls


@pytest.mark.parametrize(
    "op, backend",
    [
        ("rms_norm", None),
        ("swiglu", None),
        ("dense_gemm", None),
        ("softcap_logprob", None),
        ("rms_norm", "triton"),  # forward_no_grad: no rstd stored, the same y
        ("fused_add_rms_norm", "triton"),
    ],
)
def test_no_grad_skips_the_library_op_with_the_same_bits(monkeypatch, op, backend):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    c, inputs, params = _call(op)
    f = dispatch.op(op, backend=backend)
    leaves = {k: (v.clone().requires_grad_() if k in c.grads and v is not None else v)
              for k, v in inputs.items()}  # fmt: skip
    with_op = named_outputs(c, f(**leaves, **params))
    calls = _spy(monkeypatch, type(op_shell(op)), "call_forward")
    with torch.no_grad():
        direct = named_outputs(c, f(**leaves, **params))
    assert calls == []
    plain = named_outputs(c, f(**inputs, **params))  # grad mode, nothing requires grad
    assert calls == []
    for n in with_op:
        assert torch.equal(with_op[n].detach(), direct[n]) and torch.equal(direct[n], plain[n])
    f(**leaves, **params)
    assert calls == [1]


def test_eager_backward_skips_the_backward_op_with_the_same_bits(monkeypatch):
    x, w, dy = torch.randn(5, 40), torch.randn(40), torch.randn(5, 40)
    f = dispatch.op("rms_norm")

    def grads():
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        f(xs, ws).backward(dy)
        return xs.grad, ws.grad

    sh = op_shell("rms_norm")
    calls = _spy(monkeypatch, sh, "bwd")
    direct = grads()
    assert calls == []
    monkeypatch.setattr(shell_mod, "bypass_op", lambda *t: False)  # through the ops
    via_op = grads()
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op, strict=True))


def test_named_results_come_from_the_contracts():
    from opcontract.outputs import AddNormOutput, CrossEntropyOutput, LogprobOutput

    assert LogprobOutput._fields == tuple(get_contract("softcap_logprob").outputs)
    assert CrossEntropyOutput._fields == ("loss", "token_accuracy")
    assert AddNormOutput._fields == ("y", "residual_out")
    x = torch.randn(3, 8)
    out = dispatch.op("fused_add_rms_norm")(x, x, torch.ones(8))
    assert isinstance(out, AddNormOutput)


# ----------------------------------------------------------------------------- layouts
def test_explain_names_the_copies_the_layout_needs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w = torch.randn(4, 32), torch.randn(64)[::2]
    r = dispatch.explain("rms_norm", x, w, backend="triton")
    assert r.copies == {"weight": "contiguous"}
    assert "copies 'weight' to a contiguous layout" in str(r)
    assert dispatch.explain("rms_norm", x, w.contiguous(), backend="triton").copies == {}


@pytest.mark.parametrize(
    "op, impl, strided",
    [("rms_norm", "triton.norm", "weight"), ("dense_gemm", "triton.gemm", "bias")],
)
def test_the_shell_copies_what_a_kernel_cannot_stride(monkeypatch, op, impl, strided):
    """Negative control: with its layout declared as 'any', the Triton kernel reads a sliced
    1-D input as if it were contiguous, and the layout check catches it."""
    import dataclasses

    from opcontract.backends import registry
    from opcontract.conformance import check_layout, runner_for

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    c = get_contract(op)
    real = registry.implementation(impl)
    assert check_layout(runner_for(real), c, c.conformance.cases[0], "float32").ok
    careless = dataclasses.replace(real, layout={"*": "any"})
    monkeypatch.setitem(registry._REGISTRY, impl, careless)
    result = check_layout(runner_for(careless), c, c.conformance.cases[0], "float32")
    assert not result.ok and strided in result.detail
