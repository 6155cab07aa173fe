"""Fit of the depth-scaling law ``L = c_m m^-a_m + c_l l^-a_l + c_D D^-a_D + L0``.

``m`` is the model width (or parameters per layer), ``l`` the depth, ``D`` the training tokens and
``L`` the loss; "Inverse Depth Scaling From Most Layers Being Similar" finds ``a_l = 1.2 +/- 0.3``.

The fit minimises the squared relative residuals ``sum ((prediction - L) / L)^2`` by variable
projection: for given exponents the law is linear in ``(c_m, c_l, c_D, L0)``, solved exactly by
weighted least squares, so only the three exponents are searched: a grid over ``EXPONENT_RANGE``,
then finer grids around the best point. Confidence intervals come from a bootstrap: the fit repeated
on points resampled with replacement, and the percentile interval of each parameter taken.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

PARAMS = ("c_m", "a_m", "c_l", "a_l", "c_D", "a_D", "L0")
# Exponents searched, the points per axis of the first grid, and the refinement rounds (each a 5^3
# grid spanning +/- the previous spacing around the best point, the spacing halved every round).
EXPONENT_RANGE = (0.02, 3.0)
GRID_POINTS = 12
REFINE_ROUNDS = 24


@dataclass
class DepthScalingFit:
    """``params``: the fitted values (PARAMS); ``intervals``: ``(low, high)`` per parameter at
    ``confidence``; ``bootstrap``: the number of resampled fits; ``samples``: their parameters."""

    params: dict[str, float]
    intervals: dict[str, tuple[float, float]]
    confidence: float
    bootstrap: int
    samples: torch.Tensor = field(repr=False)

    def predict(self, m: float | torch.Tensor, l: float | torch.Tensor, D: float | torch.Tensor) -> torch.Tensor:
        p = self.params
        m, l, D = (torch.as_tensor(x, dtype=torch.float64) for x in (m, l, D))
        return p["c_m"] * m ** -p["a_m"] + p["c_l"] * l ** -p["a_l"] + p["c_D"] * D ** -p["a_D"] + p["L0"]


def _as_columns(points: object) -> torch.Tensor:
    """[N, 4] float64 columns m, l, D, loss from a mapping of columns or a sequence of 4-tuples/mappings."""
    names = ("m", "l", "D", "loss")
    if isinstance(points, Mapping):
        missing = [n for n in names if n not in points]
        if missing:
            raise ValueError(f"points must have the columns {names}, missing {missing}")
        cols = [torch.as_tensor(points[n], dtype=torch.float64).flatten() for n in names]
        if len({c.numel() for c in cols}) != 1:
            raise ValueError(f"points: the columns {names} must have equal lengths, got {[c.numel() for c in cols]}")
        data = torch.stack(cols, dim=1)
    elif isinstance(points, Sequence) and not isinstance(points, (str, bytes)):
        rows = [[row[n] for n in names] if isinstance(row, Mapping) else list(row) for row in points]
        if any(len(r) != 4 for r in rows):
            raise ValueError("points must be (m, l, D, loss) tuples or mappings with those keys")
        data = torch.tensor(rows, dtype=torch.float64).reshape(-1, 4)
    else:
        raise TypeError(f"points must be a sequence of (m, l, D, loss) or a mapping of columns, "
                        f"got {type(points).__name__}")
    if not bool(torch.isfinite(data).all()) or bool((data <= 0).any()):
        raise ValueError("points: m, l, D and loss must be finite and > 0")
    if data.shape[0] < len(PARAMS):
        raise ValueError(f"points: at least {len(PARAMS)} points are needed for {len(PARAMS)} parameters, "
                         f"got {data.shape[0]}")
    return data


def _solve(exponents: torch.Tensor, logs: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best coefficients and squared relative residual for each row of ``exponents [C, 3]``
    (``logs [N, 3]``: log m, log l, log D; ``loss [N]``)."""
    x = torch.exp(-exponents[:, None, :] * logs) / loss[:, None]  # [C, N, 3], rows divided by L
    design = torch.cat([x, (1 / loss)[None, :, None].expand(x.shape[0], -1, 1)], dim=-1)
    gram = design.transpose(1, 2) @ design
    rhs = design.sum(1)  # design^T 1 (the target is L / L = 1)
    ridge = 1e-12 * gram.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(4, dtype=torch.float64)
    coef = torch.linalg.solve(gram + ridge, rhs)  # [C, 4]
    residual = ((design @ coef[..., None]).squeeze(-1) - 1).pow(2).sum(-1)
    return coef, residual.nan_to_num(math.inf)


def _fit(data: torch.Tensor) -> torch.Tensor:
    """(c_m, a_m, c_l, a_l, c_D, a_D, L0) minimising the squared relative residuals."""
    lo, hi = EXPONENT_RANGE
    axis = torch.linspace(lo, hi, GRID_POINTS, dtype=torch.float64)
    grid = torch.cartesian_prod(axis, axis, axis)
    step = (hi - lo) / (GRID_POINTS - 1)
    offsets = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    local = torch.cartesian_prod(offsets, offsets, offsets)
    logs, loss = data[:, :3].log(), data[:, 3]
    for _ in range(REFINE_ROUNDS + 1):
        coef, residual = _solve(grid, logs, loss)
        best = int(residual.argmin())
        centre, best_coef = grid[best], coef[best]
        grid = (centre + step * local).clamp(lo, hi)
        step /= 2
    a, c = centre, best_coef
    return torch.stack([c[0], a[0], c[1], a[1], c[2], a[2], c[3]])


def fit_depth_scaling(
    points: Sequence[object] | Mapping[str, object],
    n_bootstrap: int = 200,
    confidence: float = 0.95,
    seed: int = 0,
) -> DepthScalingFit:
    """Fit ``L = c_m m^-a_m + c_l l^-a_l + c_D D^-a_D + L0`` to measured points.

    Args:
        points: ``(m, l, D, loss)`` tuples (or mappings with those keys), or a mapping of columns
            ``{"m": ..., "l": ..., "D": ..., "loss": ...}``; at least 7 points, all values > 0.
        n_bootstrap: resampled fits for the confidence intervals (0: none; intervals are NaN).
        confidence: central probability of each interval, in (0, 1).
        seed: the bootstrap's random seed.

    Returns:
        ``DepthScalingFit`` with ``params`` (c_m, a_m, c_l, a_l, c_D, a_D, L0), ``intervals`` and
        ``predict(m, l, D)``.
    """
    data = _as_columns(points)
    if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, int) or n_bootstrap < 0:
        raise ValueError(f"n_bootstrap must be an int >= 0, got {n_bootstrap!r}")
    if not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    fitted = _fit(data)
    gen = torch.Generator().manual_seed(seed)
    samples = [_fit(data[torch.randint(0, data.shape[0], (data.shape[0],), generator=gen)])
               for _ in range(n_bootstrap)]
    stacked = torch.stack(samples) if samples else torch.empty(0, len(PARAMS), dtype=torch.float64)
    tail = (1 - confidence) / 2
    if samples:
        low = torch.quantile(stacked, tail, dim=0)
        high = torch.quantile(stacked, 1 - tail, dim=0)
    else:
        low = high = torch.full((len(PARAMS),), math.nan, dtype=torch.float64)
    return DepthScalingFit(
        params={n: float(v) for n, v in zip(PARAMS, fitted)},
        intervals={n: (float(a), float(b)) for n, a, b in zip(PARAMS, low, high)},
        confidence=float(confidence), bootstrap=len(samples), samples=stacked,
    )
