"""glibc's malloc keeps freed activation memory for the next step."""

from __future__ import annotations

import platform

from servelm.engine.malloc import keep_freed_memory


def test_thresholds_are_set_under_glibc_and_skipped_elsewhere():
    # mallopt returns 1 for each accepted setting; other C libraries have no mallopt to call.
    assert keep_freed_memory() is (platform.libc_ver()[0] == "glibc")
