"""``lamina fuzz``: random shapes, dtypes and options against the float64 references.

Each case ``i`` is drawn from ``torch.Generator`` seeded with ``seed + i``, so a failure
is reproduced by ``lamina fuzz --op <op> --seed <seed + i> --iters 1``. Bounds come from
``lamina.testing`` (the same table the tests use). Exit status 1 when any case fails.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lamina.testing import assert_attention_close, assert_close

DELTA_VARIANTS = ("delta_rule", "gated_delta_rule", "kda", "gdn2")
OPS = (*DELTA_VARIANTS, "prism_attention", "hrm_gated_update")


@dataclass
class FuzzLimits:
    """Largest shapes drawn; the interpreter gets small ones (it runs about 1e4x slower than a GPU)."""

    max_t: int
    dims: tuple[int, ...]
    attn_dims: tuple[int, ...]
    max_rows: int


CPU_LIMITS = FuzzLimits(max_t=80, dims=(16, 32, 48, 64), attn_dims=(16, 32, 48, 64, 96, 128), max_rows=64)
GPU_LIMITS = FuzzLimits(max_t=1100, dims=(32, 48, 64, 96, 128, 192, 256),
                        attn_dims=(16, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512), max_rows=4096)


def _pick_dtype(rng: random.Random, backend: str, device: str) -> torch.dtype:
    if device == "cpu" and backend == "torch":
        return torch.float32
    return rng.choice([torch.float32, torch.float16, torch.bfloat16])


def _delta_case(op: str, rng: random.Random, gen: torch.Generator, device: str, backend: str,
                limits: FuzzLimits, grad: bool) -> str:
    import lamina
    from lamina.reference import delta_rule_family_recurrent_ref

    H = rng.choice([1, 2])
    HV = H * rng.choice([1, 2])
    K, V = rng.choice(limits.dims), rng.choice(limits.dims)
    varlen = rng.random() < 0.3
    if varlen:
        lens = [rng.randint(1, limits.max_t) for _ in range(rng.randint(2, 3))]
        B, T = 1, sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        N = len(lens)
    else:
        B, T, cu = rng.choice([1, 2]), rng.randint(1, limits.max_t), None
        N = B
    dtype = _pick_dtype(rng, backend, device)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    q = r(B, T, H, K)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, HV, V)
    beta = torch.sigmoid(r(B, T, HV))
    h0 = r(N, HV, K, V) if rng.random() < 0.5 else None
    g = b = w = None
    if op == "gated_delta_rule":
        g = F.logsigmoid(r(B, T, HV) + 2)
    elif op in ("kda", "gdn2"):
        g = F.logsigmoid(r(B, T, HV, K) + 2) * rng.choice([1.0, 4.0])
    if op == "gdn2":
        b, w = torch.sigmoid(r(B, T, HV, K)), torch.sigmoid(r(B, T, HV, V))
        beta = None

    q, k, v = (x.to(dtype) for x in (q, k, v))
    beta = beta.to(dtype) if beta is not None else None
    g = g.float() if g is not None else None
    b, w = (x.to(dtype) if x is not None else None for x in (b, w))
    h0 = h0.float() if h0 is not None else None
    inputs = [x for x in (q, k, v, g, beta, b, w, h0) if x is not None]
    if grad:
        for x in inputs:
            x.requires_grad_(True)

    common = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend)
    if op == "delta_rule":
        o, ht = lamina.chunk_delta_rule(q, k, v, beta, **common)
    elif op == "gated_delta_rule":
        o, ht = lamina.chunk_gated_delta_rule(q, k, v, g, beta, **common)
    elif op == "kda":
        o, ht = lamina.chunk_kda(q, k, v, g, beta, **common)
    else:
        o, ht = lamina.chunk_gdn2(q, k, v, g, b, w, **common)

    ref_in = {name: (x.detach().double().requires_grad_(grad) if x is not None else None)
              for name, x in dict(q=q, k=k, v=v, g=g, beta=beta, b=b, w=w, h0=h0).items()}
    erase = ref_in["b"] if op == "gdn2" else ref_in["beta"]
    write = ref_in["w"] if op == "gdn2" else ref_in["beta"]
    o_ref, ht_ref = delta_rule_family_recurrent_ref(
        ref_in["q"], ref_in["k"], ref_in["v"], g=ref_in["g"], erase=erase, write=write,
        initial_state=ref_in["h0"], output_final_state=True, cu_seqlens=cu)
    assert_close("o", o, o_ref, dtype=dtype)
    assert_close("final_state", ht, ht_ref, dtype=dtype)
    if grad:
        do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device)
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(device)
        torch.autograd.backward((o, ht), (do.to(o.dtype), dht.to(ht.dtype)))
        torch.autograd.backward((o_ref, ht_ref), (do, dht))
        for name, x in dict(q=q, k=k, v=v, g=g, beta=beta, b=b, w=w, h0=h0).items():
            if x is not None:
                assert_close(f"d{name}", x.grad, ref_in[name].grad, dtype=dtype)
    return f"B={B} T={T} H={H} HV={HV} K={K} V={V} varlen={varlen} h0={h0 is not None} {str(dtype)[6:]}"


def _attention_case(rng: random.Random, gen: torch.Generator, device: str, backend: str,
                    limits: FuzzLimits, grad: bool) -> str:
    import lamina
    from lamina.reference import attention_ref

    HKV = rng.choice([1, 2])
    H = HKV * rng.choice([1, 2])
    D = rng.choice(limits.attn_dims)
    B, T, S = rng.choice([1, 2]), rng.randint(1, limits.max_t), rng.randint(1, limits.max_t)
    causal = rng.random() < 0.5
    dtype = _pick_dtype(rng, backend, device)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64).to(device)
    k = torch.randn(B, S, HKV, D, generator=gen, dtype=torch.float64).to(device)
    v = torch.randn(B, S, HKV, D, generator=gen, dtype=torch.float64).to(device)
    lowp = [x.to(dtype).requires_grad_(grad) for x in (q, k, v)]
    ref = [x.to(dtype).double().requires_grad_(grad) for x in (q, k, v)]
    torch_lowp = [x.to(dtype).requires_grad_(grad) for x in (q, k, v)]
    o = lamina.prism_attention(*lowp, causal=causal, backend=backend)
    o_ref = attention_ref(*ref, causal=causal)
    o_torch = attention_ref(*torch_lowp, causal=causal)
    assert_attention_close("o", o, o_ref, o_torch, dtype=dtype)
    if grad:
        do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device)
        o.backward(do.to(dtype))
        o_ref.backward(do)
        o_torch.backward(do.to(dtype))
        for name, a, r, p in zip("qkv", lowp, ref, torch_lowp):
            assert_attention_close(f"d{name}", a.grad, r.grad, p.grad, grad=True, dtype=dtype)
    return f"B={B} T={T} S={S} H={H} HKV={HKV} D={D} causal={causal} {str(dtype)[6:]}"


def _hrm_case(rng: random.Random, gen: torch.Generator, device: str, backend: str,
              limits: FuzzLimits, grad: bool) -> str:
    import lamina
    from lamina.reference import hrm_gated_update_ref

    rows, D = rng.randint(1, limits.max_rows), rng.choice([8, 24, 64, 100, 256])
    per_token = rng.random() < 0.3
    use_bias, use_norm = rng.random() < 0.5, rng.random() < 0.5
    dtype = _pick_dtype(rng, backend, device)
    G = 1 if per_token else D

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    args = [r(rows, D), r(rows, D), r(rows, G)]
    bias = r(G) if use_bias else None
    weight = (1 + 0.1 * r(D)) if use_norm else None
    low = [x.to(dtype).requires_grad_(grad) for x in args]
    low_b = bias.to(dtype).requires_grad_(grad) if bias is not None else None
    low_w = weight.to(dtype).requires_grad_(grad) if weight is not None else None
    ref = [x.to(dtype).double().requires_grad_(grad) for x in args]
    ref_b = bias.to(dtype).double().requires_grad_(grad) if bias is not None else None
    ref_w = weight.to(dtype).double().requires_grad_(grad) if weight is not None else None
    y = lamina.hrm_gated_update(*low, bias=low_b, norm_weight=low_w, backend=backend)
    y_ref = hrm_gated_update_ref(*ref, bias=ref_b, norm_weight=ref_w)
    assert_close("y", y, y_ref, kind="elementwise", dtype=dtype)
    if grad:
        dy = r(rows, D)
        y.backward(dy.to(dtype))
        y_ref.backward(dy)
        for name, a, b in zip(("h", "c", "gate", "bias", "norm_weight"), [*low, low_b, low_w], [*ref, ref_b, ref_w]):
            if a is not None:
                # gradients of reductions (bias, norm weight) sum `rows` rounded terms: compare as a recurrence
                kind = "recurrence" if name in ("bias", "norm_weight") or (name == "gate" and per_token) \
                    else "elementwise"
                assert_close(f"d{name}", a.grad, b.grad, kind=kind, dtype=dtype)
    return f"rows={rows} D={D} gate={'token' if per_token else 'channel'} bias={use_bias} norm={use_norm} " \
           f"{str(dtype)[6:]}"


def run_case(op: str, seed: int, device: str, backend: str, grad: bool) -> str:
    """Run fuzz case ``seed`` of ``op``; raises AssertionError on a mismatch. Returns a description."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    limits = GPU_LIMITS if device == "cuda" else CPU_LIMITS
    if op in DELTA_VARIANTS:
        return _delta_case(op, rng, gen, device, backend, limits, grad)
    if op == "prism_attention":
        return _attention_case(rng, gen, device, backend, limits, grad)
    if op == "hrm_gated_update":
        return _hrm_case(rng, gen, device, backend, limits, grad)
    raise ValueError(f"--op must be one of {OPS} or 'all', got {op!r}")


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="lamina fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="all", help=f"one of {', '.join(OPS)} or 'all'")
    parser.add_argument("--iters", type=int, default=5, help="cases per op")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "cuda", "torch"])
    parser.add_argument("--no-grad", action="store_true", help="check outputs only")
    args = parser.parse_args(argv)
    ops = OPS if args.op == "all" else (args.op,)
    if args.op != "all" and args.op not in OPS:
        parser.error(f"--op must be one of {', '.join(OPS)} or 'all', got {args.op!r}")
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    failures = 0
    total = 0
    for op in ops:
        for i in range(args.iters):
            seed = args.seed + i
            total += 1
            start = time.perf_counter()
            try:
                desc = run_case(op, seed, args.device, args.backend, not args.no_grad)
                log(f"ok    {op:<18} seed={seed:<6} {desc} ({time.perf_counter() - start:.2f} s)")
            except AssertionError as exc:
                failures += 1
                log(f"FAIL  {op:<18} seed={seed:<6} {exc}")
                log(f"      reproduce: lamina fuzz --op {op} --seed {seed} --iters 1 --device {args.device} "
                    f"--backend {args.backend}")
            except Exception:  # noqa: BLE001 - a crash is a failure with its traceback
                failures += 1
                log(f"ERROR {op:<18} seed={seed:<6}\n{traceback.format_exc()}")
    log(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
