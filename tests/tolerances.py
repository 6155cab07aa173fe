"""The central tolerance table (STYLE.md rule 7), for tests.

The table, its justification and ``assert_close`` live in ``lamina.testing`` so that
``lamina fuzz`` applies exactly the bounds the tests apply; this module is the name
tests import.
"""

from lamina.testing import (  # noqa: F401
    ATTENTION_FACTOR_GRAD,
    ATTENTION_FACTOR_OUTPUT,
    ATTENTION_FLOOR_ULPS,
    ELEMENTWISE,
    RECURRENCE_MAX_RATIO,
    RECURRENCE_RMS_RATIO,
    UNIT_ROUNDOFF,
    assert_attention_close,
    assert_close,
    reduction_scale,
)
