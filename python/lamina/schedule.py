"""Progressive head schedules for Prism Transformers.

A Prism schedule gives every layer ``l`` (0-based here) its head count ``h_l``;
``d_model`` is the same in every layer, so the head dim is ``d_model // h_l``:
few wide heads early, many narrow heads late, and the same parameters and
FLOPs as the uniform model.

Rules (``PrismSchedule`` checks all of them and names the violated rule and the
layer index in its ``ValueError``):

1. ``divides d_model``: every ``h_l`` divides ``d_model``.
2. ``non-decreasing``: ``h_l <= h_{l+1}``.
3. ``ends at h_base``: the last layer has ``h_base`` heads. With rule 2 this means
   no layer has more than ``h_base`` heads and the ``h_base`` layers form one
   final block.
4. ``runs of 2-4 layers``: every maximal run of equal head counts *before the final
   h_base block* has 2, 3 or 4 layers. lamina reads the rule this way because the
   final block must also satisfy rule 5 and so is usually longer than 4 layers
   (12 of 24 at least for GPT-2 medium); splitting an equal-valued block into
   "runs" would be meaningless. The final block may have any length allowed by rule 5.
5. ``at least L/2 layers at h_base``: ``2 * count(h_l == h_base) >= L``.

The presets (``PrismSchedule.presets()``) cover the GPT-2-style scales
768/12/12, 1024/24/16 and 1280/36/20 with head dim 256 in the first run. The
paper does not publish its exact per-layer schedules: these are lamina's own
choice, made to satisfy the rules above while stepping the head dim down
through the divisors of ``d_model`` in runs as long as rule 5 allows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

RULE_DIVIDES = "divides d_model"
RULE_NON_DECREASING = "non-decreasing"
RULE_ENDS_AT_BASE = "ends at h_base"
RULE_RUNS = "runs of 2-4 layers"
RULE_BASE_HALF = "at least L/2 layers at h_base"

# Shortest and longest run of equal head counts allowed before the final h_base block (rule 4).
MIN_RUN = 2
MAX_RUN = 4
# Staircases of ``PrismSchedule.generate``: few large steps, or many small ones.
PROFILES = ("coarse", "fine")


@dataclass(frozen=True)
class _Preset:
    d_model: int
    n_layers: int
    h_base: int
    heads: tuple[int, ...]


def _runs(*pairs: tuple[int, int]) -> tuple[int, ...]:
    """Expand ``(heads, layers)`` pairs into a per-layer tuple."""
    return tuple(h for h, n in pairs for _ in range(n))


# Head dims per run in comments: d_model // heads.
_PRESETS: dict[str, _Preset] = {
    # 256, 192, 128 for two layers each, then 64 for the second half.
    "gpt2-small": _Preset(768, 12, 12, _runs((3, 2), (4, 2), (6, 2), (12, 6))),
    # 1024 has only power-of-two divisors: 256 and 128 for four layers each, then 64 for 16 layers.
    "gpt2-medium": _Preset(1024, 24, 16, _runs((4, 4), (8, 4), (16, 16))),
    # 256, 160, 128, 80 for four layers each, then 64 for 20 layers.
    "gpt2-large": _Preset(1280, 36, 20, _runs((5, 4), (8, 4), (10, 4), (16, 4), (20, 20))),
}


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _violation(rule: str, layer: int, detail: str) -> ValueError:
    return ValueError(f"PrismSchedule rule '{rule}' violated at layer {layer}: {detail}")


@dataclass(frozen=True)
class PrismSchedule:
    """Per-layer head counts of a Prism Transformer, validated against the Prism rules.

    Build one from explicit head counts or a named preset::

        PrismSchedule(768, 12, 12, widths=[3, 3, 4, 4, 6, 6] + [12] * 6)
        PrismSchedule(768, 12, 12, preset="gpt2-small")
        PrismSchedule.from_preset("gpt2-small")
        PrismSchedule.uniform(768, 12, 12)

    Args:
        d_model: model width, the same in every layer.
        n_layers: number of layers ``L``.
        h_base: head count of the final layers (the uniform model's head count).
        widths: per-layer head counts ``h_0 .. h_{L-1}`` (the "width" of a layer in heads,
            not its head dim; see ``from_head_dims`` for the other spelling). Length ``L``.
        preset: name from ``PrismSchedule.presets()``; its d_model, n_layers and h_base
            must equal the ones given.

    Exactly one of ``widths`` and ``preset`` is required. The rules and their reading
    are in the module docstring; a violation raises ``ValueError`` naming the rule and
    the 0-based layer index.

    Attributes:
        heads: tuple of ``L`` head counts.
        head_dims: tuple of ``L`` head dims, ``d_model // h_l``.
    """

    d_model: int
    n_layers: int
    h_base: int
    widths: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    preset: str | None = field(default=None, compare=False)
    heads: tuple[int, ...] = field(init=False)

    RULES: ClassVar[tuple[str, ...]] = (
        RULE_DIVIDES,
        RULE_NON_DECREASING,
        RULE_ENDS_AT_BASE,
        RULE_RUNS,
        RULE_BASE_HALF,
    )

    def __post_init__(self) -> None:
        _check_positive_int("d_model", self.d_model)
        _check_positive_int("n_layers", self.n_layers)
        _check_positive_int("h_base", self.h_base)
        if (self.widths is None) == (self.preset is None):
            raise ValueError(
                "PrismSchedule needs exactly one of widths= (per-layer head counts) and preset= "
                f"(one of {self.presets()}), got widths={self.widths!r}, preset={self.preset!r}"
            )
        heads = self._preset_heads(self.preset) if self.preset is not None else self._as_heads(self.widths)
        object.__setattr__(self, "heads", heads)
        if self.widths is not None:
            object.__setattr__(self, "widths", heads)
        self._validate()

    # ------------------------------------------------------------------ construction

    @classmethod
    def uniform(cls, d_model: int, n_layers: int, n_heads: int) -> PrismSchedule:
        """The uniform schedule: ``n_heads`` heads in every layer (``h_base = n_heads``)."""
        _check_positive_int("n_layers", n_layers)
        _check_positive_int("n_heads", n_heads)
        return cls(d_model, n_layers, n_heads, widths=(n_heads,) * n_layers)

    @classmethod
    def generate(
        cls,
        d_model: int,
        n_layers: int,
        h_base: int,
        profile: str = "coarse",
        max_head_dim: int = 256,
        head_dim_multiple: int = 8,
    ) -> PrismSchedule:
        """A progressive schedule under the rules: a staircase of wide heads, then ``h_base`` heads.

        The first half of the layers (``n_layers // 2``; the rest is the final ``h_base`` block, rule 5)
        steps the head count up through the divisors ``h`` of ``d_model`` with ``h < h_base`` and a
        head dim ``d_model // h`` at most ``max_head_dim`` and a multiple of ``head_dim_multiple`` (8:
        every head dim ``lamina.prism_attention`` runs), starting from the widest such head dim.
        ``profile`` sets the staircase: ``"coarse"`` takes as few steps as runs of at most 4 layers
        allow (plateaus of 3-4 layers, large steps in head dim), ``"fine"`` as many as runs of at least
        2 layers allow (plateaus of 2, every few divisors). The steps are spread evenly over the
        divisors between the widest and ``h_base``; layers the runs cannot take join the final block.
        With no such divisor, or fewer than 2 layers to spend, the schedule is uniform. Every layer
        projects ``d_model -> d_model``, so the parameter count equals the uniform model's.
        """
        _check_positive_int("d_model", d_model)
        _check_positive_int("n_layers", n_layers)
        _check_positive_int("h_base", h_base)
        _check_positive_int("max_head_dim", max_head_dim)
        _check_positive_int("head_dim_multiple", head_dim_multiple)
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        if d_model % h_base:
            raise _violation(RULE_DIVIDES, n_layers - 1, f"h_base={h_base} does not divide d_model={d_model}")
        steps = [h for h in range(1, h_base) if d_model % h == 0 and d_model // h <= max_head_dim
                 and (d_model // h) % head_dim_multiple == 0]
        prefix = n_layers // 2
        if profile == "coarse":
            count = min(len(steps), -(-prefix // MAX_RUN))
        else:
            count = min(len(steps), prefix // MIN_RUN)
        if count == 0 or prefix < MIN_RUN:
            return cls.uniform(d_model, n_layers, h_base)
        # evenly spaced over the candidates, from the widest head dim (index 0) toward h_base
        picks = sorted({round(i * (len(steps) - 1) / max(count - 1, 1)) for i in range(count)})
        chosen = [steps[i] for i in picks] if count > 1 else [steps[0]]
        spent = min(prefix, MAX_RUN * len(chosen))
        lengths = [spent // len(chosen) + (i < spent % len(chosen)) for i in range(len(chosen))]
        heads = [h for h, n in zip(chosen, lengths) for _ in range(n)]
        return cls(d_model, n_layers, h_base, widths=tuple(heads + [h_base] * (n_layers - len(heads))))

    @classmethod
    def from_preset(cls, name: str) -> PrismSchedule:
        """The preset ``name`` (see ``presets()``) with its own d_model, n_layers and h_base."""
        p = cls._lookup(name)
        return cls(p.d_model, p.n_layers, p.h_base, preset=name)

    @classmethod
    def from_head_dims(cls, d_model: int, head_dims: list[int] | tuple[int, ...]) -> PrismSchedule:
        """A schedule given by per-layer head dims; ``h_base`` is ``d_model // head_dims[-1]``."""
        _check_positive_int("d_model", d_model)
        if isinstance(head_dims, (str, bytes)) or not hasattr(head_dims, "__len__") or not len(head_dims):
            raise ValueError(f"head_dims must be a non-empty sequence of ints, got {head_dims!r}")
        heads = []
        for layer, dim in enumerate(head_dims):
            _check_positive_int(f"head_dims[{layer}]", dim)
            if d_model % dim:
                raise _violation(RULE_DIVIDES, layer, f"head dim {dim} does not divide d_model={d_model}")
            heads.append(d_model // dim)
        return cls(d_model, len(heads), heads[-1], widths=tuple(heads))

    @staticmethod
    def presets() -> list[str]:
        """Names of the built-in presets."""
        return sorted(_PRESETS)

    @classmethod
    def _lookup(cls, name: object) -> _Preset:
        if not isinstance(name, str):
            raise TypeError(f"preset must be a str, got {type(name).__name__}")
        if name not in _PRESETS:
            raise ValueError(f"preset must be one of {cls.presets()}, got {name!r}")
        return _PRESETS[name]

    def _preset_heads(self, name: str) -> tuple[int, ...]:
        p = self._lookup(name)
        given = (self.d_model, self.n_layers, self.h_base)
        if given != (p.d_model, p.n_layers, p.h_base):
            raise ValueError(
                f"preset {name!r} is for (d_model, n_layers, h_base) = {(p.d_model, p.n_layers, p.h_base)}, "
                f"got {given}; use PrismSchedule.from_preset({name!r}) or pass widths="
            )
        return p.heads

    def _as_heads(self, widths: object) -> tuple[int, ...]:
        if isinstance(widths, (str, bytes)) or not hasattr(widths, "__len__"):
            raise TypeError(f"widths must be a sequence of ints, got {type(widths).__name__}")
        if len(widths) != self.n_layers:
            raise ValueError(f"widths must have n_layers={self.n_layers} entries, got {len(widths)}")
        for layer, h in enumerate(widths):
            _check_positive_int(f"widths[{layer}]", h)
        return tuple(int(h) for h in widths)

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        heads, d_model, h_base, n = self.heads, self.d_model, self.h_base, self.n_layers
        for layer, h in enumerate(heads):
            if d_model % h:
                raise _violation(RULE_DIVIDES, layer, f"h={h} does not divide d_model={d_model}")
        for layer in range(1, n):
            if heads[layer] < heads[layer - 1]:
                raise _violation(
                    RULE_NON_DECREASING, layer, f"h={heads[layer]} < h={heads[layer - 1]} of layer {layer - 1}"
                )
        if heads[-1] != h_base:
            raise _violation(RULE_ENDS_AT_BASE, n - 1, f"the last layer has h={heads[-1]}, expected h_base={h_base}")
        for h, start, length in self.runs()[:-1]:
            if not MIN_RUN <= length <= MAX_RUN:
                raise _violation(
                    RULE_RUNS,
                    start,
                    f"the run of h={h} over layers {start}..{start + length - 1} has {length} layer(s), "
                    f"expected {MIN_RUN} to {MAX_RUN} (only the final h_base block may be longer)",
                )
        _, base_start, base_len = self.runs()[-1]
        if 2 * base_len < n:
            raise _violation(
                RULE_BASE_HALF,
                base_start,
                f"only {base_len} of {n} layers (from layer {base_start}) have h_base={h_base}, "
                f"expected at least {(n + 1) // 2}",
            )

    # ------------------------------------------------------------------ queries

    @property
    def head_dims(self) -> tuple[int, ...]:
        """Per-layer head dims ``d_model // h_l``."""
        return tuple(self.d_model // h for h in self.heads)

    @property
    def is_uniform(self) -> bool:
        return all(h == self.h_base for h in self.heads)

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of equal head counts as ``(heads, first_layer, length)``, in layer order."""
        out: list[tuple[int, int, int]] = []
        start = 0
        for layer in range(1, self.n_layers + 1):
            if layer == self.n_layers or self.heads[layer] != self.heads[start]:
                out.append((self.heads[start], start, layer - start))
                start = layer
        return out

    def __len__(self) -> int:
        return self.n_layers

    def __getitem__(self, layer: int) -> int:
        return self.heads[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(self.heads)
