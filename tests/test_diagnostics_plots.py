"""The diagnostics' PNG charts render (matplotlib, Agg backend) and ``lamina diagnose`` writes them."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib", reason="the charts need matplotlib (the [bench] and [test] extras)")

from lamina.cli import main  # noqa: E402
from lamina.diagnostics import layer_angles  # noqa: E402
from lamina.diagnostics.plots import plot_attention_distance, plot_layer_angles, plot_schedule  # noqa: E402
from lamina.schedule import PrismSchedule  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 2000


def test_every_chart_renders_a_png(tmp_path):
    states = [torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    assert _is_png(plot_layer_angles(layer_angles(states), tmp_path / "angles.png"))
    distances = [torch.rand(2, h) * 10 for h in (2, 2, 4, 4)]
    uniform = [torch.rand(2, 4) * 10 for _ in range(4)]
    assert _is_png(plot_attention_distance(distances, tmp_path / "distance.png", uniform=uniform))
    assert _is_png(plot_schedule(PrismSchedule.generate(768, 12, 12), tmp_path / "sub" / "schedule.png"))
    with pytest.raises(ValueError, match="one entry per layer"):
        plot_attention_distance(distances, tmp_path / "x.png", uniform=uniform[:2])


def test_lamina_diagnose_writes_charts_and_summaries(tmp_path, capsys):
    states = torch.randn(4, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    torch.save(states, tmp_path / "states.pt")
    torch.save(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), tmp_path / "mask.pt")
    out = tmp_path / "out"
    assert main(["diagnose", "angles", str(tmp_path / "states.pt"), "--mask", str(tmp_path / "mask.pt"),
                 "--out", str(out)]) == 0
    assert _is_png(out / "layer-angles.png")
    summary = json.loads((out / "layer-angles.json").read_text())
    assert len(summary["state_mean"]) == 3 and len(summary["update_mean"]) == 2
    assert main(["diagnose", "schedule", "--d-model", "768", "--n-layers", "12", "--h-base", "12",
                 "--profile", "fine", "--out", str(out)]) == 0
    assert _is_png(out / "schedule.png")
    assert "head dims: [256, 256, 128, 128, 96, 96, 64" in capsys.readouterr().out
    assert main(["diagnose", "schedule", "--d-model", "768", "--n-layers", "12", "--h-base", "7",
                 "--out", str(out)]) == 2
    assert "divides d_model" in capsys.readouterr().out
