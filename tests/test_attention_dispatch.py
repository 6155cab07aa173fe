"""prism_attention's per-call dispatch (lamina.ops.attention_dispatch) on CPU with fake tables and
capabilities: the choice per case, the outside paths that run on CPU against the float64 reference
(forward and gradients), the table built from sweep records, loading, and the call through
prism_attention(backend="auto")."""

from __future__ import annotations

import json

import pytest
import torch

from lamina.ops import attention_dispatch as dispatch
from lamina.ops.prism_attention import prism_attention
from lamina.reference import attention_ref
from lamina.testing import assert_close, gradient_scale

ALL = frozenset(dispatch.PATHS)


def _case(**kw):
    base = dict(dtype="bf16", head_dim=128, causal=True, seqlen_q=256, seqlen_k=256, varlen=False, need_lse=False,
                needs_grad=True)
    return dispatch.Case(**{**base, **kw})


def test_choice_follows_the_table_where_the_path_can_run_the_case():
    table = dispatch.DispatchTable({dispatch.table_key("bf16", 128, True, "fwd+bwd"): "sdpa-flash",
                                    dispatch.table_key("bf16", 128, False, "fwd"): "flash-attn",
                                    dispatch.table_key("fp32", 64, True, "fwd"): "sdpa-cudnn",
                                    dispatch.table_key("bf16", 96, True, "fwd"): "sdpa-efficient"})
    assert dispatch.choose(_case(), table, ALL) == "sdpa-flash"
    assert dispatch.choose(_case(causal=False, needs_grad=False), table, ALL) == "flash-attn"
    # not in the table: another head dim, or the same one in another mode
    assert dispatch.choose(_case(head_dim=192), table, ALL) == "lamina"
    assert dispatch.choose(_case(needs_grad=False), table, ALL) == "lamina"
    # in the table but the path cannot give prism_attention's result for this call
    assert dispatch.choose(_case(varlen=True), table, ALL) == "lamina"
    assert dispatch.choose(_case(need_lse=True), table, ALL) == "lamina"
    assert dispatch.choose(_case(seqlen_q=1, seqlen_k=256), table, ALL) == "lamina"  # SDPA's top-left causal
    assert dispatch.choose(_case(dtype="fp32", head_dim=64, needs_grad=False), table, ALL) == "lamina"  # half only
    # FlashAttention aligns causal masks bottom-right as lamina does: T != S is fine
    flash = dispatch.DispatchTable({dispatch.table_key("bf16", 128, True, "fwd"): "flash-attn"})
    assert dispatch.choose(_case(seqlen_q=1, needs_grad=False), flash, ALL) == "flash-attn"
    # a path this installation lacks
    assert dispatch.choose(_case(causal=False, needs_grad=False), table, ALL - {"flash-attn"}) == "lamina"
    assert dispatch.choose(_case(), dispatch.EMPTY, ALL) == "lamina"
    assert dispatch.available("cpu") == frozenset({"lamina"})


@pytest.mark.parametrize("path", ["sdpa-flash", "sdpa-math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [64, 80])
def test_outside_paths_on_cpu_equal_the_reference(path, causal, D):
    """The SDPA backends that run on CPU, through dispatch.run's layout and GQA: forward and every
    gradient against the float64 reference (T == S, as the dispatcher requires for SDPA's causal)."""
    gen = torch.Generator().manual_seed(D)
    q = torch.randn(2, 33, 4, D, generator=gen, requires_grad=True)
    k = torch.randn(2, 33, 2, D, generator=gen, requires_grad=True)
    v = torch.randn(2, 33, 2, D, generator=gen, requires_grad=True)
    o = dispatch.run(path, q, k, v, causal, D ** -0.5)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attention_ref(q64, k64, v64, causal=causal)
    assert_close("o", o, ref)
    do = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(o, (q, k, v), do.float())
    refs = torch.autograd.grad(ref, (q64, k64, v64), do)
    for name, got, want in zip("qkv", grads, refs):
        assert_close(f"d{name}", got, want, scale=gradient_scale(list(refs)))


def test_table_from_sweep_records_keeps_the_fastest_path_where_lamina_ran():
    def rec(provider, D, causal, mode, ms, status="ok", Tk=4096):
        return {"kind": "result", "op": "prism_attention", "status": status, "provider": provider, "mode": mode,
                "ms": ms, "params": {"D": D, "causal": causal, "dtype": "bf16", "Tq": 4096, "Tk": Tk}}

    records = [rec("lamina-triton", 128, True, "fwd", 1.0), rec("sdpa-flash", 128, True, "fwd", 0.8),
               rec("flash-attn", 128, True, "fwd", 0.9), rec("sdpa-cudnn", 128, True, "fwd", 0.5, status="error"),
               rec("lamina-triton", 512, True, "fwd", 2.0), rec("sdpa-efficient", 512, True, "fwd", 5.0),
               rec("sdpa-flash", 256, False, "fwd", 1.0),  # lamina did not run this case: left out
               rec("lamina-triton", 64, True, "fwd", 1.0), rec("sdpa-flash", 64, True, "fwd", 0.1, Tk=1),
               {"kind": "ceiling"}]
    table = dispatch.table_from_records(records, "test")
    assert table.entries == {dispatch.table_key("bf16", 128, True, "fwd"): "sdpa-flash",
                             dispatch.table_key("bf16", 512, True, "fwd"): "lamina",
                             dispatch.table_key("bf16", 64, True, "fwd"): "lamina"}
    assert "bf16 D=128 causal fwd: sdpa-flash" in dispatch.describe(table)


def test_table_file_round_trip_and_bad_tables(tmp_path, monkeypatch):
    table = dispatch.DispatchTable({dispatch.table_key("bf16", 96, False, "fwd"): "sdpa-efficient"}, "unit test")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json()))
    dispatch.load_table.cache_clear()
    monkeypatch.setenv(dispatch.TABLE_ENV, str(path))
    try:
        assert dispatch.load_table() == table
    finally:
        dispatch.load_table.cache_clear()
    with pytest.raises(ValueError, match="unknown paths"):
        dispatch.DispatchTable.from_json({"schema": 1, "entries": {"x": "cutlass"}})
    with pytest.raises(ValueError, match="not an attention dispatch table"):
        dispatch.DispatchTable.from_json({"entries": {}})
    with pytest.raises(FileNotFoundError, match=dispatch.TABLE_ENV):
        dispatch.load_table(str(tmp_path / "missing.json"))


@pytest.mark.interpret
def test_prism_attention_auto_takes_the_tables_path(monkeypatch):
    """With a table that sends fp32 D=64 non-causal forward calls to SDPA's math backend, and that path made
    available on CPU, prism_attention(backend="auto") runs it (a spy sees the call) and gives the reference's
    result; a causal call (not in the table) and return_lse keep lamina's kernel (interpreted)."""
    table = dispatch.DispatchTable({dispatch.table_key("fp32", 64, False, "fwd"): "sdpa-math"}, "fake")
    monkeypatch.setattr(dispatch, "load_table", lambda: table)
    monkeypatch.setattr(dispatch, "available", lambda device_type: frozenset({"lamina", "sdpa-math"}))
    calls = []
    real_run = dispatch.run
    monkeypatch.setattr(dispatch, "run", lambda path, *a: calls.append(path) or real_run(path, *a))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 64, generator=gen) for _ in range(3))
    ref = attention_ref(q.double(), k.double(), v.double(), causal=False)
    with torch.no_grad():
        o = prism_attention(q, k, v, causal=False)
        assert calls == ["sdpa-math"]
        assert_close("o (sdpa-math)", o, ref)
        o_lamina, _ = prism_attention(q, k, v, causal=False, return_lse=True)
        o_causal = prism_attention(q, k, v, causal=True)
    assert calls == ["sdpa-math"]
    assert_close("o (lamina, lse)", o_lamina, ref)
    assert_close("o (lamina, causal)", o_causal, attention_ref(q.double(), k.double(), v.double(), causal=True))


def test_windows_and_softcapping_go_to_flash_attention_only():
    """A windowed or softcapped call follows the plain case's entry only when it names FlashAttention
    (SDPA has neither option); otherwise lamina's kernel."""
    flash = dispatch.DispatchTable({dispatch.table_key("bf16", 128, True, "fwd+bwd"): "flash-attn"})
    sdpa = dispatch.DispatchTable({dispatch.table_key("bf16", 128, True, "fwd+bwd"): "sdpa-cudnn"})
    for options in ({"window": True}, {"softcap": True}, {"window": True, "softcap": True}):
        assert dispatch.choose(_case(**options), flash, ALL) == "flash-attn"
        assert dispatch.choose(_case(**options), sdpa, ALL) == "lamina"
        assert dispatch.choose(_case(**options, varlen=True), flash, ALL) == "lamina"
    assert dispatch.choose(_case(), sdpa, ALL) == "sdpa-cudnn"
    with pytest.raises(ValueError, match="no sliding window"):
        dispatch.run("sdpa-math", *(torch.zeros(1, 4, 1, 16) for _ in range(3)), False, 0.25, window_size=(2, 0))


def test_case_of_reads_the_window_and_softcap():
    q = torch.zeros(1, 8, 2, 32)
    assert not dispatch.case_of(q, q, q, True, False, False).window
    case = dispatch.case_of(q, q, q, True, False, False, (16, 0), 0.0)
    assert case.window and not case.softcap
    assert dispatch.case_of(q, q, q, False, False, False, (-1, -1), 30.0).softcap


@pytest.mark.parametrize("text,parsed", [("2.6.3", (2, 6, 3)), ("2.8.0.post2", (2, 8, 0)),
                                         ("2.7.4+cu12torch2.6", (2, 7, 4)), ("3.0.0b1", (3, 0, 0))])
def test_flash_attention_version_parse(monkeypatch, text, parsed):
    monkeypatch.setattr(dispatch.importlib.metadata, "version", lambda dist: text)
    assert dispatch._version("flash-attn") == parsed


def test_flash_attention_older_than_2_6_is_not_a_path(monkeypatch):
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: object())
    for text, expected in (("2.5.9", False), ("2.6.0", True)):
        monkeypatch.setattr(dispatch.importlib.metadata, "version", lambda dist, text=text: text)
        dispatch.available.cache_clear()
        try:
            assert ("flash-attn" in dispatch.available("cuda")) is expected, text
        finally:
            dispatch.available.cache_clear()


@pytest.mark.interpret
def test_windowed_softcapped_auto_call_passes_both_to_flash_attention(monkeypatch):
    """prism_attention(backend="auto") with a window and softcap, where the (fake) table names FlashAttention:
    a stand-in flash_attn module receives window_size, softcap, causal and the scale unchanged (it answers
    with the float64 reference); an SDPA entry keeps lamina's kernel (interpreted), same result."""
    import sys
    import types

    received = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        received.append((softmax_scale, causal, window_size, softcap))
        return attention_ref(q.double(), k.double(), v.double(), causal=causal, scale=softmax_scale,
                             window_size=window_size, softcap=softcap).to(q.dtype)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    monkeypatch.setattr(dispatch, "available", lambda device_type: ALL)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 48, 4, 32, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 48, 2, 32, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True, scale=0.2, window_size=(7, -1),
                        softcap=5.0)
    for entry in ("flash-attn", "sdpa-flash"):
        table = dispatch.DispatchTable({dispatch.table_key("bf16", 32, True, "fwd"): entry}, "fake")
        monkeypatch.setattr(dispatch, "load_table", lambda table=table: table)
        with torch.no_grad():
            o = prism_attention(q, k, v, causal=True, scale=0.2, window_size=(7, -1), softcap=5.0)
        assert_close(f"o ({entry} entry)", o, ref)
    assert received == [(0.2, True, (7, -1), 5.0)]
