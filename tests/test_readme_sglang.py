"""The README's SGLang-style weight update runs as written against ``specengine serve`` (its
URL and rendezvous port pointed at free ones): the learner's update lands (version 1) and
the served greedy tokens equal a fresh engine's on the weights it sent."""

from __future__ import annotations

import signal

import torch.distributed as dist
from net_helpers import free_port
from readme_blocks import readme_block
from server_helpers import bundled_engine
from sglang_helpers import WAIT_S, serve_process

from specengine import SamplingParams

HEADING = "### Use it from your RL framework: SGLang's native API"


def test_readme_sglang_learner_runs_as_written() -> None:
    code = readme_block(HEADING)
    assert "specengine serve --port 30000" in readme_block(HEADING, "bash")
    with serve_process() as (proc, port, log):
        code = code.replace('"http://127.0.0.1:30000"', f'"http://127.0.0.1:{port}"')
        code = code.replace("29600", str(free_port()))
        ns: dict[str, object] = {"__name__": "readme_example"}
        try:
            exec(compile(code, f"README.md ({HEADING})", "exec"), ns)
        finally:
            if "group" in ns:
                dist.destroy_process_group(ns["group"])  # type: ignore[arg-type]
        out = ns["out"]
        assert out["meta_info"]["weight_version"] == 1  # type: ignore[index]
        eng = bundled_engine()
        eng.load_weights(dict(ns["named"]))  # type: ignore[arg-type]
        want = eng.generate([[17, 16, 5, 10]], k=3,
                            sampling=SamplingParams(temperature=0.0, max_tokens=8))[0]
        assert out["output_ids"] == list(want.token_ids)  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, "".join(log)
