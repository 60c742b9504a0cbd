import pytest

from opcontract.contracts import get_contract, load_all, load_contract_file, parse_contract
from opcontract.contracts.schema import check_value, parse_check
from opcontract.errors import ContractFileError

SHIPPED = load_all()["softcap_logprob"]


def _yaml_with(old: str, new: str) -> str:
    text = open(SHIPPED.path).read()
    assert old in text
    return text.replace(old, new, 1)


def test_shipped_contract_loads_with_hash_and_lines():
    c = get_contract("softcap_logprob")
    assert c.version == 2 and len(c.sha256) == 64
    assert c.reductions["vocab_lse"].block == 128
    assert c.float_dtypes() == ["bfloat16", "float16", "float32"]
    assert c.input_dtypes("weight") == c.input_dtypes("hidden")
    assert (
        open(c.path).read().splitlines()[c.line_of("reductions", "vocab_lse", "block") - 1].strip()
        == "block: 128"
    )


def test_unknown_field_reports_its_line():
    text = _yaml_with(
        "    accumulate: float32\n    block: 128",
        "    accumulate: float32\n    colour: red\n    block: 128",
    )
    with pytest.raises(ContractFileError) as e:
        parse_contract(text, "x.yaml")
    ((path, line, msg),) = e.value.problems
    assert path == "x.yaml" and "unknown field" in msg
    assert text.splitlines()[line - 1].strip() == "colour: red"


def test_bad_enum_and_type_report_lines():
    text = _yaml_with("accumulate: float32\n    block: impl", "accumulate: float8\n    block: impl")
    with pytest.raises(ContractFileError) as e:
        parse_contract(text, "x.yaml")
    lines = {line for _, line, _ in e.value.problems}
    assert any("accumulate: float8" in text.splitlines()[n - 1] for n in lines)


def test_yaml_syntax_error_has_line():
    with pytest.raises(ContractFileError) as e:
        parse_contract("op: x\ninputs: [a\n  b: c\n", "s.yaml")
    assert e.value.problems[0][1] >= 2 and "YAML syntax" in e.value.problems[0][2]


def test_duplicate_key_is_an_error():
    text = _yaml_with("version: 2\n", "version: 2\nversion: 3\n")
    with pytest.raises(ContractFileError, match="duplicate key 'version'"):
        parse_contract(text)


@pytest.mark.parametrize(
    "old,new,needle",
    [
        ("dtype: {same_as: hidden}", "dtype: {same_as: hiden}", "unknown input 'hiden'"),
        ('check: "> 0 and finite"', 'check: "positive"', "cannot parse check"),
        ("default: 1.0\n    check: finite", "default: .nan\n    check: finite", "fails the check"),
        ("over: H", "over: K", "'K' is not a shape symbol"),
        ("{at: logprob, to: float32}", "{at: logits, to: float32}", "neither an output"),
        ("  bfloat16: 2.0e-6\n", "", "no tolerance for served dtype bfloat16"),
    ],
)
def test_semantic_problems_name_the_field(old, new, needle):
    with pytest.raises(ContractFileError, match=needle):
        parse_contract(_yaml_with(old, new))


def test_missing_file_is_a_contract_file_error(tmp_path):
    with pytest.raises(ContractFileError, match="cannot read"):
        load_contract_file(tmp_path / "nope.yaml")


def test_not_a_mapping():
    with pytest.raises(ContractFileError, match="mapping"):
        parse_contract("- a\n- b\n")


def test_check_grammar():
    assert parse_check(">= 0 and < 1") == [(">=", 0.0), ("<", 1.0)]
    assert check_value("> 0", 0.0) and check_value("> 0", 1.0) is None
    assert check_value("finite", float("inf"))
    with pytest.raises(ValueError):
        parse_check("positive")


def test_a_neutral_param_leaves_the_numerics_hash_and_its_value_moves_it():
    """temperature is declared neutral at its default: the hash is the one without the param
    (the shipped tuning was verified before it existed); a non-neutral param, or another
    default, moves it; neutral must be the default."""
    start = "  temperature:\n"
    text = open(SHIPPED.path).read()
    block = text[text.index(start) : text.index("  return_entropy:\n")]
    text = text.replace(", temperature: 0.7,", ",")  # its conformance case
    without = parse_contract(text.replace(block, "", 1))
    assert SHIPPED.numerics_sha256 == without.numerics_sha256
    assert SHIPPED.params["temperature"].math and "temperature" not in SHIPPED.math
    plain = block.replace("    neutral: 1.0\n", "", 1)
    plain = plain[: plain.index("    math: |")]
    assert parse_contract(text.replace(block, plain, 1)).numerics_sha256 != without.numerics_sha256
    with pytest.raises(ContractFileError, match="neutral 1.0 must be the default"):
        parse_contract(text.replace(block, block.replace("default: 1.0", "default: 2.0", 1), 1))


def test_an_output_asked_for_by_a_neutral_param_stays_out_of_the_hash():
    """return_mean_logits (neutral false) asks for mean_logits and its vocab_zsum reduction:
    all three are left out of the hash; a reduction's ``when`` must name a bool param."""
    text = open(SHIPPED.path).read()
    c = parse_contract(text)
    assert c.reductions["vocab_zsum"].when == "return_mean_logits"
    assert c.outputs["mean_logits"].when == "return_mean_logits"
    moved = parse_contract(text.replace("    when: return_mean_logits\n    doc: sum_v z",
                                        "    doc: sum_v z", 1))  # fmt: skip
    assert moved.numerics_sha256 != c.numerics_sha256  # an always-on reduction counts
    with pytest.raises(ContractFileError, match="'softcap' is not a bool param"):
        parse_contract(text.replace("    when: return_mean_logits\n    doc: sum_v z",
                                    "    when: softcap\n    doc: sum_v z", 1))  # fmt: skip
