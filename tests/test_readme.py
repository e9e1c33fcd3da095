"""The README's first ten minutes: its Python example runs as written on the bundled pair, its
sections come in the promised order, and ``.ci/run`` runs its CPU setup line verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_blocks import README, readme_block

from specengine.arith_task import decode, reward

ROOT = Path(__file__).resolve().parent.parent


def test_python_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    code = readme_block("## Usage\n")
    ns: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, "README.md (Usage example)", "exec"), ns)
    prompts, outs = ns["prompts"], ns["outs"]
    assert any(isinstance(p, str) for p in prompts) and any(isinstance(p, list) for p in prompts)
    for prompt, out in zip(prompts, outs):  # type: ignore[call-overload]
        text = prompt if isinstance(prompt, str) else decode(prompt)
        assert out.finish_reason == "stop"
        assert reward(text, out.text) == 1.0, (text, out.text)  # the bundled model's task
    assert ns["engine"].stats.mean_accepted_length > 1.5  # the EAGLE-3 head drafts
    assert "mean accepted length" in capsys.readouterr().out


def test_sections_in_order() -> None:
    heads = ("## Setup", "## Main job", "## Tests", "## Usage")
    positions = [README.index(f"\n{h}\n") for h in heads]
    assert positions == sorted(positions)
    assert README.index("lossless") < positions[0]  # what it is comes first


def test_ci_runs_the_readme_cpu_setup_line() -> None:
    setup = readme_block("## Setup\n", "bash").splitlines()
    cpu = setup[setup.index(next(line for line in setup if "CPU only" in line)) + 1]
    assert "whl/cpu" in cpu and 'pip install -e ".[test]"' in cpu
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cpu in ci, ".ci/run must run the README's CPU setup line as written"
    assert "pytest" in ci
