"""One fuzz case of a delta-rule op (``chunk_*`` and ``fused_recurrent_*``) against the float64 token loop.

The fuzzer applies fla's input transforms (l2norm, gate activation, beta sigmoid, ``g + gk``)
itself, in float64, to the same rounded inputs the op gets, then calls
``lamina.reference.delta_rule_family_recurrent_ref``; outputs, final states and the gradient of
every differentiable input (q, k, v, g, gk, beta, b, w, initial_state, A_log, dt_bias) are
compared with ``lamina.testing.assert_close`` (recurrence rows of the table; ``A_log``, ``dt_bias`` and
``beta``, which sum a term per gate element or per channel, relative to the root-sum-square of their terms;
every gradient also relative to its terms per value channel and per key channel of q, ``_parameter_scales``,
and the output to its terms per key channel, ``output_term_sizes``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina._delta_spec import DEFAULT_CHUNK_SIZE, LOG_DECAY_FLOOR
from lamina.fuzz.common import (
    DTYPES,
    Draw,
    as_ref,
    backward,
    compare_grads,
    compare_in_stages,
    float32_copies,
    leaf,
    offsets,
    raise_floors,
)
from lamina.fuzz.space import DELTA_SPECS, RESET_SHARE
from lamina.testing import assert_close, reduction_scale

L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x^2 + eps)


# --- the input transforms, in float64, written out for the oracle ---------------------------------

def l2norm64(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gate64(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
           lower_bound: float | None) -> torch.Tensor:
    """fla's in-kernel gate: ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``; A_log per head, dt_bias per head (and channel),
    either also accepted broadcast to ``g``'s shape (``_parameter_scales``)."""
    x = g if dt_bias is None else g + _per_gate(dt_bias, g)
    a = _per_gate(A_log, g).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x)


def _per_gate(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A per-head (or per-head-and-channel) gate parameter shaped to broadcast against ``g``
    ``[B, T, HV]`` or ``[B, T, HV, K]``; one already of ``g``'s shape as it is."""
    if p.shape == g.shape:
        return p
    return p.reshape(g.shape[2], *([-1] if g.dim() == 4 else []))


def read_rows(case: dict, r: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the kernels read them: after the l2norm where the case fuses it."""
    return (l2norm64(r["q"]), l2norm64(r["k"])) if case["l2norm"] else (r["q"], r["k"])


def beta64(beta: torch.Tensor, sigmoid: bool, neg_eigval: bool) -> torch.Tensor:
    if not sigmoid:
        return beta
    return torch.sigmoid(beta) * (2.0 if neg_eigval else 1.0)


def _decay(draw: Draw, shape: tuple[int, ...], strength: str, resets: bool = False) -> torch.Tensor:
    """Log decays of a strength; with ``resets``, ``RESET_SHARE`` of them -inf (decays of 0)."""
    if strength == "mild":
        g = F.logsigmoid(draw.randn(*shape) + 4)
    elif strength == "moderate":
        g = F.logsigmoid(draw.randn(*shape))
    else:
        g = -20.0 * draw.rand(*shape)
    if resets:
        g = g.masked_fill(draw.rand(*shape) < RESET_SHARE, float("-inf"))
    return g


# --- the case --------------------------------------------------------------------------------------

def _masters(case: dict, draw: Draw) -> dict[str, torch.Tensor | None]:
    """float64 values of every op input (before rounding to the case dtype)."""
    spec = DELTA_SPECS[case["op"]]
    B = case["B"]
    T = case["T"] if case["lens"] is None else sum(case["lens"])
    N = B if case["lens"] is None else len(case["lens"])
    H, K, V = case["H"], case["K"], case["V"]
    HV = H * case["ratio"]
    x: dict[str, torch.Tensor | None] = dict.fromkeys(("q", "k", "v", "g", "gk", "beta", "b", "w",
                                                       "initial_state", "A_log", "dt_bias"))
    x["q"] = draw.randn(B, T, H, K)
    k = draw.randn(B, T, H, K)
    # without the in-op l2norm the keys must be unit vectors (the recurrence is only stable then)
    x["k"] = k * (0.5 + 2 * draw.rand(1)) if case["l2norm"] else F.normalize(k, dim=-1)
    x["v"] = draw.randn(B, T, HV, V)
    g_shape = (B, T, HV) if spec.g == "scalar" else (B, T, HV, K)
    if case["g"]:
        if case["gate_in_kernel"]:
            x["g"] = draw.randn(*g_shape)
            if case.get("resets", False):
                x["g"] = x["g"].masked_fill(draw.rand(*g_shape) < RESET_SHARE, 1e6)
            strong = case["gate_strength"] == "extreme"
            x["A_log"] = torch.log(draw.rand(HV) * (15.0 if strong else 0.9) + (1.0 if strong else 0.1))
            if case["dt_bias"]:
                x["dt_bias"] = draw.randn(HV if spec.g == "scalar" else HV * K)
        else:
            x["g"] = _decay(draw, g_shape, case["gate_strength"], case.get("resets", False))
    if case["gk"]:
        x["gk"] = _decay(draw, (B, T, HV, K), case["gate_strength"], case.get("resets", False))
    if spec.gates == "bw":
        x["b"] = torch.sigmoid(draw.randn(B, T, HV, K))
        x["w"] = torch.sigmoid(draw.randn(B, T, HV, V))
    elif case["beta"]:
        x["beta"] = draw.randn(B, T, HV) if case["beta_sigmoid"] else torch.sigmoid(draw.randn(B, T, HV))
    if case["initial_state"]:
        x["initial_state"] = draw.randn(N, HV, K, V)
        if case["state_v_first"]:
            x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    return x


# Inputs kept in float32 whatever the case dtype (log decays, states and gate parameters, as models keep them).
_FP32_INPUTS = ("g", "gk", "initial_state", "A_log", "dt_bias")


def _call(case: dict, x: dict, cu: torch.Tensor | None):
    import lamina

    spec = DELTA_SPECS[case["op"]]
    kw = dict(q=x["q"], k=x["k"], v=x["v"], scale=case["scale"], initial_state=x["initial_state"],
              output_final_state=case["output_final_state"], use_qk_l2norm_in_kernel=case["l2norm"],
              cu_seqlens=cu, backend=case["backend"])
    if spec.chunked:
        kw["chunk_size"] = case["chunk_size"]
    if spec.v_first:
        kw["state_v_first"] = case["state_v_first"]
    if spec.g is not None:
        kw["g"] = x["g"]
    if spec.gk:
        kw["gk"] = x["gk"]
    if spec.gates == "bw":
        kw.update(b=x["b"], w=x["w"])
    else:
        kw["beta"] = x["beta"]
    if spec.beta_sigmoid:
        kw.update(use_beta_sigmoid_in_kernel=case["beta_sigmoid"], allow_neg_eigval=case["allow_neg_eigval"])
    if spec.gate_in_kernel:
        kw.update(use_gate_in_kernel=case["gate_in_kernel"], A_log=x["A_log"], dt_bias=x["dt_bias"])
    if spec.lower_bound and case["lower_bound"] is not None:
        kw["lower_bound"] = case["lower_bound"]
    return getattr(lamina, case["op"])(**kw)


def _log_decay(case: dict, r: dict) -> torch.Tensor | None:
    """The log decay the oracle applies: ``g`` (through the in-kernel gate's activation) plus ``gk``, ``[B, T,
    HV]`` or ``[B, T, HV, K]``. ``g`` may come already broadcast to ``gk``'s shape (``_decay_scales``)."""
    g = r["g"]
    if g is not None and case["gate_in_kernel"]:
        g = gate64(g, r["A_log"], r["dt_bias"], case["lower_bound"])
    if r["gk"] is not None:
        g = r["gk"] if g is None else (g if g.dim() == r["gk"].dim() else g[..., None]) + r["gk"]
    return g


def _oracle(case: dict, r: dict, cu: torch.Tensor | None, chunked: bool = False,
            gates: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The op's map on the reference inputs ``r``: the token loop, or with ``chunked`` the plain chunked
    form at the case's chunk size (the same math as the op's chunked path, its log decays floored as there, for
    the float32 baseline).
    ``gates``: beta's values as the erase and write gates apart (``[B, T, HV, K]``, ``[B, T, HV, V]``,
    before the activation) in place of ``r["beta"]`` (``_parameter_scales``)."""
    from lamina.reference import delta_rule_family_chunk_ref, delta_rule_family_recurrent_ref

    spec = DELTA_SPECS[case["op"]]
    q, k = read_rows(case, r)
    g = _log_decay(case, r)
    if spec.gates == "bw":
        erase, write = r["b"], r["w"]
    elif gates is not None:
        erase, write = (beta64(x, case["beta_sigmoid"], case["allow_neg_eigval"]) for x in gates)
    else:
        beta = r["beta"] if r["beta"] is not None else torch.ones(q.shape[:2] + (r["v"].shape[2],), dtype=q.dtype)
        erase = write = beta64(beta, case["beta_sigmoid"], case["allow_neg_eigval"])
    h0 = r["initial_state"]
    if h0 is not None and case["state_v_first"]:
        h0 = h0.transpose(-1, -2)
    kw = dict(g=g, erase=erase, write=write, scale=case["scale"], initial_state=h0, output_final_state=True,
              cu_seqlens=cu)
    if chunked:
        # the op's chunked forms floor the log decays (-inf, a decay of 0, would make G_i - G_j NaN)
        if g is not None:
            kw["g"] = g.clamp(min=LOG_DECAY_FLOOR)
        o, ht = delta_rule_family_chunk_ref(q, k, r["v"], chunk_size=case["chunk_size"], **kw)
    else:
        o, ht = delta_rule_family_recurrent_ref(q, k, r["v"], **kw)
    if case["state_v_first"]:
        ht = ht.transpose(-1, -2)
    return o, ht


def check_delta(case: dict) -> None:
    """Run the case, under its speed alternative of the kernels where it has one (``tuning``, the choices of
    ``lamina.kernels.delta_tuning.delta_tuning``); AssertionError on a mismatch (any other exception is a crash
    of the op).

    A float32 case that misses the table's bound is compared once more with a float32 baseline: the
    oracle's own math run plainly in float32 (``lamina.testing``, ``baseline``), the chunked form for
    ``chunk_*``, the token loop for the outputs of ``fused_recurrent_*`` and the chunked form at the
    default chunk size for their gradients (their backward is the chunked one).
    """
    if case.get("tuning"):
        from lamina.kernels.delta_tuning import delta_tuning

        with delta_tuning(**case["tuning"]):
            return _check_delta(case)
    return _check_delta(case)


def _check_delta(case: dict) -> None:
    dtype, device, grad = DTYPES[case["dtype"]], case["device"], case["grad"]
    draw = Draw(case["seed"])
    masters = _masters(case, draw)
    x = {name: leaf(m, torch.float32 if name in _FP32_INPUTS else dtype, device, grad)
         for name, m in masters.items()}
    refs = {name: as_ref(t, grad) for name, t in x.items()}
    cu = None if case["lens"] is None else offsets(case["lens"], device)
    cu_cpu = None if cu is None else cu.cpu()
    o, ht = _call(case, x, cu)
    o_ref, ht_ref = _oracle(case, refs, cu_cpu)
    do = dht = None
    if grad:
        do, dht = draw.cotangent(o.shape, o.dtype), draw.cotangent(ht_ref.shape, torch.float32)
        backward([o, ht], [do, dht])
        backward([o_ref, ht_ref if case["output_final_state"] else None], [do, dht])

    def compare(scales: dict[str, float], base: tuple | None) -> None:
        _compare(case, x, refs, (o, ht), (o_ref, ht_ref), scales, *(base or ()))

    def baseline() -> tuple:
        base = float32_copies(x, grad)
        chunked = DELTA_SPECS[case["op"]].chunked
        o_b, ht_b = _oracle(case, base, cu_cpu, chunked=chunked)
        if grad:
            # the gradients of the token-by-token ops come from the chunked backward (at the default chunk
            # size): their baseline is the chunked form's, as for the chunked ops
            o_c, ht_c = (o_b, ht_b) if chunked else _oracle({**case, "chunk_size": DEFAULT_CHUNK_SIZE}, base,
                                                             cu_cpu, chunked=True)
            backward([o_c, ht_c if case["output_final_state"] else None], [do, dht])
        return base, (o_b, ht_b)

    def scales() -> dict[str, float]:
        size = output_term_sizes(case, refs, cu_cpu)
        found = {"o": reduction_scale(size, size.shape, rms=True)}
        return (found | _parameter_scales(case, refs, cu_cpu, [do, dht])) if grad else found

    compare_in_stages(compare, scales, baseline if dtype == torch.float32 else None)


def _parameter_scales(case: dict, refs: dict, cu: torch.Tensor | None, cotangents: list) -> dict[str, float]:
    """Gradients that sum many terms, compared relative to the root-sum-square of those terms
    (``lamina.testing.reduction_scale``, the tolerance table's rule for a per-head parameter or a
    per-token gate):

    * ``A_log`` and ``dt_bias`` sum one term per gate element (token, head, channel);
    * ``beta`` (one per token and head) one per key channel, where it erases, and one per value channel,
      where it writes;
    * ``q`` and ``k`` with more value heads than query/key heads (GVA) one per value head that reads them,
      at the RMS over their elements (``rms=True``): two heads' terms can cancel (16-bit, T = 1).

    The terms are the float64 gradients of the same values broadcast to those shapes, through the
    oracle once more. Every gradient is also compared at its terms per value channel and per key channel of q
    (``_term_scales``), where that is larger."""
    scales = _term_scales(case, refs, cu, cotangents)
    names = [n for n in ("A_log", "dt_bias") if refs[n] is not None and refs[n].requires_grad]
    beta = refs["beta"]
    per_token = beta is not None and beta.requires_grad
    group = case["ratio"]
    shared = [n for n in ("q", "k") if group > 1 and refs[n].requires_grad]
    decay = [n for n in _GATE_INPUTS if refs[n] is not None and refs[n].requires_grad]
    if not names and not per_token and not shared and not decay:
        return scales
    r = {n: None if t is None else t.detach() for n, t in refs.items()}
    full = {}
    if names:
        g = r["g"]
        full = {n: _per_gate(r[n], g).expand(g.shape).clone().requires_grad_() for n in names}
    # one copy of q and k per value head (the oracle then reads them as heads of their own)
    full |= {n: r[n].repeat_interleave(group, dim=2).requires_grad_() for n in shared}
    gates = None
    if per_token:
        widths = (r["k"].shape[-1], r["v"].shape[-1])
        gates = tuple(r["beta"][..., None].expand(*beta.shape, n).clone().requires_grad_() for n in widths)
    o, ht = _oracle(case, r | full, cu, gates=gates)
    backward([o, ht if case["output_final_state"] else None], cotangents)
    found = {n: reduction_scale(full[n].grad, (1, 1, *_per_gate(refs[n], r["g"]).shape)) for n in names}
    for n in shared:
        B, T, H, K = refs[n].shape
        found[n] = reduction_scale(full[n].grad.view(B, T, H, group, K), (B, T, H, 1, K), rms=True)
    if gates is not None:
        terms = torch.cat([torch.zeros_like(x) if x.grad is None else x.grad for x in gates], dim=-1)
        found["beta"] = reduction_scale(terms, (*beta.shape, 1))
    raise_floors(scales, found)
    return raise_floors(scales, _decay_scales(case, r, cu, cotangents, decay) if decay else {})


# The most blocks of channels a sum over key or value channels is split into for its terms
# (``_channel_blocks``): up to this width every channel is a term; a wider sum is split into blocks of
# adjacent channels, a partial sum each (for terms that do not line up, of the same root-sum-square), which
# bounds a GPU case's oracle work.
MOST_TERM_BLOCKS = 16


def _channel_blocks(n: int) -> torch.Tensor:
    """``[blocks, n]`` float64 0/1 masks of at most ``MOST_TERM_BLOCKS`` blocks of adjacent channels of ``n``."""
    blocks = min(n, MOST_TERM_BLOCKS)
    which = torch.arange(n) * blocks // n
    return (which[None] == torch.arange(blocks)[:, None]).double()


def output_term_sizes(case: dict, r: dict, cu: torch.Tensor | None) -> torch.Tensor:
    """The root-sum-square of the output's terms ``scale q_c S[c, :]`` over the key channels ``c`` (in blocks,
    ``_channel_blocks``), float64, in the output's shape. The output is linear in q as the kernels read it
    (after the l2norm), so a block's terms are the oracle's output with q masked to the block. At one
    token ``o = scale (q . k) beta v``, and where ``q . k`` cancels, the output's error is the rounding of
    its terms, not of itself."""
    q, k = read_rows(case, r)
    plain = {n: None if t is None else t.detach() for n, t in r.items()} | {"k": k.detach()}
    squares = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for block in _channel_blocks(q.shape[-1]):
            o, _ = _oracle({**case, "l2norm": False}, plain | {"q": q.detach() * block}, cu)
            squares = squares + o.pow(2)
    return squares.sqrt()


def _term_scales(case: dict, refs: dict, cu: torch.Tensor | None, cotangents: list) -> dict[str, float]:
    """Every input's gradient at the RMS of its terms' root-sum-squares (``gradient_term_sizes``;
    ``reduction_scale(rms=True)``'s measure)."""
    sizes = gradient_term_sizes(case, refs, cu, cotangents)
    return {n: reduction_scale(size, size.shape, rms=True) for n, size in sizes.items()}


def gradient_term_sizes(case: dict, refs: dict, cu: torch.Tensor | None, cotangents: list
                        ) -> dict[str, torch.Tensor]:
    """Every input's gradient at the size of its terms, element by element: the largest of its terms per value
    channel (``value_channel_term_sizes``), per key channel of q (``key_channel_term_sizes``) and, for the log
    decay's inputs, those the chunked backward sums into the log decay's gradient
    (``decay_input_term_sizes``)."""
    sizes = value_channel_term_sizes(case, refs, cu, cotangents)
    for more in (key_channel_term_sizes, decay_input_term_sizes):
        for n, size in more(case, refs, cu, cotangents).items():
            sizes[n] = torch.maximum(sizes[n], size) if n in sizes else size
    return sizes


def decay_input_term_sizes(case: dict, refs: dict, cu: torch.Tensor | None, cotangents: list
                           ) -> dict[str, torch.Tensor]:
    """The log decay's inputs given per element (``g``, a raw gate input too, and ``gk``, those of ``refs`` that
    require a gradient) at the size of the terms the chunked backward sums into the log decay's gradient
    (``decay_term_sizes``): at each input element the root-sum-square of each decay element's size times its
    derivative by that input element. At one token without an initial state the log decay's gradient is 0, and
    the kernels' is the rounding of those terms, which a layer carries on to the parameters it forms ``g``
    from (``lamina.fuzz.layers._input_scales``)."""
    names = [n for n in ("g", "gk") if refs.get(n) is not None and refs[n].requires_grad]
    if not names:
        return {}
    r = {n: None if t is None else t.detach() for n, t in refs.items()}
    size = decay_term_sizes(case, r, cu, cotangents)
    leaves = {n: r[n].clone().requires_grad_() for n in names}
    decay = _log_decay(case, r | leaves)
    sizes = {}
    for n, x in leaves.items():
        # each decay element depends on one element of x, so sum_e (size_e J_ej)^2 = [J^T (size^2 * J 1)]_j,
        # with J 1 (the decay's slope by x, in the decay's shape) by the double-backward trick
        probe = torch.zeros_like(decay, requires_grad=True)
        (back,) = torch.autograd.grad(decay, x, probe, create_graph=True)
        (slope,) = torch.autograd.grad(back, probe, torch.ones_like(back))
        (squares,) = torch.autograd.grad(decay, x, size.pow(2) * slope, retain_graph=True)
        sizes[n] = squares.clamp(min=0).sqrt()
    return sizes


def key_channel_term_sizes(case: dict, refs: dict, cu: torch.Tensor | None, cotangents: list
                           ) -> dict[str, torch.Tensor]:
    """Every input's gradient as a sum of one term per key channel ``c`` of q (as the kernels read it, after
    the l2norm), and one for the final state: the output is linear in q, so ``<o, do>`` is the sum over the
    channels of ``<o, do>`` with q masked to each (in blocks, ``_channel_blocks``), and ``<ht, dht>`` does
    not depend on q. Every gradient that passes through ``P = scale q k^T`` sums its key channels there: at
    one token ``dv = scale (q . k) w do`` (w the write gate: beta outside GDN-2), and where ``q . k``
    cancels, the gradient's error is the rounding of its terms (and of q's and k's, which a layer forms in
    the activations' precision), not of itself. Here the terms' root-sum-square at each element, float64, in
    the input's shape; one backward of the oracle per block."""
    r = {n: None if t is None else t.detach().requires_grad_(t.requires_grad) for n, t in refs.items()}
    leaves = {n: t for n, t in r.items() if t is not None and t.requires_grad}
    q, k = read_rows(case, r)
    plain = {**case, "l2norm": False}
    squares: dict[str, torch.Tensor] = {}

    def add(grads) -> None:
        for n, g in zip(leaves, grads):
            if g is not None:
                squares[n] = squares.get(n, 0.0) + g.pow(2)

    state = case["output_final_state"] and cotangents[1] is not None
    for i, block in enumerate(_channel_blocks(q.shape[-1])):
        o, ht = _oracle(plain, r | {"q": q * block, "k": k}, cu)
        # the final state's term once (the first block's forward has it as every block's has)
        for out, c in [(o, cotangents[0])] + ([(ht, cotangents[1])] if state and i == 0 else []):
            add(torch.autograd.grad(out, list(leaves.values()), c.to(torch.float64), retain_graph=True,
                                    allow_unused=True))
    return {n: sq.sqrt() for n, sq in squares.items()}


def value_channel_term_sizes(case: dict, refs: dict, cu: torch.Tensor | None, cotangents: list
                             ) -> dict[str, torch.Tensor]:
    """Every input's gradient as a sum of one term per value channel ``c``: the gradient of
    ``<o[..., c], do[..., c]> + <ht[..., c], dht[..., c]>`` (the value columns of the state evolve apart, so
    these parts sum to the loss). The kernels' products over V (``dO S0^T``, ``dO U^T``, ``dR U^T``) round
    each term, so where the terms cancel (q's and k's at T = 1: ``k`` times one sum over the channels of the
    new values times dO) the gradient is compared at the size of its terms: here their root-sum-square at
    each element, float64, in the input's shape. For a value-side input (v, w, the initial state) each
    element has one term, and the size is the gradient's own magnitude. All channels in one batched backward
    of the oracle (``is_grads_batched``), in at most ``MOST_TERM_BLOCKS`` blocks of channels."""
    r = {n: None if t is None else t.detach().requires_grad_(t.requires_grad) for n, t in refs.items()}
    leaves = {n: t for n, t in r.items() if t is not None and t.requires_grad}
    o, ht = _oracle(case, r, cu)
    pairs = [(o, cotangents[0], o.dim() - 1)]
    if case["output_final_state"] and cotangents[1] is not None:
        pairs.append((ht, cotangents[1], ht.dim() - (2 if case["state_v_first"] else 1)))
    blocks = _channel_blocks(o.shape[-1])

    def per_channel(c: torch.Tensor, axis: int) -> torch.Tensor:  # [blocks, *c.shape]: c masked to each block
        mask = blocks.view(len(blocks), *[blocks.shape[1] if d == axis else 1 for d in range(c.dim())])
        return c.to(torch.float64)[None] * mask

    grads = torch.autograd.grad([out for out, _, _ in pairs], list(leaves.values()),
                                [per_channel(c, axis) for _, c, axis in pairs], is_grads_batched=True,
                                allow_unused=True)
    return {n: g.pow(2).sum(0).sqrt() for n, g in zip(leaves, grads) if g is not None}


def decay_term_sizes(case: dict, r: dict, cu: torch.Tensor | None, cotangents: list) -> torch.Tensor:
    """The root-sum-square of the terms the chunked backward sums into the log decay's gradient at each of
    its elements (``_decay_scales``), float64, in the log decay's shape."""
    q, k = read_rows(case, r)
    group = r["v"].shape[2] // r["q"].shape[2]
    rows = {n: x.detach().repeat_interleave(group, dim=2).requires_grad_() for n, x in (("q", q), ("k", k))}
    o, ht = _oracle({**case, "l2norm": False}, {n: None if t is None else t.detach() for n, t in r.items()} | rows,
                    cu)
    backward([o, ht if case["output_final_state"] else None], cotangents)
    size = sum((x.detach() * x.grad).pow(2) for x in rows.values() if x.grad is not None)
    if _log_decay(case, r).dim() == 3:
        size = size.sum(-1)
    return size.sqrt()


# The inputs the log decay is formed from (``_log_decay``).
_GATE_INPUTS = ("g", "gk", "A_log", "dt_bias")


def _decay_scales(case: dict, r: dict, cu: torch.Tensor | None, cotangents: list,
                  names: list[str]) -> dict[str, float]:
    """The scales of the gate inputs ``names`` from the terms the chunked backward sums into the log decay's
    gradient (kernels/delta_chunk_bwd.py): ``q_c dq_c + E_c dE_c - k_c dk_c`` per key channel, for each
    value head, with q and k as the kernels read them (after the l2norm). At one token without an initial
    state these cancel to 0 exactly, and the kernels' dg is their rounding, above the call's floor. The
    size of the terms at each element of the log decay is the root-sum-square of ``q dq`` and ``k dk``
    (``dk`` includes the erase term), over the key channels for a decay per head; an input's terms are
    those sizes times its element's derivative of the log decay, compared at the RMS of their
    root-sum-squares (``reduction_scale(rms=True)``; the largest would loosen dt_bias, of H x K
    elements, by its peak-to-RMS ratio). The later tokens
    of the chunk that the reverse cumulative sum adds are left out, which leaves the scale smaller. An element below
    the chunked forms' floor has no terms: no gradient passes the floor (``floor_grad`` in
    kernels/delta_chunk_common.py; the PyTorch path's clamp), so its rounding reaches no input."""
    size = decay_term_sizes(case, r, cu, cotangents)
    decay = _log_decay(case, r)

    def laid(n: str) -> tuple[int, ...]:  # the input's shape, aligned against the log decay's
        shape = r[n].shape if n in ("g", "gk") else (1, 1, *_per_gate(r[n], r["g"]).shape)
        return (*shape, *[1] * (decay.dim() - len(shape)))

    # each input broadcast to the decay's shape, so that every element of it reaches one element of the decay
    full = {n: r[n].reshape(laid(n)).expand(decay.shape).clone().requires_grad_() for n in names}
    decay = _log_decay(case, r | full)
    decay.backward((decay >= LOG_DECAY_FLOOR).to(decay.dtype))
    return {n: reduction_scale(size * full[n].grad, laid(n), rms=True) for n in names}


def _compare(case: dict, x: dict, refs: dict, outs: tuple, outs_ref: tuple, scales: dict[str, float],
             base: dict | None = None, outs_base: tuple = (None, None)) -> None:
    dtype = DTYPES[case["dtype"]]
    (o, ht), (o_ref, ht_ref), (o_b, ht_b) = outs, outs_ref, outs_base
    assert_close("o", o, o_ref, dtype=dtype, baseline=o_b, scale=scales.get("o"))
    if case["output_final_state"]:
        if ht is None:
            raise AssertionError("final_state: None with output_final_state=True")
        assert_close("final_state", ht, ht_ref, dtype=dtype, baseline=ht_b)
    elif ht is not None:
        raise AssertionError("final_state: returned with output_final_state=False")
    if case["grad"]:
        compare_grads(x, refs, {name: ("recurrence", dtype) for name in x}, base, scales)
