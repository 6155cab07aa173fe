"""``lamina bench context-parallel``: how context parallelism scales with the number of ranks.

For each rank count it starts that many processes (gloo on CPU; NCCL on CUDA, one GPU per rank),
splits one sequence of ``tokens`` tokens across them with ``lamina.distributed.ContextParallel``
and times forward + backward of each op on its shard: milliseconds per step (the slowest rank's
median), microseconds per token of the whole sequence, and the bytes each rank's collectives
exchanged per step. One rank is the op without a context, for the baseline.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

CP_OPS = ("chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2", "chunk_delta_rule", "prism_attention")


def _inputs(op: str, tokens: int, heads: int, dim: int, device: torch.device, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    u = lambda *shape: torch.rand(*shape, generator=gen).to(device, dtype)  # noqa: E731
    shape = (1, tokens, heads, dim)
    x = {"q": r(*shape), "k": r(*shape), "v": r(*shape)}
    if op == "prism_attention":
        return x
    x["q"], x["k"] = (torch.nn.functional.normalize(x[n], dim=-1) for n in ("q", "k"))
    if op == "chunk_delta_rule":
        x["beta"] = u(1, tokens, heads)
    elif op == "chunk_gated_delta_rule":
        x.update(g=-u(1, tokens, heads) * 0.1, beta=u(1, tokens, heads))
    elif op == "chunk_kda":
        x.update(g=-u(*shape) * 0.1, beta=u(1, tokens, heads))
    else:
        x.update(g=-u(*shape) * 0.1, b=u(*shape), w=u(*shape))
    return x


def _step(op: str, x: dict, cp) -> None:
    import lamina

    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    extra = {"causal": True} if op == "prism_attention" else {}
    out = getattr(lamina, op)(**leaves, **extra, **({} if cp is None else {"cp_context": cp}))
    o = out if isinstance(out, torch.Tensor) else out[0]
    o.float().sum().backward()


def _worker(rank: int, world: int, rendezvous: str, args: dict, out_file: str) -> None:
    import torch.distributed as dist

    from lamina.distributed import ContextParallel, traffic_bytes

    cuda = args["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, args["threads"] // world))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        cp = ContextParallel(layout=args["layout"]) if world > 1 else None
        dtype = torch.bfloat16 if cuda else torch.float32
        for op in args["ops"]:
            full = _inputs(op, args["tokens"], args["heads"], args["dim"], device, dtype)
            mine = {n: cp.shard(t).contiguous() if cp else t for n, t in full.items()}
            _step(op, mine, cp)  # warm-up (compiles kernels)
            times = []
            traffic_bytes(reset=True)
            for _ in range(args["repeats"]):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                _step(op, mine, cp)
                if cuda:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            times.sort()
            spread = [statistics.median(times), times[int(0.2 * (len(times) - 1))],
                      times[round(0.8 * (len(times) - 1))]]
            sent = traffic_bytes(reset=True) / args["repeats"]
            if world > 1:  # the slowest rank's
                worst = torch.tensor(spread, device=device, dtype=torch.float64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                spread = worst.tolist()
            ms = spread[0]
            if rank == 0:
                dt = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
                record = {"kind": "result", "op": op, "provider": f"lamina-cp{world}", "mode": "fwd+bwd",
                          "layout": args["layout"],
                          "status": "ok", "device": str(device.type), "ms": ms, "ms_p20": spread[1],
                          "ms_p80": spread[2], "runs": len(times), "dtype": dt,
                          "shape": f"1x{args['tokens']}x{args['heads']}x{args['dim']} {dt}",
                          "params": {"ranks": world, "tokens": args["tokens"], "heads": args["heads"],
                                     "dim": args["dim"], "dtype": dt},
                          "us_per_token": ms * 1e3 / args["tokens"], "comm_bytes_per_rank": sent}
                with open(out_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_scaling(ops: list[str], ranks: list[int], device: str, tokens: int, heads: int, dim: int,
                repeats: int, threads: int, layout: str = "contiguous") -> list[dict]:
    """Records of each op at each rank count (``ranks``), in order, with the context's ``layout``."""
    import torch.multiprocessing as mp

    from lamina.bench.results import environment

    unknown = [op for op in ops if op not in CP_OPS]
    if unknown:
        raise ValueError(f"op: {unknown} not among {CP_OPS}")
    for world in ranks:
        segments = world * (2 if layout == "zigzag" else 1)
        if world < 1 or tokens % segments:
            raise ValueError(f"ranks: {world} ranks ({segments} segments, {layout} layout) do not divide the "
                             f"{tokens} tokens")
        if device == "cuda" and world > torch.cuda.device_count():
            raise ValueError(f"ranks: {world} needs {world} GPUs (one per rank), {torch.cuda.device_count()} here")
    args = {"ops": ops, "device": device, "tokens": tokens, "heads": heads, "dim": dim, "repeats": repeats,
            "threads": threads, "layout": layout}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.jsonl"
        out.touch()
        for world in ranks:
            mp.spawn(_worker, args=(world, os.path.join(tmp, f"rendezvous-{world}"), args, str(out)),
                     nprocs=world, join=True)
        env = environment(device)  # commit, versions, device name, threads
        return [{**json.loads(line), "env": env} for line in out.read_text().splitlines()]


def format_table(records: list[dict]) -> str:
    lines = [f"{'op':<24} {'ranks':>5} {'ms/step':>10} {'us/token':>10} {'vs 1 rank':>9} {'comm MB/rank':>13}"]
    base = {r["op"]: r["ms"] for r in records if r["params"]["ranks"] == 1}
    for r in records:
        speed = f"{base[r['op']] / r['ms']:.2f}x" if r["op"] in base else "-"
        lines.append(f"{r['op']:<24} {r['params']['ranks']:>5} {r['ms']:>10.2f} {r['us_per_token']:>10.3f} "
                     f"{speed:>9} {r['comm_bytes_per_rank'] / 1e6:>13.3f}")
    return "\n".join(lines)


__all__ = ["CP_OPS", "format_table", "run_scaling"]
