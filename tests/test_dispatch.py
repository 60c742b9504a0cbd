import dataclasses

import pytest
import torch
from helpers import head_inputs

from opcontract import NoBackendError, dispatch
from opcontract.backends import registry
from opcontract.dispatch.device import simulate


def test_cpu_selection_and_report():
    h, w, t = head_inputs()
    r = dispatch.explain("softcap_logprob", h, w, t, softcap=20.0)
    assert r.implementation == "torch.strict" and r.selected == "torch"
    assert "library-chosen order" in r.rejected["torch.eager"]
    assert "forbidden feature 'full_logits'" in r.rejected["torch.eager"]
    text = str(r)
    assert "selected: torch.strict" in text and "rejected torch.eager" in text
    assert r.sizes == {"T": 6, "H": 96, "V": 600}


def test_provenance_names_contract_and_backend():
    h, w, t = head_inputs()
    dispatch.op("softcap_logprob")(h, w, t, softcap=20.0)
    p = dispatch.last_provenance()
    from opcontract.contracts import get_contract

    c = get_contract("softcap_logprob")
    assert (p.op, p.contract_version, p.contract_sha256) == ("softcap_logprob", 2, c.sha256)
    assert p.implementation == "torch.strict" and p.device == "cpu"
    assert p.dtypes == {"hidden": "float32", "weight": "float32", "targets": "int64"}
    assert p.params["softcap"] == 20.0


def test_forced_backend_rejected_lists_every_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, t = head_inputs()
    with pytest.raises(NoBackendError) as e:
        dispatch.op("softcap_logprob", backend="triton")(h, w, t)
    assert isinstance(e.value, RuntimeError)
    msg = str(e.value)
    assert "requested backend 'triton'" in msg
    assert "triton.fused: Triton kernels need a CUDA GPU" in msg
    assert "torch.strict: not requested" in msg


def test_relaxed_mode_admits_stock_path():
    h, w, t = head_inputs()
    out = dispatch.op("softcap_logprob", backend="torch.eager", mode="relaxed")(h, w, t)
    assert dispatch.last_provenance().implementation == "torch.eager"
    assert out.shape == (6,)
    with pytest.raises(NoBackendError, match="does not satisfy the contract"):
        dispatch.op("softcap_logprob", backend="torch.eager")(h, w, t)


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        dispatch.op("softcap_logprob", mode="fast")


def test_unknown_op():
    with pytest.raises(KeyError, match="no contract for op 'nope'"):
        dispatch.op("nope")


@pytest.mark.parametrize(
    "cap,expect",
    [
        ((9, 0), "triton.fused"),
        ((10, 0), "triton.fused"),
        ((7, 5), "torch.strict"),
    ],
)
def test_simulated_gpu_selection(cap, expect):
    h, w, t = head_inputs()
    with simulate(cap, name="Simulated"):
        r = dispatch.explain("softcap_logprob", h, w, t)
    assert r.implementation == expect
    if cap < (8, 0):
        assert r.rejected["triton.fused"] == (
            "needs compute capability SM80 to SM121, this GPU is SM75"
        )


def test_missing_library_is_a_reason_not_an_error(monkeypatch):
    impl = registry._REGISTRY["triton.fused"]
    monkeypatch.setitem(
        registry._REGISTRY,
        "triton.fused",
        dataclasses.replace(impl, available=lambda: "Triton is not installed (pip install triton)"),
    )
    h, w, t = head_inputs()
    with simulate((9, 0)):
        r = dispatch.explain("softcap_logprob", h, w, t)
    assert r.rejected["triton.fused"] == "Triton is not installed (pip install triton)"
    assert r.implementation == "torch.strict"


def test_no_conforming_implementation(monkeypatch):
    for name in ("torch.strict", "triton.fused", "cute.fused"):
        impl = registry._REGISTRY[name]
        monkeypatch.setitem(
            registry._REGISTRY, name, dataclasses.replace(impl, invariances=("run_to_run",))
        )
    h, w, t = head_inputs()
    with pytest.raises(NoBackendError) as e:
        dispatch.op("softcap_logprob")(h, w, t)
    assert "does not guarantee 'batch' invariance" in str(e.value)
    assert set(e.value.rejected) == {"torch.strict", "torch.eager", "triton.fused", "cute.fused"}


def test_triton_runs_through_dispatch():
    """Under the interpreter on the CPU; on the GPU where there is one."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, w, t = (x.to(dev) for x in head_inputs(dtype=torch.bfloat16))
    out = dispatch.op("softcap_logprob", backend="triton")(h, w, t, softcap=20.0)
    assert dispatch.last_provenance().implementation == "triton.fused"
    assert dispatch.last_provenance().config["block_t"] > 0
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
