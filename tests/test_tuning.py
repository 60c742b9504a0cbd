"""The tuner's verification, the tuning database, and dispatch reading it (CPU)."""

import dataclasses
import json
import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch
from helpers import head_inputs

import opcontract.contracts
from opcontract import dispatch
from opcontract.backends.registry import implementation
from opcontract.contracts import get_contract
from opcontract.dispatch.device import DeviceInfo
from opcontract.tables.db import TuningDB, bucket_of, make_entry, write_entry
from opcontract.tuning import search_space, verify_config

CPU = DeviceInfo("cpu")


def test_bucket_of():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 64, 65, 8192)] == [0, 1, 2, 4, 64, 128, 8192]


def test_space_is_the_declared_config_space_only():
    space = search_space(implementation("triton.fused"))
    assert "schedule" in space and "block_t" in space
    assert not {"block_v", "block_k", "promote"} & set(space)  # pinned by the contract


def test_schedules_verify_bitwise_under_the_interpreter():
    impl = implementation("triton.fused")
    c = get_contract("softcap_logprob")
    verdict = verify_config(
        impl, c, "bfloat16", {"T": 9, "H": 64, "V": 300}, {"schedule": "tiles", "group_t": 1}
    )
    assert verdict.ok, verdict.detail


def test_a_config_that_moves_bits_is_rejected_and_named(monkeypatch):
    from opcontract.backends import registry

    impl = implementation("torch.strict")

    def forward(config, **kw):  # "split" 2 perturbs the result: an order-determining parameter
        lp, *rest = impl.forward({}, **kw)
        return (lp * (1 + 1e-6 * (config.get("split", 1) - 1)), *rest)

    fake = dataclasses.replace(
        impl,
        name="torch.fake_split",
        forward=forward,
        config_space={"split": (1, 2), "tile": (8, 16)},
        default_config=lambda call: {"split": 1, "tile": 8},
    )
    monkeypatch.setitem(registry._REGISTRY, fake.name, fake)
    c = get_contract("softcap_logprob")
    sizes = {"T": 4, "H": 32, "V": 200}
    assert verify_config(fake, c, "float32", sizes, {"tile": 16}).ok
    verdict = verify_config(fake, c, "float32", sizes, {"tile": 16, "split": 2})
    assert not verdict.ok and verdict.moved == ("split",)


def _entry(**kw):
    c = get_contract("softcap_logprob")
    base = dict(
        device=CPU,
        op="softcap_logprob",
        implementation="triton.fused",
        dtype="float32",
        shape="H=96,V=600",
        bucket=8,
        config={"group_t": 4},
        numerics_sha256=c.numerics_sha256,
        median_ms=1.0,
    )
    base.update(kw)
    return make_entry(**base)


def _key(bucket=8, shape="H=96,V=600", numerics=None):
    c = get_contract("softcap_logprob")
    impl = implementation("triton.fused")
    return (CPU, "softcap_logprob", impl, "float32", shape, bucket, numerics or c.numerics_sha256)


def test_table_round_trip_and_mismatches(tmp_path):
    table = tmp_path / "t.json"
    write_entry(table, _entry())
    write_entry(table, _entry(config={"group_t": 16}))  # replaces the same key
    db = TuningDB([table])
    e = db.lookup(*_key())
    assert e.config == {"group_t": 16} and len(db.entries) == 1
    assert db.lookup(*_key(bucket=16)) is None
    assert db.lookup(*_key(shape="H=96,V=601")) is None
    with pytest.warns(UserWarning, match="other numerics of the softcap_logprob contract"):
        assert db.lookup(*_key(numerics="0" * 64)) is None
    stale = _entry()
    stale["stamp"]["torch"] = "0.0.1"
    write_entry(tmp_path / "stale.json", stale)
    with pytest.warns(UserWarning, match="other versions"):
        assert TuningDB([tmp_path / "stale.json"]).lookup(*_key()) is None


def test_an_entry_matches_only_its_own_compilers_versions(tmp_path):
    key = _key()
    other = _entry()  # made where another CUTLASS DSL (or none) was installed
    other["stamp"]["cutlass_dsl"] = "0.0.1"
    write_entry(tmp_path / "t.json", other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuningDB([tmp_path / "t.json"]).lookup(*key) is not None
    stale = _entry()
    stale["stamp"]["triton"] = "0.0.1"
    write_entry(tmp_path / "s.json", stale)
    with pytest.warns(UserWarning, match="other versions .*triton"):
        assert TuningDB([tmp_path / "s.json"]).lookup(*key) is None


def test_corrupt_table_is_ignored_with_a_warning(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring tuning table"):
        assert TuningDB([tmp_path]).entries == []


def _writer(path, start):
    for b in range(start, start + 15):
        write_entry(path, _entry(bucket=b))


def test_concurrent_writers_keep_every_entry(tmp_path):
    table = tmp_path / "shared.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(table, s)) for s in (0, 100)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    data = json.loads(table.read_text())
    assert sorted(e["bucket"] for e in data["entries"]) == [*range(15), *range(100, 115)]


def test_dispatch_reads_the_table(tmp_path, monkeypatch):
    table = tmp_path / "mine.json"
    write_entry(table, _entry(bucket=8, config={"group_t": 1, "schedule": "tiles"}))
    monkeypatch.setenv("OPCONTRACT_TUNING_PATH", str(table))
    h, w, t = head_inputs(T=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = dispatch.explain("softcap_logprob", h, w, t, backend="triton")
    assert r.config["schedule"] == "tiles" and r.config["group_t"] == 1
    assert r.tuning_entry.startswith(str(table))
    out = dispatch.op("softcap_logprob", backend="triton")(h, w, t)
    assert dispatch.last_provenance().tuning_entry == r.tuning_entry
    monkeypatch.delenv("OPCONTRACT_TUNING_PATH")
    assert torch.equal(dispatch.op("softcap_logprob", backend="triton")(h, w, t), out)
    assert dispatch.last_provenance().tuning_entry is None


TINY_SWEEP = """
name: tiny
dtypes: [float32]
ops:
  - op: softcap_logprob
    implementation: triton.fused
    sizes: {H: 32, V: 300}
    params: {softcap: 20.0}
    batch: [4]
"""


def test_sweep_writes_a_verified_table_that_dispatch_uses(tmp_path, monkeypatch, capsys):
    from opcontract.cli.tune import main

    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(TINY_SWEEP)
    table = tmp_path / "tuned.json"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "3", "--storage", storage]
    args += ["--no-progress", "--device", "cpu"]
    assert main(args) == 0
    assert "softcap_logprob" in capsys.readouterr().out
    entry = json.loads(table.read_text())["entries"][0]
    assert entry["bucket"] == 4 and entry["implementation"] == "triton.fused"
    assert main(args) == 0  # resumable: the same storage continues the study
    assert main(["show", "--table", str(table)]) == 0
    assert "triton.fused float32 H=32,V=300 bucket 4" in capsys.readouterr().out
    assert main(["verify", "--table", str(table), "--device", "cpu"]) == 0
    assert "verified 1 of 1 entries" in capsys.readouterr().out
    verify_only = ["verify", "--table", str(table), "--device", "cpu", "--no-progress"]
    assert main([*verify_only, "--only", "dense_gemm"]) == 0
    assert "verified 0 of 0 entries" in capsys.readouterr().out
    assert main([*verify_only, "--only", "triton.fused"]) == 0
    assert "verified 1 of 1 entries" in capsys.readouterr().out
    assert main([*verify_only, "--only", "nosuch"]) == 2
    assert "unknown op or implementation 'nosuch'; known ops: " in capsys.readouterr().err
    entry = json.loads(table.read_text())["entries"][0]  # the resumed study may improve it
    monkeypatch.setenv("OPCONTRACT_TUNING_PATH", str(table))
    h, w, t = head_inputs(T=3, H=32, V=300)
    r = dispatch.explain("softcap_logprob", h, w, t, softcap=20.0, backend="triton")
    assert r.tuning_entry and r.config == {**r.config, **entry["config"]}


@pytest.mark.parametrize(
    "text,needle",
    [
        (TINY_SWEEP.replace("name: tiny", "name: tiny\ncolour: red"), "Extra inputs"),
        (TINY_SWEEP.replace("op: softcap_logprob", "op: nope"), "no contract for op 'nope'"),
        (TINY_SWEEP.replace("triton.fused", "torch.nope"), "no implementation 'torch.nope'"),
        (TINY_SWEEP.replace("{H: 32, V: 300}", "{H: 32}"), "no size for ['V']"),
    ],
)
def test_bad_sweep_files_exit_1(tmp_path, capsys, text, needle):
    from opcontract.cli.tune import main

    sweep = tmp_path / "bad.yaml"
    sweep.write_text(text)
    table = tmp_path / "t.json"
    assert main(["sweep", str(sweep), "--table", str(table), "--no-progress"]) == 1
    assert needle in capsys.readouterr().err
    assert not table.exists()


def test_unwritable_storage_exits_1_before_any_work(tmp_path, capsys):
    from opcontract.cli.tune import main

    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(TINY_SWEEP)
    assert (
        main(
            [
                "sweep",
                str(sweep),
                "--table",
                str(tmp_path / "t.json"),
                "--storage",
                "sqlite:////proc/nope/study.db",
                "--no-progress",
            ]
        )
        == 1
    )
    assert "can't be written" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_shipped_sweeps_load():
    from pathlib import Path

    from opcontract.tuning.sweep import load_sweep

    for path in (Path(__file__).parent.parent / "opcontract/tuning/sweeps").glob("*.yaml"):
        assert load_sweep(path).ops


def test_only_filters_studies_and_unknown_filter_exits_1(tmp_path, capsys):
    from opcontract.cli.tune import main

    sweep = tmp_path / "two.yaml"
    sweep.write_text(
        TINY_SWEEP
        + """  - op: dense_gemm
    implementation: triton.gemm
    sizes: {N: 40, K: 300}
    batch: [4]
"""
    )
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "1", "--no-progress"]
    assert main([*args, "--only", "dense_gemm"]) == 0
    out = capsys.readouterr().out
    assert "dense_gemm" in out and "softcap_logprob" not in out
    assert main([*args, "--only", "swiglu"]) == 1  # an op, but none of the sweep's
    assert "matches no op" in capsys.readouterr().err
    assert main([*args, "--only", "dense_gemm,no_such_op"]) == 2
    err = capsys.readouterr().err
    assert "unknown op or implementation 'no_such_op'; known ops: dense_gemm," in err
    assert "known implementations: " in err and "triton.gemm" in err
    assert not table.exists() or "no_such_op" not in table.read_text()


def test_each_shape_has_its_own_study(tmp_path):
    """Two shapes of one op must not share trials (a shared study would hand one shape
    the other's timings and configs it never verified)."""
    import optuna

    from opcontract.cli.tune import main

    sweep = tmp_path / "shapes.yaml"
    sweep.write_text(
        """name: shapes
dtypes: [float32]
ops:
  - {op: dense_gemm, implementation: triton.gemm, sizes: {N: 40, K: 64}, batch: [4]}
  - {op: dense_gemm, implementation: triton.gemm, sizes: {N: 24, K: 96}, batch: [4]}
"""
    )
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["sweep", str(sweep), "--table", str(tmp_path / "t.json"), "--trials", "2"]
    assert main([*args, "--storage", storage, "--no-progress", "--device", "cpu"]) == 0
    names = sorted(optuna.get_all_study_names(storage))
    assert names == [
        "shapes/dense_gemm/triton.gemm/float32/K=64,N=40/4",
        "shapes/dense_gemm/triton.gemm/float32/K=96,N=24/4",
    ]
    for n in names:
        assert len(optuna.load_study(study_name=n, storage=storage).trials) == 2
    entries = json.loads((tmp_path / "t.json").read_text())["entries"]
    assert sorted(e["shape"] for e in entries) == ["K=64,N=40", "K=96,N=24"]


def test_fastest_tuned_implementation_serves(tmp_path, monkeypatch):
    """With entries for two conforming implementations, dispatch takes the faster one, even
    over a higher priority; without entries, priority decides."""
    import dataclasses

    from opcontract.backends import registry

    impl = registry.implementation("triton.fused")
    twin = dataclasses.replace(impl, name="triton.twin", priority={"cpu": -1, "cuda": -1})
    monkeypatch.setitem(registry._REGISTRY, "triton.twin", twin)
    h, w, t = head_inputs(T=6)
    assert dispatch.explain("softcap_logprob", h, w, t, backend="triton").implementation == (
        "triton.fused"
    )
    table = tmp_path / "two.json"
    write_entry(table, _entry(median_ms=2.0))
    write_entry(table, _entry(implementation="triton.twin", median_ms=1.5, config={"group_t": 1}))
    monkeypatch.setenv("OPCONTRACT_TUNING_PATH", str(table))
    r = dispatch.explain("softcap_logprob", h, w, t, backend="triton")
    assert r.implementation == "triton.twin" and r.config["group_t"] == 1
    assert "triton.twin" in r.tuning_entry
    write_entry(table, _entry(median_ms=1.0))
    from opcontract.tables import db

    db.reload()  # read the table again
    assert dispatch.explain("softcap_logprob", h, w, t, backend="triton").implementation == (
        "triton.fused"
    )


def test_entries_of_one_objective_are_compared(tmp_path, monkeypatch):
    """A forward time beside a forward+backward time says nothing: where any implementation
    is timed for training, the training times decide, however short a forward-only time is
    (the shipped triton.fused_ce entries time the forward, the CuTe heads' the training step);
    entries without an objective are forward times."""
    import dataclasses

    from opcontract.backends import registry
    from opcontract.tables import db

    impl = registry.implementation("triton.fused")
    twin = dataclasses.replace(impl, name="triton.twin", priority={"cpu": -1, "cuda": -1})
    monkeypatch.setitem(registry._REGISTRY, "triton.twin", twin)
    h, w, t = head_inputs(T=6)
    table = tmp_path / "mixed.json"
    legacy = _entry(median_ms=1.0)
    del legacy["objective"]  # a table written before entries named their objective
    write_entry(table, legacy)
    write_entry(table, _entry(implementation="triton.twin", median_ms=3.0, objective="train",
                              config={"group_t": 1}))  # fmt: skip
    monkeypatch.setenv("OPCONTRACT_TUNING_PATH", str(table))
    db.reload()
    r = dispatch.explain("softcap_logprob", h, w, t, backend="triton")
    assert r.implementation == "triton.twin" and r.config["group_t"] == 1
    write_entry(table, _entry(median_ms=2.0, objective="train"))
    db.reload()  # both timed for training now: the faster one serves
    assert dispatch.explain("softcap_logprob", h, w, t, backend="triton").implementation == (
        "triton.fused"
    )


def _gemm_sweep(path, name, impls=("triton.gemm",), block_n="[32, 64]"):
    """A one-call dense_gemm sweep file (float32, M = 4) over a narrowed space."""
    item = """  - op: dense_gemm
    implementation: {impl}
    sizes: {{N: 40, K: 64}}
    batch: [4]
    space: {{block_m: [16], block_n: {block_n}, group_m: [1], num_warps: [4], num_stages: [2],
            parallel_partials: [false]}}
"""
    items = "".join(item.format(impl=i, block_n=block_n) for i in impls)
    path.write_text(f"name: {name}\ndtypes: [float32]\nops:\n{items}")
    return path


def test_a_sweep_item_narrows_the_space(tmp_path, capsys):
    import optuna

    from opcontract.cli.tune import main

    sweep = _gemm_sweep(tmp_path / "narrow.yaml", "narrow")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "5", "--storage", storage]
    assert main([*args, "--no-progress", "--device", "cpu"]) == 0
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert sorted(t.params["block_n"] for t in trials) == [32, 64]  # a grid of two
    assert all(t.params["block_m"] == 16 for t in trials)
    assert main([*args, "--no-progress", "--device", "cpu"]) == 0  # resumed: grid finished
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 2
    (entry,) = json.loads(table.read_text())["entries"]
    assert entry["median_ms"] > 0  # the faster of the narrowed best and the default


@pytest.mark.parametrize(
    "space,needle",
    [
        ("{tile: [1]}", "has no parameter 'tile'"),
        ("{block_m: [48]}", "[48] not among the declared"),
        ("{block_m: []}", "no values"),
    ],
)
def test_bad_narrowed_space_exits_1(tmp_path, capsys, space, needle):
    from opcontract.cli.tune import main

    sweep = tmp_path / "bad.yaml"
    sweep.write_text(
        "name: bad\ndtypes: [float32]\nops:\n"
        "  - {op: dense_gemm, implementation: triton.gemm, sizes: {N: 40, K: 64}, batch: [4],"
        f" space: {space}}}\n"
    )
    assert main(["sweep", str(sweep), "--table", str(tmp_path / "t.json"), "--no-progress"]) == 1
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_precompile_launches_every_candidate_then_the_sweep_runs(tmp_path, capsys):
    from opcontract.cli.tune import main
    from opcontract.tuning.precompile import Job, _launch
    from opcontract.tuning.space import candidates

    impl = implementation("triton.gemm")
    space = {
        "block_m": [16],
        "block_n": [32, 64],
        "group_m": [1],
        "num_warps": [4],
        "num_stages": [2],
        "parallel_partials": [False],
    }
    assert [c["block_n"] for c in candidates(impl, {}, space)] == [32, 64]
    job = Job(
        "dense_gemm",
        "triton.gemm",
        "float32",
        (("K", 64), ("M", 4), ("N", 40)),
        (),
        (("block_n", 32),),
        "cpu",
    )
    assert _launch(job) is None
    bad = Job(**{**job.__dict__, "config": (("block_n", 48),)})  # not a power of two
    assert "triton.gemm {'block_n': 48}" in _launch(bad)

    sweep = _gemm_sweep(tmp_path / "pre.yaml", "pre")
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "2", "--compile-workers", "2"]
    assert main([*args, "--no-progress", "--device", "cpu"]) == 0
    assert "precompile:" not in capsys.readouterr().out  # every candidate launched
    (entry,) = json.loads(table.read_text())["entries"]  # the narrowed best or the default
    assert entry["config"]["block_n"] in (32, 64) and entry["median_ms"] > 0


def test_an_implementation_this_machine_lacks_is_skipped(tmp_path, capsys, monkeypatch):
    from opcontract.backends import registry
    from opcontract.cli.tune import main

    impl = implementation("triton.gemm")
    lost = dataclasses.replace(impl, available=lambda: "Triton lost for this test")
    monkeypatch.setitem(registry._REGISTRY, impl.name, lost)
    sweep = _gemm_sweep(tmp_path / "s.yaml", "lacks")
    table = tmp_path / "t.json"
    assert main(["sweep", str(sweep), "--table", str(table), "--no-progress"]) == 0
    assert "skipping triton.gemm: Triton lost for this test" in capsys.readouterr().out
    assert not table.exists()


@pytest.mark.parametrize("equal", [True, False])
def test_only_implementations_with_equal_bits_share_a_calls_table(
    tmp_path, capsys, monkeypatch, equal
):
    """Dispatch serves each bucket with the fastest tabled implementation; the sweep gives an
    entry only to implementations bitwise equal to the call's first one."""
    from opcontract.backends import registry
    from opcontract.cli.tune import main

    gemm = implementation("triton.gemm")

    def forward(config, **kw):
        (y,) = gemm.forward(config, **kw)
        return (y if equal else y * (1 + 2**-7),)  # another rounding: other bits

    monkeypatch.setitem(
        registry._REGISTRY,
        "triton.twin",
        dataclasses.replace(gemm, name="triton.twin", forward=forward),
    )
    sweep = _gemm_sweep(tmp_path / "two.yaml", "two", ("triton.gemm", "triton.twin"), "[32]")
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "1", "--no-progress"]
    assert main([*args, "--device", "cpu"]) == 0
    tabled = {e["implementation"] for e in json.loads(table.read_text())["entries"]}
    if equal:
        assert tabled == {"triton.gemm", "triton.twin"}
        assert main(["verify", "--table", str(table), "--device", "cpu"]) == 0
    else:
        assert tabled == {"triton.gemm"}
        assert "bits differ from triton.gemm's: no entry" in capsys.readouterr().out
        (entry,) = json.loads(table.read_text())["entries"]  # a table written elsewhere
        write_entry(table, {**entry, "implementation": "triton.twin"})
        assert main(["verify", "--table", str(table), "--device", "cpu"]) == 1
        assert "tabled for the same call" in capsys.readouterr().out


def test_train_objective_times_forward_and_backward(tmp_path):
    from opcontract.cli.tune import main
    from opcontract.tuning.sweep import workload
    from opcontract.tuning.verify import prepare

    impl = implementation("triton.gemm")
    c = get_contract("dense_gemm")
    probe = prepare(impl, c, "float32", {"M": 4, "N": 40, "K": 64})
    grads = workload(probe, "train")(probe.canonical)()
    assert [tuple(g.shape) for g in grads] == [(4, 64), (40, 64), (40,)]  # x, weight, bias
    assert all(g.abs().sum() > 0 for g in grads)
    assert workload(probe, "forward")(probe.canonical)().shape == (4, 40)

    sweep = _gemm_sweep(tmp_path / "train.yaml", "train")
    text = sweep.read_text().replace("    batch: [4]\n", "    batch: [4]\n    objective: train\n")
    sweep.write_text(text)
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "2", "--no-progress"]
    assert main([*args, "--device", "cpu"]) == 0
    (entry,) = json.loads(table.read_text())["entries"]
    assert entry["median_ms"] > 0


@pytest.mark.parametrize(
    "bounds, tuned",
    [
        (["--max-batch", "4"], ["2", "4"]),
        (["--min-batch", "4"], ["4", "8"]),
        (["--min-batch", "4", "--max-batch", "4"], ["4"]),
    ],
)
def test_batch_bounds_tune_only_the_buckets_between_them(tmp_path, bounds, tuned):
    import optuna

    from opcontract.cli.tune import main

    sweep = tmp_path / "batches.yaml"
    sweep.write_text(
        """name: batches
dtypes: [float32]
ops:
  - {op: dense_gemm, implementation: triton.gemm, sizes: {N: 40, K: 64}, batch: [2, 4, 8]}
"""
    )
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["sweep", str(sweep), "--table", str(tmp_path / "t.json"), "--trials", "1"]
    assert main([*args, "--storage", storage, "--no-progress", *bounds]) == 0
    names = sorted(optuna.get_all_study_names(storage))
    assert [n.rsplit("/", 1)[1] for n in names] == tuned


def test_graph_timing_is_a_sweep_option_and_eager_off_cuda(tmp_path):
    from opcontract.cli.tune import main
    from opcontract.tuning.sweep import load_sweep

    sweep = tmp_path / "graph.yaml"
    sweep.write_text(
        """name: graph
dtypes: [float32]
ops:
  - {op: dense_gemm, implementation: triton.gemm, sizes: {N: 40, K: 64}, batch: [2],
     timing: graph}
"""
    )
    assert load_sweep(sweep).ops[0].timing == "graph"
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "1", "--device", "cpu"]
    assert main([*args, "--no-progress"]) == 0
    assert len(json.loads(table.read_text())["entries"]) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(sweep.read_text().replace("timing: graph", "timing: sometimes"))
    assert main(["sweep", str(bad), "--table", str(table), "--no-progress"]) == 1


@pytest.mark.parametrize(
    "config, median, needle",
    [
        ({"block_k": 64}, 1.0, "'block_k' is not a free parameter of triton.fused"),
        ({"block_v": 256}, 1.0, "'block_v' is not a free parameter"),
        ({"promote": 0}, 1.0, "'promote' is not a free parameter"),
        ({"colour": "red"}, 1.0, "'colour' is not a free parameter"),
        ({"num_warps": 3}, 1.0, "num_warps=3 is not among triton.fused's declared values"),
        ({"num_warps": "4"}, 1.0, "num_warps='4' is not among"),
        ({"num_warps": 4.0}, 1.0, "num_warps=4.0 is not among"),
        ({"programs_per_sm": True}, 1.0, "programs_per_sm=True is not among"),
        ({"schedule": "warp_drive"}, 1.0, "schedule='warp_drive' is not among"),
        ({"group_t": 4}, "fast", "median_ms 'fast' is not a finite number"),
        ({"group_t": 4}, float("nan"), "median_ms nan is not a finite number"),
        ({"group_t": 4}, None, "median_ms None is not a finite number"),
        ([["group_t", 4]], 1.0, "is not a mapping"),
    ],
)
def test_an_entry_outside_the_declared_space_is_ignored_with_one_warning(
    tmp_path, monkeypatch, config, median, needle
):
    """Dispatch and `opcontract-tune verify` reject it on one code path (entry_problem)."""
    from opcontract.cli.tune import main
    from opcontract.tables import db as tables

    table = tmp_path / "bad.json"
    write_entry(table, {**_entry(bucket=8), "config": config, "median_ms": median})
    h, w, t = head_inputs(T=6)
    default = dispatch.explain("softcap_logprob", h, w, t, backend="triton").config
    monkeypatch.setenv("OPCONTRACT_TUNING_PATH", str(table))
    tables._warned.clear()
    with pytest.warns(UserWarning) as caught:
        r = dispatch.explain("softcap_logprob", h, w, t, backend="triton")
        dispatch.explain("softcap_logprob", h, w, t, backend="triton")  # warned once
    msgs = [str(x.message) for x in caught if "tuning entry" in str(x.message)]
    assert len(msgs) == 1 and needle in msgs[0] and str(table) in msgs[0]
    assert r.tuning_entry is None and r.config == default
    monkeypatch.delenv("OPCONTRACT_TUNING_PATH")
    assert main(["verify", "--table", str(table), "--device", "cpu", "--no-progress"]) == 1


def test_a_forced_config_outside_the_declared_space_is_an_error():
    h, w, t = head_inputs(T=6)
    with pytest.raises(ValueError, match="'block_v' is not a free parameter"):
        dispatch.op("softcap_logprob", backend="triton", config={"block_v": 64})(h, w, t)


def test_a_sweep_whose_triton_studies_need_a_gpu_exits_1_saying_so(tmp_path, capsys, monkeypatch):
    """Triton on a CPU without the interpreter: every study fails, the sweep says why."""
    from opcontract.cli.tune import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sweep = _gemm_sweep(tmp_path / "s.yaml", "nogpu")
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--no-progress", "--device", "cpu"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "failed, no entry: Triton kernels need a CUDA GPU" in out
    assert "1 of 1 studies failed" in err
    assert "dense_gemm triton.gemm float32 batch 4: Triton kernels need a CUDA GPU" in err
    assert "no GPU: set TRITON_INTERPRET=1 to run Triton on the CPU" in err
    assert not table.exists()


def test_a_failed_study_is_listed_and_exits_1_after_the_others_ran(tmp_path, capsys, monkeypatch):
    from opcontract.backends import registry
    from opcontract.cli.tune import main
    from opcontract.tuning.sweep import load_sweep, run_sweep

    gemm = implementation("triton.gemm")

    def refuse(config, **kw):
        raise RuntimeError("launch refused")

    broken = dataclasses.replace(gemm, name="triton.broken", forward=refuse)
    monkeypatch.setitem(registry._REGISTRY, broken.name, broken)
    sweep = _gemm_sweep(tmp_path / "s.yaml", "broken", ("triton.gemm", "triton.broken"), "[32]")
    table = tmp_path / "t.json"
    args = ["sweep", str(sweep), "--table", str(table), "--trials", "1", "--no-progress"]
    assert main([*args, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "1 of 2 studies failed" in err
    assert "dense_gemm triton.broken float32 batch 4: RuntimeError: launch refused" in err
    assert "TRITON_INTERPRET" not in err  # the interpreter is on: not the reason
    (entry,) = json.loads(table.read_text())["entries"]
    assert entry["implementation"] == "triton.gemm"

    results = run_sweep(load_sweep(sweep), tmp_path / "u.json", trials=1, progress=False)
    assert [(r.implementation, r.error) for r in results] == [
        ("triton.gemm", None),
        ("triton.broken", "RuntimeError: launch refused"),
    ]


@pytest.mark.parametrize(
    "missing,cmd", [("optuna", "sweep"), ("tqdm", "sweep"), ("tqdm", "verify")]
)
def test_a_missing_tune_extra_prints_the_install_line(tmp_path, capsys, monkeypatch, missing, cmd):
    """A plain `pip install opcontract` has no optuna or tqdm: say how to get them."""
    import sys

    from opcontract.cli.tune import main

    monkeypatch.setitem(sys.modules, missing, None)  # `import optuna` now fails
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(TINY_SWEEP)
    table = tmp_path / "t.json"
    args = {
        "sweep": ["sweep", str(sweep), "--table", str(table), "--no-progress"],
        "verify": ["verify", "--table", str(table), "--device", "cpu", "--no-progress"],
    }[cmd]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert err.startswith(
        f'opcontract-tune {cmd} needs the [tune] extra: pip install "opcontract[tune]"'
    )
    assert missing in err and not out
    assert not table.exists()


def test_show_needs_no_extra(tmp_path, monkeypatch, capsys):
    import sys

    from opcontract.cli.tune import main

    for name in ("optuna", "tqdm"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["show", "--table", str(tmp_path / "none.json")]) == 0
    assert "no tuning entries" in capsys.readouterr().out


def test_every_shipped_entry_is_usable_under_the_current_contracts():
    """A contract edit that moves its numerics hash would silently retire the shipped
    tuning: every shipped entry must still pass dispatch's check."""
    from opcontract.tables.db import PACKAGE_TABLES, entry_problem

    entries = TuningDB([PACKAGE_TABLES]).entries
    assert len(entries) >= 74
    for e in entries:
        impl = implementation(e.key["implementation"])
        c = get_contract(e.key["op"])
        assert entry_problem(e, impl, c.numerics_sha256) is None, e.describe()


def test_attention_entries_key_on_head_geometry_and_layer_kind_and_serve_any_key_store(
    tmp_path, monkeypatch
):
    """gated_attention's table key is (Hq, Hkv, D, layer) and the query-row bucket: one entry
    serves calls against key stores of any size (every cache has its own N, S, NB), and
    only calls of its layer kind (a local layer's tiles see a window a global one doesn't)."""
    from opcontract.backends.torch.gated_attention import conformance_inputs
    from opcontract.tables.db import shape_key

    c = get_contract("gated_attention")
    assert c.conformance.table_key == ["Hq", "Hkv", "D", "layer"]
    sizes = {"T": 8, "Hq": 4, "Hkv": 2, "D": 16, "N": 9, "S": 1, "NB": 1}
    assert shape_key(sizes, "T", c.conformance.table_key, {"layer": "local", "window": 5}) == (
        "D=16,Hkv=2,Hq=4,layer=local"
    )
    table = tmp_path / "attn.json"
    cfg = {"split": 0, "block_m": 64, "num_warps": 4, "num_stages": 2}
    write_entry(table, make_entry(device=CPU, op="gated_attention",
                                  implementation="triton.attention", dtype="float32",
                                  shape="D=16,Hkv=2,Hq=4,layer=global", bucket=32, config=cfg,
                                  numerics_sha256=c.numerics_sha256, median_ms=1.0))  # fmt: skip
    monkeypatch.setenv("OPCONTRACT_TUNING_PATH", str(table))
    case = c.conformance.cases[0]
    for store in ({"N": 700, "S": 3, "NB": 6}, {"N": 300, "S": 2, "NB": 3}):
        inputs, params = conformance_inputs(c, case, "float32", sizes={"T": 24, **store})
        params = {**params, "layer": "global", "window": None}
        r = dispatch.explain("gated_attention", **inputs, **params, backend="triton")
        assert r.tuning_entry and r.tuning_entry.startswith(str(table)), store
        assert {k: r.config[k] for k in cfg} == cfg
        local = {**params, "layer": "local", "window": 64}
        r = dispatch.explain("gated_attention", **inputs, **local, backend="triton")
        assert r.tuning_entry is None, "a local call took the global layers' entry"


def test_shipped_attention_entries_are_keyed_by_layer_kind():
    """The H200 entries were swept per layer kind (the sweep's params): keyed so, the
    training buckets of both kinds present."""
    from opcontract.tables.db import PACKAGE_TABLES

    entries = [e for e in TuningDB([PACKAGE_TABLES]).entries if e.key["op"] == "gated_attention"]
    kinds = {(e.key["shape"].rsplit(",layer=", 1)[1], e.key["bucket"]) for e in entries}
    assert kinds >= {(k, b) for k in ("global", "local") for b in (4096, 16384)}
    assert {k for k, _ in kinds} == {"global", "local"}


def test_a_table_key_symbol_that_is_not_a_shape_symbol_is_a_contract_error():
    from opcontract.contracts.loader import ContractFileError, parse_contract

    path = Path(opcontract.contracts.__file__).parent / "ops" / "gated_attention.yaml"
    text = path.read_text().replace("table_key: [Hq, Hkv, D, layer]", "table_key: [Hq, Q]")
    with pytest.raises(ContractFileError, match="'Q' is not a shape symbol"):
        parse_contract(text)
    text = path.read_text().replace("table_key: [Hq, Hkv, D, layer]", "table_key: [Hq, scale]")
    with pytest.raises(ContractFileError, match="'scale' is not a shape symbol.*nor a str"):
        parse_contract(text)
