"""Fixtures of the kernel tests: every test here runs with one torch thread (tiny tensors: two intra-op threads
only wait on each other's barrier on a busy machine)."""

import pytest
from native_libraries import compile_fake
from tiny_models import one_thread  # noqa: F401  (an autouse fixture)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Stand-ins for the native library's cache tests: (good library, foreign library, file their constructors
    append their names to)."""
    folder = tmp_path_factory.mktemp("fake-libraries")
    marks = folder / "loaded.txt"
    return compile_fake(folder, "good", marks), compile_fake(folder, "foreign", marks), marks
