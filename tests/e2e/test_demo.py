"""``tandem demo``, the README's main job (``make run``), as a user runs it: a subprocess that
starts Redis (when installed), a gateway, a prefill and a decode worker on the real model,
streams the answer to a real prompt, reports its start-up phases and stops everything."""

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.smoke]  # the end-to-end cluster of `make test-fast`


def test_the_demo_answers_a_real_prompt_and_reports_its_start_up():
    done = subprocess.run([sys.executable, "-m", "cli", "demo", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "assistant:" in done.stdout and "Paris" in done.stdout, done.stdout
    start_up = re.search(r"start-up: ([\d.]+) s since launch \(model files ([\d.]+) s, processes ready ([\d.]+) s\)",
                         done.stderr)
    first = re.search(r"first token ([\d.]+) s after launch", done.stderr)
    assert start_up and first, done.stderr[-3000:]
    launch_to_ready, files, processes = map(float, start_up.groups())
    assert files + processes <= launch_to_ready <= float(first.group(1))
    assert "stopped" in done.stderr
