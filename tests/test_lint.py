import dataclasses
import json

from opcontract.backends import registry
from opcontract.cli import lint
from opcontract.cli.docs import main as docs_main
from opcontract.contracts import load_all
from opcontract.contracts.schema import ReductionPlan


def test_shipped_contracts_are_clean(capsys):
    assert lint.main([]) == 0
    assert "clean" in capsys.readouterr().out


def test_json_output(capsys):
    assert lint.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and "softcap_logprob" in data["contracts"]
    assert {"torch.strict", "triton.fused"} <= {i["name"] for i in data["implementations"]}


def test_malformed_contract_is_a_line_not_a_traceback(tmp_path, capsys):
    text = open(load_all()["softcap_logprob"].path).read()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("    merge: add\n", "    merge: add\n    shuffle: yes\n", 1))
    assert lint.main([str(bad)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"{bad}:")
    line = int(out[0].split(":")[1])
    assert bad.read_text().splitlines()[line - 1].strip() == "shuffle: yes"


def test_folder_and_json_problems(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("op: [unclosed\n")
    assert lint.main([str(tmp_path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["ok"] and data["problems"][0]["path"].endswith("a.yaml")


def test_inconsistent_implementation_is_reported(monkeypatch, capsys):
    impl = registry._REGISTRY["triton.fused"]
    plan = dict(impl.plan)
    plan["vocab_lse"] = ReductionPlan(
        accumulate="float32", block=256, merge="online_max_rescale", split="fixed_blocks"
    )
    monkeypatch.setitem(
        registry._REGISTRY,
        "triton.fused",
        dataclasses.replace(impl, plan=plan, features=("atomics",)),
    )
    assert lint.main([]) == 1
    out = capsys.readouterr().out
    assert (
        "triton.fused (softcap_logprob): reduction 'vocab_lse' uses block 256, "
        "contract pins 128" in out
    )
    assert "uses forbidden feature 'atomics'" in out
    assert "register.py:" in out


def test_op_without_conforming_implementation(monkeypatch, capsys):
    for name in ("torch.strict", "triton.fused", "cute.fused"):
        monkeypatch.setitem(
            registry._REGISTRY,
            name,
            dataclasses.replace(registry._REGISTRY[name], relaxed_only=True),
        )
    assert lint.main([]) == 1
    assert "has no implementation that satisfies its contract" in capsys.readouterr().out


def test_generated_docs_are_current():
    assert docs_main(["docs/ops", "--check"]) == 0


def test_conformance_flag_runs_the_kit(capsys):
    assert lint.main(["--conformance", "--op", "swiglu", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ok   torch.strict_swiglu float32 case0.batch" in out


def test_packages_import_in_any_order():
    import subprocess
    import sys

    for first in ("opcontract.conformance", "opcontract.tuning", "opcontract.dispatch"):
        code = f"import {first}; import opcontract.cli.lint, opcontract.tuning.verify"
        subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_op_is_an_error_listing_the_known_ones(capsys):
    for args in (["--op", "nosuch"], ["--conformance", "--op", "nosuch", "--device", "cpu"]):
        assert lint.main(args) == 2
        out = capsys.readouterr()
        assert "clean" not in out.out and "ok " not in out.out
        assert "contract-lint: unknown op 'nosuch'; known ops: dense_gemm, " in out.err
        assert "softcap_logprob" in out.err


def test_an_unknown_op_among_broken_contracts_says_so(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("op: [unclosed\n")
    assert lint.main([str(tmp_path), "--op", "a"]) == 2
    assert "unknown op 'a'; known ops: (none) (and 1 problem(s): run without --op)" in (
        capsys.readouterr().err
    )
