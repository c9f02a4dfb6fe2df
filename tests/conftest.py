"""Shared test configuration: hypothesis profiles.

ATTNGEN_HYPOTHESIS_PROFILE=ci (default): derandomized, no example database, no deadline and
few examples, so the CPU suite is reproducible and bounded. =dev: many more examples.
=gpu: as ci, without the shrink phase (the GPU check's budget has no room for it).
"""

import os

import pytest

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, max_examples=20,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
# The GPU check (bench/gpu_check.sh): no shrinking, since each step is a launch plus an fp64 reference
settings.register_profile(
    "gpu", derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("ATTNGEN_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "expensive: bounded CPU-emulator sweeps (seconds to a minute); deselect with -m 'not expensive'")


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory):
    """One build cache per test session: each kernel is lowered and compiled once, then reused."""
    return tmp_path_factory.mktemp("attngen-build-cache")
