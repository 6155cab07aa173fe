"""Cross-layer routing between delta-rule layers: CLVR and CLER.

From "Linear Attention Architectures: Mechanisms, Trade-offs, and Cross-Layer Routing": a layer passes
a tensor it forms anyway to the next layer, where a learned projection, zero at initialisation, adds it
to that layer's value target before the delta update.

* ``"clvr"`` (cross-layer value routing): the value target the layer writes, ``v`` after projection,
  short convolution and activation (plus what the layer itself received).
* ``"cler"`` (cross-layer error routing): the write error, what each token writes into the state,
  ``v_new_t = w_t * v_t - (D_t S_{t-1})^T (b_t k_t)`` (``beta_t (v_t - (D_t S_{t-1})^T k_t)`` for
  DeltaNet, Gated DeltaNet and KDA). The ops return it from the chunked state pass
  (``output_v_new=True``), where it is formed anyway: no extra pass over memory.

Both work for all four layers (``DeltaNet``, ``GatedDeltaNet``, ``KimiDeltaAttention``,
``GatedDeltaNet2``): a layer built with ``routing="clvr" | "cler"`` returns its routed tensor as a fourth
result when called with ``output_routed=True``, and adds ``routed_values`` (already projected) to its
value target. A model stack wires a ``CrossLayerRouter`` between consecutive layers::

    o1, _, _, r1 = layer1(x1, output_routed=True)
    o2, _, _ = layer2(x2, routed_values=router(r1))

With the router at zero the second layer's output equals that of the stack without routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lamina._validate import check_layer_input, check_positive_int

ROUTING_KINDS = ("clvr", "cler")


def check_routing(routing: object, name: str = "routing") -> str | None:
    """``routing`` is None, "clvr" or "cler"."""
    if routing is not None and routing not in ROUTING_KINDS:
        raise ValueError(f"{name} must be None or one of {ROUTING_KINDS}, got {routing!r}")
    return routing


class CrossLayerRouter(nn.Module):
    """The learned projection of one layer's routed tensor into the next layer's value target.

    Args:
        in_features: width of the routed tensor (the sending layer's ``value_dim``).
        out_features: the receiving layer's ``value_dim``.
        kind: "clvr" or "cler" (what the sending layer routes; recorded for the model stack).

    ``weight [out_features, in_features]`` starts at zero (no random draw, so a model's other
    parameters get the same initial values with and without routers). ``forward(routed [..., in])``
    returns ``routed @ weight^T`` ``[..., out_features]``, in ``routed``'s dtype.
    """

    def __init__(self, in_features: int, out_features: int, kind: str = "clvr",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_positive_int("in_features", in_features)
        check_positive_int("out_features", out_features)
        if check_routing(kind, "kind") is None:
            raise ValueError(f"kind must be one of {ROUTING_KINDS}, got None")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, device=device, dtype=dtype))

    def forward(self, routed: torch.Tensor) -> torch.Tensor:
        # a float tensor [..., in_features] on the weight's device, of any float dtype (cast for the product)
        check_layer_input("routed", routed, self, width=self.in_features, ndim=None, match_dtype=False,
                          width_name="in_features")
        return F.linear(routed.to(self.weight.dtype), self.weight).to(routed.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind!r}"


__all__ = ["ROUTING_KINDS", "CrossLayerRouter", "check_routing"]
