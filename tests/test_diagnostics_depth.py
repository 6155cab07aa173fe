"""layer_angles on hidden states with known angles; fit_depth_scaling on synthetic points of a known law."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lamina.diagnostics import fit_depth_scaling, layer_angles


def _rotated(base: torch.Tensor, other: torch.Tensor, degrees: float) -> torch.Tensor:
    """The unit vector at ``degrees`` from ``base`` in the plane of ``base`` and ``other``."""
    u = base / base.norm()
    w = other - (other @ u) * u
    w = w / w.norm()
    t = math.radians(degrees)
    return math.cos(t) * u + math.sin(t) * w


def test_state_angles_are_the_constructed_ones():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, generator=gen, dtype=torch.float64), torch.randn(16, generator=gen, dtype=torch.float64)
    # token 0: parallel (scaled copy), token 1: orthogonal, token 2: 60 degrees, token 3: opposite
    h0 = torch.stack([a, a, a, a])
    h1 = torch.stack([3 * a, _rotated(a, b, 90), _rotated(a, b, 60) * 5, -2 * a])
    out = layer_angles([h0[None], h1[None]])
    assert out.state.shape == (1, 4, 1) and out.update.shape == (1, 4, 0)
    assert out.state.dtype == torch.float32
    torch.testing.assert_close(out.state[0, :, 0], torch.tensor([0.0, 90.0, 60.0, 180.0]), atol=1e-4, rtol=0)


def test_update_angles_and_masked_tokens():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)
    d1, d2 = a, _rotated(a, b, 60) * 0.5  # the second update turns 60 degrees from the first
    h0 = torch.randn(8, generator=gen, dtype=torch.float64)
    states = [h0, h0 + d1, h0 + d1 + d2]
    tokens = [torch.stack([s, s]) for s in states]  # two tokens with the same trajectory
    mask = torch.tensor([[1, 0]])
    out = layer_angles([t[None].float() for t in tokens], mask=mask)
    assert out.update.shape == (1, 2, 1)
    assert abs(out.update[0, 0, 0].item() - 60.0) < 1e-3
    assert math.isnan(out.update[0, 1, 0].item()) and math.isnan(out.state[0, 1, 0].item())
    # summaries over the kept token only
    assert out.update_mean[0].item() == pytest.approx(60.0, abs=1e-3)
    assert out.update_std[0].item() == pytest.approx(0.0, abs=1e-6)
    assert out.state_mean.shape == (2,)


def test_pca_of_trajectories_on_a_line_is_one_direction():
    direction = torch.randn(32, generator=torch.Generator().manual_seed(2))
    states = torch.stack([t * direction.expand(2, 5, 32) for t in (1.0, 2.0, 3.0, 4.0)])  # [L, B, T, D]
    out = layer_angles(states, pca_components=2)
    assert out.pca.shape == (2, 5, 4, 2)
    assert out.pca_explained[0].item() == pytest.approx(1.0, abs=1e-6)
    assert out.pca_explained[1].item() == pytest.approx(0.0, abs=1e-6)
    steps = out.pca[0, 0, 1:, 0] - out.pca[0, 0, :-1, 0]  # equal steps along the one direction
    torch.testing.assert_close(steps.abs(), torch.full((3,), direction.norm().item()), rtol=1e-5, atol=1e-5)


def test_layer_angles_rejects_bad_input():
    h = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match="at least 2 layers"):
        layer_angles([h])
    with pytest.raises(ValueError, match=r"hidden_states\[1\]"):
        layer_angles([h, torch.randn(1, 3, 5)])
    with pytest.raises(ValueError, match="mask"):
        layer_angles([h, h], mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="pca_components"):
        layer_angles([h, h], pca_components=5)
    with pytest.raises(TypeError, match="hidden_states"):
        layer_angles("abc")


TRUE = {"c_m": 20.0, "a_m": 0.35, "c_l": 2.0, "a_l": 1.2, "c_D": 400.0, "a_D": 0.3, "L0": 1.7}


def _law(m, l, D):
    return TRUE["c_m"] * m ** -TRUE["a_m"] + TRUE["c_l"] * l ** -TRUE["a_l"] + TRUE["c_D"] * D ** -TRUE["a_D"] \
        + TRUE["L0"]


def test_fit_depth_scaling_recovers_known_exponents():
    gen = torch.Generator().manual_seed(1)
    points = [(m, l, D, _law(m, l, D) * (1 + 0.002 * torch.randn(1, generator=gen, dtype=torch.float64).item()))
              for m, l, D in itertools.product([256, 512, 1024, 2048], [2, 4, 8, 16, 32, 64], [1e8, 1e9, 1e10])]
    fit = fit_depth_scaling(points, n_bootstrap=30, seed=0)
    assert fit.bootstrap == 30
    for name in ("a_m", "a_l", "a_D"):
        low, high = fit.intervals[name]
        assert low <= TRUE[name] <= high, (name, fit.intervals[name])
        assert fit.params[name] == pytest.approx(TRUE[name], rel=0.05)
    assert fit.intervals["a_l"][1] - fit.intervals["a_l"][0] < 0.2  # informative, not everything
    assert float(fit.predict(512, 8, 1e9)) == pytest.approx(_law(512, 8, 1e9), rel=0.01)
    # exact points: the fit is exact
    exact = fit_depth_scaling({"m": [p[0] for p in points], "l": [p[1] for p in points], "D": [p[2] for p in points],
                               "loss": [_law(*p[:3]) for p in points]}, n_bootstrap=0)
    for name in TRUE:
        assert exact.params[name] == pytest.approx(TRUE[name], rel=1e-3)


def test_fit_depth_scaling_rejects_bad_points():
    with pytest.raises(ValueError, match="at least 7"):
        fit_depth_scaling([(1, 2, 3, 4)] * 3)
    with pytest.raises(ValueError, match="> 0"):
        fit_depth_scaling([(1, 2, 3, -4)] * 8)
    with pytest.raises(ValueError, match="columns"):
        fit_depth_scaling({"m": [1], "l": [1]})
    with pytest.raises(ValueError, match="n_bootstrap"):
        fit_depth_scaling([(1 + i, 2, 3, 4) for i in range(8)], n_bootstrap=-1)
