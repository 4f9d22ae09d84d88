"""Building, caching and guarding the native CPU decode-attention kernel.

Its numerics are covered in test_attention.py (every case runs on both paths)
and by the model tests, whose CPU decode steps go through it.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from servelm import kernels

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache directory and no memoised kernel; the memo is cleared again afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    kernels.decode_attention_kernel.cache_clear()
    yield tmp_path / "servelm" / "kernels"
    kernels.decode_attention_kernel.cache_clear()


@needs_compiler
def test_built_once_then_reused_from_the_cache(fresh):
    assert kernels.decode_attention_kernel() is not None
    (built,) = fresh.glob("paged_attention-*.so")
    stamp = built.stat().st_mtime_ns
    kernels.decode_attention_kernel.cache_clear()
    assert kernels.decode_attention_kernel() is not None
    assert [p.name for p in fresh.iterdir()] == [built.name]  # no second build, no leftovers
    assert built.stat().st_mtime_ns == stamp


def test_no_compiler_means_the_pytorch_path(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "servelm-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="servelm.kernels"):
        assert kernels.decode_attention_kernel() is None
    assert "no C compiler" in caplog.text


def test_failed_build_means_the_pytorch_path(fresh, monkeypatch, tmp_path, caplog):
    fake = tmp_path / "brokencc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo brokencc 1.0; exit 0; fi\necho "boom" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with caplog.at_level(logging.WARNING, logger="servelm.kernels"):
        assert kernels.decode_attention_kernel() is None
    assert "boom" in caplog.text
    assert not list(fresh.glob("*.so"))


class _WrongKernel(kernels.DecodeAttention):
    """Loads the real library but returns zeros, as a miscompiled build might."""

    def __call__(self, query, *args):
        return torch.zeros_like(query)


@needs_compiler
def test_self_check_rejects_wrong_results(fresh):
    import ctypes

    lib = ctypes.CDLL(str(kernels._build("cc")))
    kernels._self_check(kernels.DecodeAttention(lib))  # the real one passes
    with pytest.raises(RuntimeError, match="differs"):
        kernels._self_check(_WrongKernel(lib))


@needs_compiler
def test_rejects_inputs_it_cannot_read():
    kernel = kernels.decode_attention_kernel()
    cache = torch.zeros(2, 4, 4, 2, 8)
    query = torch.zeros(1, 4, 8)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([5])
    assert kernel.supports(query, cache)
    assert not kernel.supports(query.half(), cache.half())
    assert not kernel.supports(query.bfloat16(), cache)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(query, cache.transpose(3, 4).contiguous().transpose(3, 4), tables, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernel(query, cache, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        kernel(torch.zeros(1, 3, 8), cache, tables, lens, 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="shapes"):
        kernel(query, cache, tables, torch.tensor([5, 5]), 1.0)
