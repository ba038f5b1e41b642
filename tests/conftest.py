"""Test-wide settings: a deterministic hypothesis profile so CI runs are reproducible."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "hla",
    deadline=None,                 # float64 loops on a shared 2-core machine: no per-example deadline
    derandomize=True,              # the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("hla")
