"""Bad input is a ContractViolation naming the argument, never a wrong number or a crash."""

import pytest
import torch
from helpers import head_inputs

from opcontract import ContractViolation, dispatch
from opcontract.backends.torch.softcap_logprob import reference

slp = dispatch.op("softcap_logprob")


def _violation(match, *args, **kw):
    with pytest.raises(ContractViolation, match=match) as e:
        slp(*args, **kw)
    assert isinstance(e.value, ValueError)
    return e.value


def test_wrong_rank():
    h, w, t = head_inputs()
    e = _violation(r"'hidden'.*inputs\.hidden\.shape.*rank >= 2", h[0], w, t)
    assert e.argument == "hidden"
    e = _violation(r"'weight'.*inputs\.weight\.shape.*rank 2", h, w[None], t)
    assert e.argument == "weight"


def test_mismatched_leading_dims():
    h, w, t = head_inputs(T=10)
    e = _violation(r"'targets'.*leading dims \[10\] here but \[2, 5\] from 'hidden'",
                   h.reshape(2, 5, -1), w, t)  # fmt: skip
    assert e.argument == "targets"


def test_mismatched_h():
    h, w, t = head_inputs()
    _violation(r"'weight'.*shape\[1\].*H = 95 here but H = 96 from 'hidden'", h, w[:, :95], t)


def test_mismatched_t():
    h, w, t = head_inputs()
    _violation(r"'targets'.*T = 5 here but T = 6", h, w, t[:5])


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int64])
def test_hidden_dtype_outside_contract(dtype):
    h, w, t = head_inputs()
    _violation(r"'hidden'.*inputs\.hidden\.dtype", h.to(dtype), w.to(dtype), t)


def test_mixed_dtypes():
    h, w, t = head_inputs()
    _violation(r"'weight'.*dtype of 'hidden' \(float32\), got bfloat16", h, w.bfloat16(), t)


def test_float_targets():
    h, w, t = head_inputs()
    _violation(r"'targets'.*inputs\.targets\.dtype", h, w, t.float())


@pytest.mark.parametrize("bad", [600, 10_000, -1, -101])
def test_targets_out_of_range(bad):
    h, w, t = head_inputs()
    t[0] = bad
    _violation(r"'targets'.*inputs\.targets\.values.*\[0, 600\) or ignore_index=-100", h, w, t)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_softcap_checked(cap):
    h, w, t = head_inputs()
    _violation(r"'softcap'.*params\.softcap\.check", h, w, t, softcap=cap)


def test_param_types():
    h, w, t = head_inputs()
    _violation(r"'softcap'.*must be float, got str", h, w, t, softcap="20")
    _violation(r"'ignore_index'.*must be int", h, w, t, ignore_index=1.5)
    _violation(r"'multiplier'.*check", h, w, t, multiplier=float("nan"))


def test_different_devices():
    h, w, t = head_inputs()
    _violation(r"'weight'.*device.*meta", h, w.to("meta"), t)


def test_signature_errors():
    h, w, t = head_inputs()
    _violation(r"'top_k'.*unexpected argument", h, w, t, top_k=5)
    _violation(r"'targets'.*missing", h, w)
    _violation(r"positional", h, w, t, 20.0)
    _violation(r"'hidden'.*must be a torch.Tensor", h.numpy(), w, t)


def test_non_contiguous_inputs_are_handled():
    h, w, t = head_inputs(T=8)
    wt = w.T.contiguous().T  # same values, column-major
    hs = torch.cat([h, h], dim=1)[:, ::2]  # strided rows
    assert not wt.is_contiguous() and not hs.is_contiguous()
    expect = slp(hs.contiguous(), w, t, softcap=20.0)
    assert torch.equal(slp(hs, wt, t, softcap=20.0), expect)


def test_empty_batch_and_ignored_rows():
    h, w, t = head_inputs(T=0)
    out = slp(h, w, t)
    assert out.shape == (0,) and out.dtype == torch.float32
    h, w, t = head_inputs(T=4, ignore=(0, 2))
    out = slp(h, w, t, softcap=20.0)
    assert out[0].item() == 0.0 and out[2].item() == 0.0 and (out[[1, 3]] < 0).all()


def test_int32_targets_and_custom_ignore_index():
    h, w, t = head_inputs(ignore=())
    t[2] = 7
    out = slp(h, w, t.int(), ignore_index=7)
    assert out[2].item() == 0.0
    ref = reference(h, w, t, ignore_index=7)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-6


# Every Python value of every type, for every param of every op: the call returns or raises
# ContractViolation naming the param, never another exception.
_VALUES = [
    None, True, False, 0, 1, -1, 7, 2**31, 2**63, -(2**63) - 1, 2**70, 10**400, -(10**400),
    0.0, -0.0, 0.5, 1e-8, 1e300, float("inf"), -float("inf"), float("nan"), "", "plain",
    "none", "20", b"x", [1], (1,), {"a": 1}, object(), torch.tensor(1.0), 1j,
]  # fmt: skip


def _small_call(op):
    from opcontract.conformance.inputs import make_inputs
    from opcontract.contracts import get_contract

    c = get_contract(op)
    case = c.conformance.cases[0]
    sizes = {case_dim: min(v, 8) for case_dim, v in case.sizes.items()}  # even, small
    inputs, params = make_inputs(c, case, "float32", sizes=sizes)
    return c, inputs, params


@pytest.mark.parametrize(
    "op", sorted(__import__("opcontract.contracts", fromlist=["x"]).load_all())
)
def test_any_param_value_is_a_result_or_a_contract_violation(op):
    c, inputs, params = _small_call(op)
    f = dispatch.op(op)
    for name in c.params:
        for value in _VALUES:
            kw = {**params, name: value}
            if (
                c.params[name].type == "str"
                and isinstance(value, str)
                and value in (c.params[name].choices or [])
            ):
                continue  # a valid choice may need other inputs (tested elsewhere)
            try:
                f(**inputs, **kw)
            except ContractViolation as e:
                assert e.argument == name, (name, value, str(e))
            except Exception as e:
                msg = f"{op}: {name}={value!r} raised {type(e).__name__}: {e}"
                raise AssertionError(msg) from e


@pytest.mark.parametrize("bad", [2**70, -(2**70), 2**63])
def test_ignore_index_outside_int64_is_a_violation_at_any_t(bad):
    for T in (0, 4):
        h, w, t = head_inputs(T=T)
        _violation(r"'ignore_index'.*outside the range of int64", h, w, t, ignore_index=bad)


@pytest.mark.parametrize("param", ["eps"])
def test_huge_int_for_a_float_param(param):
    x = torch.randn(3, 8)
    with pytest.raises(ContractViolation, match=r"'eps'.*outside the range of a float"):
        dispatch.op("rms_norm")(x, torch.ones(8), eps=10**400)


def test_all_ignored_targets_with_an_empty_vocabulary():
    h = torch.randn(3, 8)
    w = torch.randn(0, 8)
    t = torch.full((3,), -100)
    out = dispatch.op("linear_cross_entropy")(h, w, t, reduction="sum")
    assert out.item() == 0.0
    t[1] = 0
    _violation_lce = pytest.raises(ContractViolation, match=r"'targets'.*\[0, 0\)")
    with _violation_lce:
        dispatch.op("linear_cross_entropy")(h, w, t)


def test_meta_tensors_are_no_backend_not_a_crash():
    from opcontract import NoBackendError

    ids = torch.tensor([1, 2], device="meta")
    table = torch.randn(5, 8, device="meta")
    with pytest.raises(NoBackendError, match="not meta"):
        dispatch.op("normalized_embedding")(ids, table)
    h, w, t = (x.to("meta") for x in head_inputs())
    with pytest.raises(NoBackendError):
        slp(h, w, t)


def test_int32_targets_with_an_ignore_index_int32_cannot_hold():
    h, w, t = head_inputs(ignore=())
    out = slp(h, w, t.int(), ignore_index=2**40)  # no int32 equals it: every target counts
    ref = reference(h, w, t)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-6
