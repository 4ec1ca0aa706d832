"""Bit-for-bit properties of the GGUF block kernels (backend/kernels/blocks.py): a row's result never depends on
the other rows of its pass (how many, which tile it falls in), on the thread count, or on which ISA path ran
(scalar, AVX2, AVX-512: the same integer sums and the same float operations per output), and a call repeated
gives the same bits. These are what let a seed replay the same reply whatever the drafter and γ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specchat.backend.kernels import blocks

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F32", "F16", "BF16"]
N = 75  # 9 groups of 8 columns and a partial one (AVX-512 tiles: 4 pairs and a lone group)


@pytest.fixture(scope="module")
def kernels():
    try:
        blocks.load()
    except blocks.KernelsUnavailable as exc:
        pytest.skip(str(exc))
    return blocks


def make(type_name: str, k_blocks: int = 2, n: int = N, seed: int = 0):
    block = max(blocks.LAYOUT[type_name][0], 32)
    k = block * k_blocks
    data = blocks.random_blocks(type_name, n, k, np.random.default_rng(seed))
    x = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((130, k)).astype(np.float32))
    return blocks.qweight(data, type_name, n, k), x


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.uint32)


@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_alone_equals_the_row_among_others(kernels, type_name):
    w, x = make(type_name)
    together = bits(w.matmul(x[:64]))
    for i in (0, 1, 2, 3, 5, 30, 63):
        np.testing.assert_array_equal(bits(w.matmul(x[i : i + 1]))[0], together[i])
    for m in (2, 3, 4, 5, 6, 7, 9, 13, 31):  # every tile remainder, rows shifted so they land in other tile slots
        for start in (0, 1, 3, 64 - m):
            np.testing.assert_array_equal(bits(w.matmul(x[start : start + m])), together[start : start + m])


def test_rows_past_one_chunk_of_64(kernels):
    w, x = make("Q4_K", k_blocks=1)
    together = bits(w.matmul(x))  # 130 rows: three row chunks
    for i in (0, 63, 64, 65, 128, 129):
        np.testing.assert_array_equal(bits(w.matmul(x[i : i + 1]))[0], together[i])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q6_K", "Q8_0", "F16"])
def test_thread_count_does_not_change_a_bit(kernels, type_name):
    w, x = make(type_name, n=200)
    before = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[threads] = [bits(w.matmul(x[:m])) for m in (1, 5, 64)]
    finally:
        torch.set_num_threads(before)
    for one, two in zip(results[1], results[2]):
        np.testing.assert_array_equal(one, two)


def available_paths(kernels) -> list[str]:
    paths = []
    for name in ("scalar", "avx2", "avx512"):
        got = kernels.set_isa(name)
        if got.startswith(name):
            paths.append(name)
    return paths


@pytest.fixture
def restore_isa(kernels):
    # The mode before the test: the CPU's own choice (a narrow call then takes another path than kernel_isa names)
    # or a pinned path, e.g. from SPECCHAT_KERNELS, which the rest of the run must keep.
    named, narrow = kernels.kernel_isa(), kernels.isa_for_rows(1)
    yield
    kernels.set_isa("auto" if narrow != named else named.removesuffix("-vnni"))


@pytest.mark.parametrize("type_name", TYPES)
def test_every_path_gives_the_same_bits(kernels, restore_isa, type_name):
    paths = available_paths(kernels)
    if len(paths) < 2:
        pytest.skip(f"this CPU has only the {paths[0]} path")
    w, x = make(type_name, n=N)
    results = {}
    for name in paths:
        kernels.set_isa(name)
        first = bits(w.matmul(x[:7]))
        np.testing.assert_array_equal(first, bits(w.matmul(x[:7])))  # each path is deterministic
        results[name] = (first, bits(w.matmul(x[:1])))
    for name in paths[1:]:
        np.testing.assert_array_equal(results[name][0], results[paths[0]][0], err_msg=f"{name} vs {paths[0]}")
        np.testing.assert_array_equal(results[name][1], results[paths[0]][1], err_msg=f"{name} vs {paths[0]}")


def test_narrow_calls_take_avx2_only_where_the_cpu_chose_avx512(kernels, restore_isa):
    best = kernels.set_isa("auto")
    narrow = "avx2" if best.startswith("avx512") else best
    assert [kernels.isa_for_rows(m) for m in (1, 2, 4, 5, 16)] == [narrow, narrow, narrow, best, best]
    for name in available_paths(kernels):  # a path asked for runs every call, one row included
        got = kernels.set_isa(name)
        assert [kernels.isa_for_rows(m) for m in (1, 2, 4, 5, 16)] == [got] * 5
    assert kernels.set_isa("auto") == best and kernels.isa_for_rows(1) == narrow


@pytest.mark.parametrize("type_name", TYPES)
def test_the_cpus_own_choice_mixes_paths_without_changing_a_bit(kernels, restore_isa, type_name):
    kernels.set_isa("auto")  # on an AVX-512 CPU: up to four rows on AVX2, more on AVX-512
    w, x = make(type_name)
    together = bits(w.matmul(x[:16]))
    for i in (0, 5, 15):
        np.testing.assert_array_equal(bits(w.matmul(x[i : i + 1]))[0], together[i])
    np.testing.assert_array_equal(bits(w.matmul(x[6:8])), together[6:8])
    np.testing.assert_array_equal(bits(w.matmul(x[9:13])), together[9:13])


def test_an_unknown_path_is_refused(kernels):
    with pytest.raises(ValueError, match="not one of auto, scalar, avx2, avx512"):
        kernels.set_isa("sse9")


def in_a_process_with(kernels_env: str, expression: str) -> list[str]:
    """``expression`` over ``blocks``, printed by a fresh Python with SPECCHAT_KERNELS=``kernels_env``, split."""
    import os
    import subprocess
    import sys

    code = f"from specchat.backend.kernels import blocks; print({expression})"
    env = {**os.environ, "SPECCHAT_KERNELS": kernels_env}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_environment_lowers_the_path(kernels, tmp_path):
    assert in_a_process_with("scalar", "blocks.kernel_isa()") == ["scalar"]


def test_a_path_named_in_the_environment_runs_every_call(kernels):
    named, one_row = in_a_process_with("avx512", "blocks.kernel_isa(), blocks.isa_for_rows(1)")
    assert one_row == named  # avx512 where the CPU has it (clamped to avx2 elsewhere), one row too
