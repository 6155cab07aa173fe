"""What the four fla-compatible layers are made of, from their constructor arguments.

The layer ops of the suite (``layer_deltanet``, ``layer_gated_deltanet``, ``layer_kda``,
``layer_gdn2``) time ``lamina.layers.<Name>`` against ``fla.layers.<Name>`` (fla 0.6). Their FLOP
and byte counts (``lamina.bench.specs``) need the sizes of every projection, short convolution and
of the recurrence; this module derives them from the constructor arguments with fla 0.6's
arithmetic and defaults (``fla/layers/{delta_net,gated_deltanet,kda,gdn2}.py``), without building
a module. ``tests/test_bench_specs.py`` checks the result against the modules themselves.

Pure Python: importing it needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYER_OPS = ("layer_deltanet", "layer_gated_deltanet", "layer_kda", "layer_gdn2")
# The class of each op, by the same name in lamina.layers and fla.layers.
LAYER_CLASSES: dict[str, str] = {
    "layer_deltanet": "DeltaNet",
    "layer_gated_deltanet": "GatedDeltaNet",
    "layer_kda": "KimiDeltaAttention",
    "layer_gdn2": "GatedDeltaNet2",
}
# The delta-rule op each layer runs (its FLOPs come from that op's formula).
LAYER_RECURRENCE: dict[str, str] = {
    "layer_deltanet": "delta_rule",
    "layer_gated_deltanet": "gated_delta_rule",
    "layer_kda": "kda",
    "layer_gdn2": "gdn2",
}
# fla 0.6's defaults of the constructor arguments that set a layer's sizes.
LAYER_DEFAULTS: dict[str, dict[str, Any]] = {
    "layer_deltanet": dict(hidden_size=1024, expand_k=1.0, expand_v=1.0, num_heads=4, use_beta=True, use_gate=False,
                           use_short_conv=True, conv_size=4, conv_bias=False),
    "layer_gated_deltanet": dict(hidden_size=2048, expand_v=2, head_dim=256, num_heads=6, num_v_heads=None,
                                 use_gate=True, use_short_conv=True, conv_size=4, conv_bias=False),
    "layer_kda": dict(hidden_size=2048, expand_v=1, head_dim=128, num_heads=16, num_v_heads=None,
                      use_short_conv=True, conv_size=4, conv_bias=False),
    "layer_gdn2": dict(hidden_size=2048, expand_v=1.0, head_dim=128, num_heads=16, num_v_heads=None,
                       use_short_conv=True, conv_size=4, conv_bias=False),
}


@dataclass(frozen=True)
class LayerDims:
    """Sizes of one layer. ``linears``: ``(in, out, bias)`` of every ``nn.Linear``; ``convs``: the
    channels of each depthwise short convolution (``conv_size`` taps, ``conv_bias``); ``vectors``:
    the remaining parameters (``A_log``, ``dt_bias``, the output norm's weight); ``H, HV, K, V``:
    the recurrence as the layer calls its op (q/k heads, value heads, key and value head dims)."""

    hidden_size: int
    linears: tuple[tuple[int, int, bool], ...]
    convs: tuple[int, ...]
    conv_size: int
    conv_bias: bool
    vectors: int
    H: int
    HV: int
    K: int
    V: int

    @property
    def params(self) -> int:
        """Parameter count (elements), the module's ``sum(p.numel())``."""
        linear = sum(i * o + (o if bias else 0) for i, o, bias in self.linears)
        conv = sum(c * self.conv_size + (c if self.conv_bias else 0) for c in self.convs)
        return linear + conv + self.vectors

    def projection_flops_per_token(self) -> int:
        """Forward FLOPs per token outside the recurrence: 2 * in * out per linear (bias adds
        ignored), 2 * channels * taps per short convolution. Norms, gates, activations and the q/k
        l2 norm (a few FLOPs per element of a width-sized vector) are left out: under 1% of the
        projections at every suite shape."""
        return sum(2 * i * o for i, o, _ in self.linears) + sum(2 * c * self.conv_size for c in self.convs)


def layer_config(op: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The size-setting constructor arguments of ``op``: fla's defaults updated by ``kwargs``."""
    if op not in LAYER_DEFAULTS:
        raise ValueError(f"unknown layer op {op!r}; known: {', '.join(LAYER_OPS)}")
    cfg = dict(LAYER_DEFAULTS[op])
    cfg.update({k: v for k, v in kwargs.items() if k in cfg or k == "d_model"})
    if op == "layer_deltanet" and cfg.get("d_model") is not None:  # fla: d_model wins over hidden_size
        cfg["hidden_size"] = cfg["d_model"]
    return cfg


def layer_dims(op: str, kwargs: dict[str, Any]) -> LayerDims:
    """The sizes of ``<LAYER_CLASSES[op]>(**kwargs)``, computed as fla 0.6's constructor does."""
    c = layer_config(op, kwargs)
    D, W, conv_bias = c["hidden_size"], c["conv_size"], c["conv_bias"]
    if op == "layer_deltanet":
        key_dim, value_dim, H = int(D * c["expand_k"]), int(D * c["expand_v"]), c["num_heads"]
        HV, K, V = H, key_dim // H, value_dim // H
        linears = [(D, key_dim, False), (D, key_dim, False), (D, value_dim, False)]
        if c["use_beta"]:
            linears.append((D, H, False))
        if c["use_gate"]:
            linears.append((D, value_dim, False))
        vectors = V  # output norm
    else:
        H, K = c["num_heads"], c["head_dim"]
        HV = c["num_v_heads"] if c["num_v_heads"] is not None else H
        V = int(K * c["expand_v"])
        key_dim, value_dim = H * K, HV * V
        linears = [(D, key_dim, False), (D, key_dim, False), (D, value_dim, False)]
        if op == "layer_gated_deltanet":
            linears += [(D, HV, False), (D, HV, False)]  # a_proj, b_proj
            if c["use_gate"]:
                linears.append((D, value_dim, False))  # g_proj
            vectors = 2 * HV + V  # A_log, dt_bias, output norm
        elif op == "layer_kda":
            gate_dim = HV * K
            linears += [(D, V, False), (V, gate_dim, False), (D, HV, False),  # f_proj (low rank), b_proj
                        (D, V, False), (V, value_dim, True)]  # g_proj (low rank, bias)
            vectors = HV + gate_dim + V  # A_log, dt_bias, output norm
        else:  # layer_gdn2: per-K decay and erase gates, per-V write gate; q and k repeated to HV heads
            linears += [(D, V, False), (V, key_dim, False), (D, key_dim, False), (D, value_dim, False),
                        (D, V, False), (V, value_dim, True)]  # f_proj, b_proj, w_proj, g_proj
            vectors = H + key_dim + V  # A_log, dt_bias, output norm
            H = HV
    linears.append((value_dim, D, False))  # o_proj
    convs = (key_dim, key_dim, value_dim) if c["use_short_conv"] else ()
    return LayerDims(D, tuple(linears), convs, W, conv_bias, vectors, H, HV, K, V)
