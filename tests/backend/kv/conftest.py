"""Fixtures of the paged-cache and attention tests: every test here runs with one torch thread (tiny tensors:
two intra-op threads only wait on each other's barrier on a busy machine)."""

from tiny_models import one_thread  # noqa: F401  (an autouse fixture)
