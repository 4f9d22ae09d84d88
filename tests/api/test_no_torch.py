"""The HTTP layer, settings and CLI import no torch (the engine stays behind the connector)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["servelm.api", "servelm.settings", "servelm.cli"])
def test_import_leaves_torch_out(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
