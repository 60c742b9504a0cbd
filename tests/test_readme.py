"""The README's runnable examples run (the quickstart and the transformers example), and the
docs' static-cache, TRL and PEFT examples: a user's first copy-paste works."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def block_after(path: Path, heading: str) -> str:
    """The first ```python block after ``heading`` in ``path``."""
    text = path.read_text()
    at = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[at:], re.S).group(1)


@pytest.mark.parametrize(
    "path, heading",
    [
        ("README.md", "## Install and a first call"),
        ("README.md", "## Muse Glimmer in transformers and TRL"),
        ("docs/transformers.md", "## Static cache and `torch.compile`"),
        ("docs/transformers.md", "## TRL 1.16"),
        ("docs/transformers.md", "**PEFT LoRA**"),
    ],
)
def test_example_runs(path, heading, capsys):
    if "transformers" in heading or path.endswith("transformers.md"):
        pytest.importorskip("transformers")
    if "PEFT" in heading:
        pytest.importorskip("peft")
    code = block_after(ROOT / path, heading)
    exec(compile(code, f"{path}:{heading}", "exec"), {"__name__": "__example__"})
    out = capsys.readouterr().out
    if "train = rollout" in code:
        assert "True" in out.split()  # the printed torch.equal
