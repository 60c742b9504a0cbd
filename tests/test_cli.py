"""What every command-line tool shares: --version, and a quiet exit on a closed stdout."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import opcontract
from opcontract.cli import docs, lint, tune

BIN = Path(sys.executable).parent
TOOLS = {"contract-lint": lint.main, "opcontract-docs": docs.main, "opcontract-tune": tune.main}


def _tool(name: str) -> list[str]:
    """The installed console script, or the module run by this interpreter."""
    script = BIN / name
    if script.exists():
        return [str(script)]
    module = {"contract-lint": "lint", "opcontract-docs": "docs", "opcontract-tune": "tune"}
    return [sys.executable, "-m", f"opcontract.cli.{module[name]}"]


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_version(name, capsys):
    with pytest.raises(SystemExit) as e:
        TOOLS[name](["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"opcontract {opcontract.__version__}\n"


def _into_closed_reader(cmd: list[str], reader: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its stdout piped into a Python process running ``reader``, which
    exits early; the tool's exit code and stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    read = subprocess.Popen([sys.executable, "-c", reader], stdin=subprocess.PIPE)
    tool = subprocess.Popen(cmd, stdout=read.stdin, stderr=subprocess.PIPE, env=env)
    read.stdin.close()  # the reader's exit is then the pipe's last reader gone
    _, err = tool.communicate(timeout=300)
    read.wait(timeout=60)
    return subprocess.CompletedProcess(cmd, tool.returncode, None, err.decode())


@pytest.mark.parametrize(
    "args",
    [
        ["opcontract-tune", "show"],  # more than a pipe's first write: fails after line 1
        ["contract-lint", "--json"],
    ],
)
def test_a_reader_that_stops_after_one_line_ends_the_tool_quietly(args):
    r = _into_closed_reader([*_tool(args[0]), *args[1:]], "import sys; sys.stdin.readline()")
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode in (0, 141), r.stderr


@pytest.mark.parametrize(
    "args,code",
    [
        (["contract-lint"], 141),  # 128 + SIGPIPE, as a shell reports a closed pipe
        (["contract-lint", "--json"], 141),
        (["opcontract-tune", "show"], 141),
        (["opcontract-tune", "--help"], 0),  # argparse's own exit
        (["opcontract-docs", "--version"], 0),
    ],
)
def test_a_reader_gone_before_any_output_ends_the_tool_quietly(args, code):
    r = _into_closed_reader([*_tool(args[0]), *args[1:]], "pass")
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == code, r.stderr


def test_another_broken_pipe_is_not_swallowed(monkeypatch):
    """Only stdout's reader going away is quiet: a BrokenPipeError from elsewhere (a worker
    process's pipe) is a failure, raised as it was."""
    from opcontract.cli import entry_point

    @entry_point("t")
    def main(argv=None):
        raise BrokenPipeError("a worker's pipe")

    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        main([])


def test_the_package_carries_its_license():
    from importlib.metadata import metadata

    text = (Path(__file__).parent.parent / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    meta = metadata("opcontract")
    assert meta["License-Expression"] == "Apache-2.0"  # SPDX (PEP 639), not free text
    assert "LICENSE" in meta.get_all("License-File")
