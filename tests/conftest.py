"""Shared pytest configuration.

Hypothesis profiles: "default" (quick, the CI run) and "slow" (long property runs), chosen by the
HYPOTHESIS_PROFILE environment variable: ``HYPOTHESIS_PROFILE=slow pytest tests/spec``.
"""

import os

from hypothesis import settings

settings.register_profile("default", max_examples=25, deadline=None)
settings.register_profile("slow", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
