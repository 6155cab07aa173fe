"""PNG charts of the diagnostics (matplotlib, from the ``[bench]`` extra), and ``lamina diagnose``.

* ``plot_layer_angles(result, path)``: per-layer mean state and update angles (``layer_angles``),
  with a band of one standard deviation.
* ``plot_attention_distance(per_layer, path, uniform=None)``: mean attention distance per layer,
  and with ``uniform`` (a uniform model's) the difference Delta D_l.
* ``plot_schedule(schedule, path)``: head dim per layer of a ``PrismSchedule`` (the staircase).

``lamina diagnose angles STATES.pt [--mask MASK.pt] --out DIR`` reads hidden states saved with
``torch.save`` (a list of ``[B, T, D]`` tensors or one ``[L, B, T, D]`` tensor) and writes
``layer-angles.png`` and ``layer-angles.json``; ``lamina diagnose schedule --d-model ... --n-layers ...
--h-base ... [--profile coarse|fine] --out DIR`` writes ``schedule.png`` and prints the head dims.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lamina.bench.plot import _pyplot
from lamina.diagnostics.angles import LayerAngles, layer_angles
from lamina.schedule import PROFILES, PrismSchedule


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_layer_angles(result: LayerAngles, path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for mean, std, label in ((result.state_mean, result.state_std, "state: h_l vs h_{l+1}"),
                             (result.update_mean, result.update_std, "update: dh_l vs dh_{l+1}")):
        if mean.numel() == 0:
            continue
        x = list(range(mean.numel()))
        ax.plot(x, mean.tolist(), marker="o", label=label)
        ax.fill_between(x, (mean - std).tolist(), (mean + std).tolist(), alpha=0.2)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("layer l")
    ax.set_ylabel("angle (degrees)")
    ax.set_title("angles between consecutive layers (mean over tokens, +/- 1 std)")
    ax.legend()
    return _save(fig, plt, path)


def plot_attention_distance(per_layer: list[torch.Tensor], path: str | Path,
                            uniform: list[torch.Tensor] | None = None) -> Path:
    """``per_layer``: one tensor per layer (any shape, e.g. ``[B, H_l]`` from ``layer_attention_distance``),
    averaged per layer; ``uniform``: the same for the uniform model, drawn with the difference."""
    plt = _pyplot()
    means = torch.tensor([float(x.float().mean()) for x in per_layer])
    panels = 2 if uniform is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(range(len(means)), means.tolist(), marker="o", label="model")
    if uniform is not None:
        if len(uniform) != len(per_layer):
            raise ValueError(f"uniform must have one entry per layer ({len(per_layer)}), got {len(uniform)}")
        base = torch.tensor([float(x.float().mean()) for x in uniform])
        ax.plot(range(len(base)), base.tolist(), marker="s", label="uniform")
        axes[0][1].bar(range(len(means)), (means - base).tolist())
        axes[0][1].axhline(0, color="black", linewidth=0.8)
        axes[0][1].set_xlabel("layer l")
        axes[0][1].set_ylabel("Delta D_l (tokens)")
        axes[0][1].set_title("attention distance minus the uniform model's")
        ax.legend()
    ax.set_xlabel("layer l")
    ax.set_ylabel("mean attention distance (tokens)")
    ax.set_title("attention distance per layer")
    return _save(fig, plt, path)


def plot_schedule(schedule: PrismSchedule, path: str | Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(schedule.n_layers), schedule.head_dims)
    for h, start, length in schedule.runs():
        ax.text(start + (length - 1) / 2, schedule.d_model // h, f"{h}h", ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("layer l")
    ax.set_ylabel("head dim")
    ax.set_title(f"Prism schedule: d_model {schedule.d_model}, {schedule.n_layers} layers, h_base {schedule.h_base}")
    return _save(fig, plt, path)


def _summary(result: LayerAngles) -> dict[str, list[float]]:
    return {name: getattr(result, name).tolist() for name in
            ("state_mean", "state_std", "update_mean", "update_std", "pca_explained")}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lamina diagnose", description="diagnostics charts (PNG)")
    sub = parser.add_subparsers(dest="what", required=True)
    angles = sub.add_parser("angles", help="layer angles of hidden states saved with torch.save")
    angles.add_argument("states", help="a .pt file: a list of [B, T, D] tensors or one [L, B, T, D] tensor")
    angles.add_argument("--mask", help="a .pt file with the [B, T] mask of kept tokens")
    angles.add_argument("--out", default=".", help="output folder")
    sched = sub.add_parser("schedule", help="generate a Prism schedule and draw it")
    sched.add_argument("--d-model", type=int, required=True)
    sched.add_argument("--n-layers", type=int, required=True)
    sched.add_argument("--h-base", type=int, required=True)
    sched.add_argument("--profile", choices=PROFILES, default="coarse")
    sched.add_argument("--out", default=".", help="output folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        if args.what == "angles":
            states = torch.load(args.states, map_location="cpu", weights_only=True)
            mask = torch.load(args.mask, map_location="cpu", weights_only=True) if args.mask else None
            result = layer_angles(states, mask=mask)
            png = plot_layer_angles(result, out / "layer-angles.png")
            (out / "layer-angles.json").write_text(json.dumps(_summary(result), indent=1))
            print(f"wrote {png} and {out / 'layer-angles.json'}")
        else:
            schedule = PrismSchedule.generate(args.d_model, args.n_layers, args.h_base, profile=args.profile)
            png = plot_schedule(schedule, out / "schedule.png")
            print(f"head dims: {list(schedule.head_dims)}")
            print(f"wrote {png}")
    except (ValueError, TypeError, OSError) as exc:
        print(f"lamina diagnose: {exc}")
        return 2
    return 0


__all__ = ["main", "plot_attention_distance", "plot_layer_angles", "plot_schedule"]
