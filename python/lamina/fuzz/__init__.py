"""``lamina fuzz``: random shapes, dtypes and options of every op and layer against float64 references.

Python API: ``run(...) -> FuzzReport`` (``lamina.fuzz.runner``), ``run_case(case)`` for one case,
``draw_case(op, seed, index)`` (``lamina.fuzz.space``), ``shrink_case`` / ``save_failure`` /
``load_case`` (``lamina.fuzz.shrink``). Command line: ``main(argv, log=print)``
(``lamina.fuzz.cli``). Tolerances come from ``lamina.testing`` (the table the tests use).
"""

from __future__ import annotations

from lamina.fuzz.cli import main
from lamina.fuzz.runner import Failure, FuzzReport, OpStats, run, run_case
from lamina.fuzz.shrink import failure_kind, load_case, save_failure, shrink_case
from lamina.fuzz.space import GROUPS, OPS, Limits, draw_case, draw_from

__all__ = ["GROUPS", "OPS", "Failure", "FuzzReport", "Limits", "OpStats", "draw_case", "draw_from",
           "failure_kind", "load_case", "main", "run", "run_case", "save_failure", "shrink_case"]
