"""kernels.reference must import where Triton (an optional dependency) is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import kernels.reference
import kernels
assert "kernels.decode_attention" not in sys.modules
try:
    kernels.paged_decode_attention
except ImportError:
    print("ok")
"""


def test_reference_imports_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON], cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
