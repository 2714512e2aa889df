"""The one size grammar of ``train --memory-per-rank``, ``compare --memory-caps`` and ``simulate
--gpu-memory`` (lrmoe.sizes): what it takes, what it refuses (one line naming the flag), and
simulate's bare numbers still GiB."""

from __future__ import annotations

import pytest

from lrmoe.sim.cli import _gib
from lrmoe.sim.errors import SimError
from lrmoe.sizes import Relative, SizeError, format_size, parse_bytes, parse_size
from tests.helpers.train import run_main


@pytest.mark.parametrize("text, want", [
    ("70MB", 70_000_000), ("66.8MiB", int(66.8 * 2**20)), ("40GiB", 40 * 2**30), ("3MiB", 3 * 2**20),
    ("1000000", 1_000_000), ("1_000_000", 1_000_000), ("2KB", 2000), ("2kib", 2048), (" 3 MiB ", 3 * 2**20),
    ("1e9", 10**9), ("1.5GiB", 3 * 2**29), ("7B", 7), (123, 123), (2.5e6, 2_500_000)])
def test_sizes_the_grammar_takes(text, want):
    got = parse_size(text, "--memory-per-rank")
    assert got == want and isinstance(got, int)


def test_relative_sizes_only_where_asked():
    assert parse_size("0.65x", "--memory-caps", relative=True) == Relative(0.65)
    assert Relative(0.65).of(1000) == 650
    with pytest.raises(SizeError, match="--memory-per-rank='0.65x' is invalid"):
        parse_size("0.65x", "--memory-per-rank")
    with pytest.raises(SizeError, match="a fraction must be > 0"):
        parse_size("0x", "--memory-caps", relative=True)
    with pytest.raises(SizeError, match="a size must be a finite number"):
        parse_size("1e400x", "--memory-caps", relative=True)


@pytest.mark.parametrize("text, needle", [
    ("40GB?", "expected a size such as"), ("-1GiB", "must be > 0"), ("-5", "must be > 0"), ("0", "must be > 0"),
    ("0MiB", "must be > 0"), ("0.4", "must be > 0"), ("abc", "expected a size"), ("40 GiB B", "expected a size"),
    ("1__000", "expected a size"), ("_1000", "expected a size"), ("70TB", "expected a size"), ("", "expected a size"),
    (True, "expected a size"), ("1e400", "a size must be a finite number"), ("1e400GiB", "finite")])
def test_sizes_the_grammar_refuses(text, needle):
    with pytest.raises(SizeError, match="--memory-per-rank") as e:
        parse_bytes(text, "--memory-per-rank")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_simulate_gpu_memory_bare_numbers_stay_gib():
    assert _gib("gpu-memory", "80") == (80.0,)
    assert _gib("gpu-memory", "80,141") == (80.0, 141.0)
    assert _gib("gpu-memory", "40GiB, 0.5") == (40.0, 0.5)
    assert _gib("gpu-memory", "1073741824B") == (1.0,)
    with pytest.raises(SimError, match="--gpu-memory='40GB\\?' is invalid"):
        _gib("gpu-memory", "40GB?")


@pytest.mark.parametrize("value, needle", [("40GB?", "--gpu-memory='40GB?' is invalid"),
                                           ("-1", "--gpu-memory='-1' is invalid"), ("0", "must be > 0")])
def test_simulate_bad_gpu_memory_is_one_line(tmp_path, value, needle):
    r = run_main("simulate", "--model", "qwen3-30b-a3b", "--gpus", "8", f"--gpu-memory={value}", "--out", tmp_path)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_format_size():
    assert [format_size(n) for n in (512, 2048, 3 * 2**20, 40 * 2**30)] == ["512 B", "2 KiB", "3 MiB", "40 GiB"]
