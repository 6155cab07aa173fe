"""The path ``prism_attention(..., backend="auto")`` takes on CUDA, per call.

Paths: lamina's Triton kernel (``"lamina"``: every head dim 16..512, varlen, lse, any length), and where
they can run the case, FlashAttention 2 (``"flash-attn"``, when installed) and PyTorch's SDPA backends
(``"sdpa-flash"``, ``"sdpa-cudnn"``, ``"sdpa-efficient"``, ``"sdpa-math"``). The choice comes from a
decision table measured on a GPU by ``benchmarks/sweep_attention.py``: for each (dtype, head dim,
causal, forward or forward+backward) the fastest path of that sweep. A case the table does not name
(another head dim, dtype or mode), or that the named path cannot run, takes lamina's kernel.

What each outside path is allowed to run, so that results keep ``prism_attention``'s semantics:

* no varlen (``cu_seqlens``) and no ``return_lse``: lamina's kernel runs those;
* a sliding window (``window_size``) or softcapping (``softcap``): FlashAttention only (the same names and
  semantics), and only where the table names FlashAttention for the same case without them (the sweep
  times the plain case); elsewhere lamina's kernel, since SDPA has neither option;
* causal only when ``T == S`` for SDPA (its ``is_causal`` aligns top-left; lamina and FlashAttention
  >= 2.1 align bottom-right: the same mask when ``T == S``);
* FlashAttention and SDPA's flash and cuDNN backends: float16/bfloat16 only; head dims as the sweep
  found them to run (a path that failed at a head dim in the sweep is never in the table there);
* GQA through SDPA's ``enable_gqa`` and FlashAttention's native key heads;
* FlashAttention from 2.6 (softcapping; causal masks aligned bottom-right since 2.1, windows since 2.3).

The table ships as ``lamina/data/attention_dispatch.json`` once a GPU sweep is committed; without it
every call takes lamina's kernel (``lamina info`` says which). ``LAMINA_ATTENTION_TABLE=path`` loads
another table (a sweep's own output, before it is committed).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lamina._versions import release

PATHS = ("lamina", "flash-attn", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}
# Paths that take float16/bfloat16 only.
HALF_ONLY = ("flash-attn", "sdpa-flash", "sdpa-cudnn")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
TABLE_FILE = Path(__file__).resolve().parent.parent / "data" / "attention_dispatch.json"
TABLE_ENV = "LAMINA_ATTENTION_TABLE"
SCHEMA = 1
FLASH_ATTN_OLDEST = (2, 6)


@dataclass(frozen=True)
class Case:
    """What the choice depends on, read from one call's arguments."""

    dtype: str
    head_dim: int
    causal: bool
    seqlen_q: int
    seqlen_k: int
    varlen: bool
    need_lse: bool
    needs_grad: bool
    window: bool = False
    softcap: bool = False

    @property
    def mode(self) -> str:
        return "fwd+bwd" if self.needs_grad else "fwd"


def case_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, varlen: bool, need_lse: bool,
            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Case:
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return Case(DTYPE_NAMES.get(q.dtype, str(q.dtype)), q.shape[-1], bool(causal), q.shape[1], k.shape[1],
                bool(varlen), bool(need_lse), needs_grad, tuple(window_size) != (-1, -1), softcap > 0)


def table_key(dtype: str, head_dim: int, causal: bool, mode: str) -> str:
    return f"{dtype} D={head_dim} {'causal' if causal else 'full'} {mode}"


@dataclass(frozen=True)
class DispatchTable:
    """``entries``: ``table_key(...) -> path``; ``source``: where the measurements come from (GPU, commit, file)."""

    entries: dict[str, str]
    source: str = "none"

    def path_for(self, case: Case) -> str | None:
        return self.entries.get(table_key(case.dtype, case.head_dim, case.causal, case.mode))

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "source": self.source, "entries": dict(sorted(self.entries.items()))}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "table") -> DispatchTable:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
            raise ValueError(f"{where}: not an attention dispatch table of schema {SCHEMA}")
        unknown = sorted({p for p in data["entries"].values() if p not in PATHS})
        if unknown:
            raise ValueError(f"{where}: unknown paths {unknown}; known: {PATHS}")
        return cls(dict(data["entries"]), str(data.get("source", where)))


EMPTY = DispatchTable({}, "no GPU sweep committed: lamina's kernel at every head dim")


@functools.cache
def load_table(path: str | None = None) -> DispatchTable:
    """The table in ``path``, else ``$LAMINA_ATTENTION_TABLE``, else the packaged one, else ``EMPTY``."""
    chosen = path or os.environ.get(TABLE_ENV)
    file = Path(chosen) if chosen else TABLE_FILE
    if not file.is_file():
        if chosen:
            raise FileNotFoundError(f"{TABLE_ENV}: no attention dispatch table at {file}")
        return EMPTY
    return DispatchTable.from_json(json.loads(file.read_text()), str(file))


@functools.cache
def available(device_type: str) -> frozenset[str]:
    """The paths this installation can run on ``device_type`` tensors (outside paths: CUDA only)."""
    if device_type != "cuda":
        return frozenset({"lamina"})
    paths = {"lamina", *SDPA_BACKENDS}
    if importlib.util.find_spec("flash_attn") is not None and _version("flash-attn") >= FLASH_ATTN_OLDEST:
        paths.add("flash-attn")
    return frozenset(paths)


def _version(dist: str) -> tuple[int, ...]:
    """An installed distribution's numeric release; () when it is not installed."""
    try:
        return release(importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return ()


def unsupported(path: str, case: Case) -> str | None:
    """Why ``path`` cannot run ``case`` with ``prism_attention``'s semantics, or None."""
    if path == "lamina":
        return None
    if path not in PATHS:
        return f"unknown path {path!r}"
    if case.varlen:
        return "varlen (cu_seqlens) runs on lamina's kernel"
    if case.need_lse:
        return "return_lse runs on lamina's kernel"
    if (case.window or case.softcap) and path != "flash-attn":
        return "a window or softcapping runs on lamina's kernel or FlashAttention"
    if path in HALF_ONLY and case.dtype not in ("fp16", "bf16"):
        return f"{path} takes float16/bfloat16, got {case.dtype}"
    if path.startswith("sdpa") and case.causal and case.seqlen_q != case.seqlen_k:
        return "SDPA's causal mask aligns top-left: with T != S only lamina and FlashAttention align bottom-right"
    return None


def choose(case: Case, table: DispatchTable, paths: frozenset[str]) -> str:
    """The table's path for ``case`` when it is available and can run it; lamina's kernel otherwise."""
    path = table.path_for(case)
    if path is None or path not in paths or unsupported(path, case) is not None:
        return "lamina"
    return path


def run(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> torch.Tensor:
    """Attention of ``[B, T, H, D]`` q and ``[B, S, HKV, D]`` k, v through an outside ``path`` (differentiable);
    ``window_size`` and ``softcap`` (FlashAttention's arguments) on ``"flash-attn"`` only."""
    if path == "flash-attn":
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=tuple(window_size),
                               softcap=softcap)
    if path not in SDPA_BACKENDS:
        raise ValueError(f"path must be one of {tuple(SDPA_BACKENDS)} or 'flash-attn', got {path!r}")
    if tuple(window_size) != (-1, -1) or softcap:
        raise ValueError(f"{path}: SDPA has no sliding window or softcapping; run them on 'flash-attn' or lamina")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[path])]):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                           enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def table_from_records(records: list[dict[str, Any]], source: str) -> DispatchTable:
    """The fastest ``ok`` path per (dtype, head dim, causal, mode) among a sweep's ``prism_attention`` records
    (provider ``lamina-triton`` is the path ``lamina``); a case lamina's kernel did not run is left out."""
    best: dict[str, tuple[float, str]] = {}
    lamina_ran: set[str] = set()
    for rec in records:
        if rec.get("kind") != "result" or rec.get("op") != "prism_attention" or rec.get("status") != "ok":
            continue
        p = rec["params"]
        if p["Tq"] != p["Tk"] or rec["mode"] not in ("fwd", "fwd+bwd"):
            continue
        # lamina's path on the sweep's device: its Triton kernel (lamina-torch: a CPU dry run)
        path = "lamina" if rec["provider"] in ("lamina-triton", "lamina-torch") else rec["provider"]
        if path not in PATHS:
            continue
        key = table_key(p["dtype"], p["D"], p["causal"], rec["mode"])
        if path == "lamina":
            lamina_ran.add(key)
        ms = float(rec["ms"])
        if key not in best or ms < best[key][0]:
            best[key] = (ms, path)
    return DispatchTable({key: path for key, (_, path) in best.items() if key in lamina_ran}, source)


def describe(table: DispatchTable | None = None) -> str:
    """The table as ``lamina info`` prints it."""
    table = table or load_table()
    lines = [f"attention dispatch (prism_attention backend='auto' on CUDA): {table.source}"]
    outside = {k: p for k, p in table.entries.items() if p != "lamina"}
    lines += [f"  {key}: {path}" for key, path in sorted(outside.items())]
    if table.entries:
        lines.append(f"  ({len(table.entries) - len(outside)} other measured cases and every unmeasured one: lamina)")
    return "\n".join(lines)


__all__ = ["EMPTY", "PATHS", "Case", "DispatchTable", "available", "case_of", "choose", "describe", "load_table",
           "run", "table_from_records", "unsupported"]
