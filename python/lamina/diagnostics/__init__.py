"""Diagnostics from the papers behind lamina, usable on any model's tensors.

* ``attention_distance``, ``layer_attention_distance``: mean attention distance per head and
  layer (the Prism paper's per-layer analysis).
* ``layer_angles``: angles between consecutive hidden states and between consecutive updates, per
  token ("Inverse Depth Scaling From Most Layers Being Similar").
* ``fit_depth_scaling``: the loss law ``L = c_m m^-a_m + c_l l^-a_l + c_D D^-a_D + L0`` fitted to
  measured points, with bootstrapped confidence intervals.
"""

from lamina.diagnostics.angles import LayerAngles, layer_angles
from lamina.diagnostics.attention import attention_distance, layer_attention_distance
from lamina.diagnostics.scaling import DepthScalingFit, fit_depth_scaling

__all__ = ["DepthScalingFit", "LayerAngles", "attention_distance", "fit_depth_scaling", "layer_angles",
           "layer_attention_distance"]
