"""``mla bench`` on the CPU: its arguments, the shape listing, the bytes and FLOPs of a shape
worked by hand, the dry run's inputs and calls, the message without CUDA, a user's target."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch

import mla.reference as ref
from mla.bench import PRESETS, SHAPES, Shape, resolve_targets, select_shapes, work
from mla.bench.inputs import build_inputs
from mla.bench.shapes import FP8_KERNELS, row_ends, tiny
from mla.cli import main
from mla.cli.main import build_parser

USER = "bench_user_kernels"
USER_SOURCE = """
    import mla.reference as ref

    def my_merge(prefix_output, prefix_lse, suffix_output, suffix_lse):
        return ref.merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse)

    def broken_decode(*args, **kwargs):
        raise RuntimeError("not written yet")
"""


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --dry-run sets, kept per test


@pytest.fixture
def user_module(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / f"{USER}.py").write_text(textwrap.dedent(USER_SOURCE))
    monkeypatch.chdir(tmp_path)  # found from the working directory, as mla conform finds it
    return USER


def test_arguments_parse() -> None:
    args = build_parser().parse_args(
        ["bench", "--target", "reference", "--kernels", "merge_attn_states", "--shapes",
         "deepseek-v2", "deepseek-v3.2/decode-memory", "--warm", "--reps", "7",
         "--beside", "none", "--json", "r.json", "--out", "r.md", "--plot", "r.png"])
    assert args.target == "reference" and args.kernels == ["merge_attn_states"]
    assert args.shapes == ["deepseek-v2", "deepseek-v3.2/decode-memory"]
    assert args.warm and not args.eager and args.reps == 7 and args.beside == ["none"]
    assert (args.json, args.out, args.plot) == ("r.json", "r.md", "r.png")
    defaults = build_parser().parse_args(["bench", "--target", "mla.fast"])
    assert defaults.beside == ["mla.fast", "flashmla"] and defaults.dtype == "bfloat16"
    assert defaults.reps == 50 and not defaults.dry_run


@pytest.mark.parametrize("argv", [
    ["--reps", "0"], ["--dtype", "int8"], ["--beside", "vllm"], ["--shapes", "deepseek-v9"],
    ["--kernels", "cp_lse_ag_out_rs"], ["--kernels", "no_such_kernel"],
])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--target", "reference", "--dry-run", *argv])
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_target_required_unless_listing(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench"])
    assert e.value.code == 2 and "--target" in capsys.readouterr().err


def test_list_shapes(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--list-shapes"]) == 0
    out = capsys.readouterr().out
    assert PRESETS == ("deepseek-v2", "deepseek-v3", "deepseek-v3.2", "deepseek-v4")
    for s in SHAPES:
        assert s.name in out and s.kernel in out
    for preset in PRESETS:  # each preset: decode and prefill, memory- and compute-bound
        assert {s.name.split("/")[1] for s in SHAPES if s.preset == preset and not s.tag} == {
            "decode-memory", "decode-compute", "prefill-memory", "prefill-compute"}
    kernels = {s.kernel for s in SHAPES}
    assert {"mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill",
            "merge_attn_states", "top_k_per_row", "fp8_mqa_logits",
            "fp8_paged_mqa_logits"} <= kernels
    assert len({s.name for s in SHAPES}) == len(SHAPES)  # every name picks one shape
    # DeepSeek-V3.2's indexer: top-k 2048 over rows of 8K, 32K and 128K, 32 to 1024 rows
    topk = [s for s in SHAPES if s.kernel == "top_k_per_row"]
    assert {s.L for s in topk} == {8192, 32768, 131072} and {s.topk for s in topk} == {2048}
    assert min(s.B for s in topk) == 32 and max(s.B for s in topk) == 1024
    assert all(s.preset == "deepseek-v3.2" and s.N == 64 and s.D == 128
               for s in SHAPES if s.kernel in FP8_KERNELS)
    assert {s.phase for s in SHAPES if s.kernel in FP8_KERNELS} == {"decode", "prefill"}


def test_memory_and_compute_bound_sides_of_the_ridge() -> None:
    """Memory-bound shapes under 60 FLOP/byte, compute-bound ones over 200 (the H200's bf16
    ridge); the fp8 logits' under 250 and over 1000 (its fp8 ridge: about 410); every
    bandwidth shape's traffic larger than a 60 MB L2, but the decode top-k's (4-17 MB rows,
    read after the L2 is flushed)."""
    for s in SHAPES:
        flops, nbytes = work(s)
        low, high = (250, 1000) if s.precision == "fp8" else (61, 200)
        if s.bound == "memory":
            assert flops / nbytes <= low, s.name
            assert nbytes > 60e6 or (s.kernel == "top_k_per_row" and s.phase == "decode"), \
                s.name
        else:
            assert flops / nbytes > high, s.name


def test_work_by_hand() -> None:
    dense = Shape("p", "decode", "memory", "mla_decode_paged", N=4, B=2, L=64)
    # FLOPs 2·B·s_q·N·L·(D + Dv) = 2·2·1·4·64·1088; bytes: cache 2·64·576·2, q 2·4·576·2,
    # out 2·4·512·2, lse 4·2·4
    assert work(dense) == (1_114_112.0, 147_456 + 9_216 + 8_192 + 32)
    assert work(dense, e=4) == (1_114_112.0, 294_912 + 18_432 + 16_384 + 32)
    sparse = Shape("p", "decode", "memory", "sparse_mla_decode", N=4, B=2, topk=16,
                   cache="fp8_ds_mla")
    # 2·2·4·16·1088 FLOPs; rows 2·16·(656 + 4), q and out 2·4·1088·2, lse 32
    assert work(sparse) == (278_528.0, 21_120 + 17_408 + 32)
    v4 = Shape("p", "decode", "memory", "sparse_mla_decode", N=4, B=2, topk=16, window=8,
               D=512, cache="model1")
    # 24 keys: 2·2·4·24·1024 FLOPs; rows 2·24·(584 + 4), q and out 2·4·1024·2, lse 32
    assert work(v4) == (393_216.0, 28_224 + 16_384 + 32)
    prefill = Shape("p", "prefill", "compute", "sparse_mla_prefill", N=2, s_q=3, L=100,
                    topk=8)
    # 2·3·2·8·1088 FLOPs; rows 3·8·(1152 + 4), q and out 3·2·1088·2, max_logits and lse 48
    assert work(prefill) == (104_448.0, 27_744 + 13_056 + 48)
    merge = Shape("p", "prefill", "memory", "merge_attn_states", N=2, s_q=8, D=128)
    assert work(merge) == (0.0, 3 * 8 * 2 * 128 * 2 + 12 * 16)
    attn = Shape("p", "prefill", "compute", "attention_with_lse", N=2, s_q=4, D=192, Dv=128,
                 causal=True)
    # 10 visible pairs: 2·2·10·320 FLOPs; q, k 4·2·192·2 each, v, out 4·2·128·2 each, lse 32
    assert work(attn) == (12_800.0, 2 * 3_072 + 2 * 2_048 + 32)


def test_indexer_work_by_hand() -> None:
    topk = Shape("p", "decode", "memory", "top_k_per_row", N=0, B=3, L=100, topk=8)
    # rows 3·100 float32 read, 3·8 int32 written, starts and ends 3·8
    assert work(topk) == (0.0, 1_200 + 96 + 24)
    causal = dataclasses.replace(topk, causal=True)  # rows end at 98, 99, 100
    assert row_ends(causal) == [98, 99, 100] and work(causal) == (0.0, 4 * 297 + 96 + 24)
    paged = Shape("p", "decode", "memory", "fp8_paged_mqa_logits", N=2, B=3, s_q=2, L=100,
                  D=128, Dv=0)
    # next_n 2: queries see 99 and 100 keys, 3·199 pairs: 2·597·2·128 FLOPs; keys 3·100·132,
    # q and weights 3·2·(2·128 + 8), logits 4·6·100, lengths and 2-page tables 4·3·3
    assert work(paged) == (305_664.0, 39_600 + 1_584 + 2_400 + 36)
    ragged = Shape("p", "prefill", "compute", "fp8_mqa_logits", N=2, s_q=3, L=100, D=128,
                   Dv=0, causal=True)
    # the last 3 queries of 100 keys: 98 + 99 + 100 pairs, 2·297·2·128 FLOPs; keys 100·132,
    # q, weights and ranges 3·(256 + 8 + 8), logits 4·3·100
    assert work(ragged) == (152_064.0, 13_200 + 816 + 1_200)
    with pytest.raises(ValueError, match="more rows than keys"):
        row_ends(dataclasses.replace(ragged, s_q=101))
    with pytest.raises(ValueError, match="no rows of logits"):
        row_ends(paged)


def test_select_shapes() -> None:
    assert [s.name for s in select_shapes(["deepseek-v3.2/decode-memory"])] == [
        "deepseek-v3.2/decode-memory"]
    assert {s.preset for s in select_shapes(["deepseek-v4"])} == {"deepseek-v4"}
    assert {s.kernel for s in select_shapes(None, ["merge_attn_states"])} == {
        "merge_attn_states"}
    assert select_shapes() == list(SHAPES)


@pytest.mark.parametrize("s", [s for s in SHAPES if s.cache != "bf16" or s.window],
                         ids=lambda s: s.name)
def test_fp8_inputs_are_valid(s: Shape) -> None:
    """The fp8 caches decode to finite numbers and the indices stay in the cache."""
    from mla.reference.sparse import sparse_mla_decode

    inp = build_inputs(tiny(s), "cpu")
    q, cache, idx = inp.args[:3]
    assert cache.dtype == torch.uint8 and int(idx.max()) < cache.shape[0] * cache.shape[1]
    assert len(set(idx[0, 0].tolist())) == idx.shape[-1]  # distinct picks
    out, lse = sparse_mla_decode(q.double(), cache, idx, s.scale, True, None, s.Dv,
                                 **inp.kwargs)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_dry_run_reference_two_kernels(tmp_path, capsys: pytest.CaptureFixture) -> None:
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(["bench", "--target", "reference", "--dry-run", "--kernels", "mla_decode_paged",
               "sparse_mla_prefill", "--json", str(js), "--out", str(md)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "deepseek-v3.2/prefill-compute" in out
    doc = json.loads(js.read_text())
    rows = doc["results"]
    assert doc["meta"]["dry_run"] and doc["meta"]["beside"] == []
    assert {r["kernel"] for r in rows} == {"mla_decode_paged", "sparse_mla_prefill"}
    assert len(rows) == 8 and all(r["target"] == "reference" for r in rows)
    for r in rows:
        assert r["error"] is None and r["skipped"] is None and r["us"] is None
        if r["kernel"] == "mla_decode_paged":  # out [B, s_q, N, 512], lse [B, N, s_q]
            s_q = 2 if r["shape"].startswith("deepseek-v3/") else 1
            assert r["outputs"] == [[2, s_q, 2, 512], [2, 2, s_q]]
        else:  # out [s_q, N, 512], max_logits and lse [s_q, N]
            assert r["outputs"] == [[4, 2, 512], [4, 2], [4, 2]]
    assert "| deepseek-v2/decode-memory | mla_decode_paged |" in md.read_text()


def test_no_cuda_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--target", "reference", "--shapes", "deepseek-v2"]) == 2
    captured = capsys.readouterr()
    assert "needs a CUDA GPU" in captured.err and "--dry-run" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_user_function_target(user_module: str, capsys: pytest.CaptureFixture) -> None:
    rc = main(["bench", "--target", f"{user_module}:my_merge", "--kernels",
               "merge_attn_states", "--dry-run"])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"target {user_module}:my_merge" in out
    assert out.count("called: 8x2x128, 2x8") == 2  # V2's and V3's merge shapes


def test_user_target_that_raises_is_a_row(user_module: str, capsys: pytest.CaptureFixture
                                          ) -> None:
    rc = main(["bench", "--target", f"{user_module}:broken_decode", "--kernels",
               "mla_decode_paged", "--shapes", "deepseek-v2", "--dry-run"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("error: RuntimeError: not written yet") == 2


def test_unknown_user_target_exits_2(user_module: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--target", f"{user_module}:missing", "--dry-run"])
    assert e.value.code == 2 and "no attribute" in capsys.readouterr().err


def test_beside_targets_skip_with_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MLA_PEERS", str(tmp_path / "no_peers"))
    targets = resolve_targets("reference", beside=("flashmla",))
    assert [t.name for t in targets] == ["reference", "flashmla"]
    assert targets[1].skipped and "FlashMLA" in targets[1].skipped
    assert "merge_attn_states" in targets[0].kernels


def test_dry_run_of_the_indexer_kernels(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """mla.fast's top-k and fp8 logits (under the interpreter) on DeepSeek-V3.2's indexer
    shapes, called once on their tiny inputs: the outputs the reference's signature
    promises."""
    js = tmp_path / "r.json"
    rc = main(["bench", "--target", "mla.fast", "--dry-run", "--kernels", "top_k_per_row",
               *FP8_KERNELS, "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "deepseek-v3.2/topk-prefill-128k" in out and "R=4 L=128 k=16 causal" in out
    rows = json.loads(js.read_text())["results"]
    assert [r["shape"] for r in rows] == [s.name for s in SHAPES if s.kernel in
                                          ("top_k_per_row", *FP8_KERNELS)]
    for r in rows:
        assert r["target"] == "mla.fast" and r["error"] is None and r["skipped"] is None
        if r["kernel"] == "top_k_per_row":  # int32 [R, topk]
            assert r["outputs"] == [[4, 16]] and r["flops"] == 0 and r["bytes"] > 0
        elif r["kernel"] == "fp8_paged_mqa_logits":  # [B · next_n, max_model_len]
            assert r["outputs"] == [[2 * (2 if "mtp" in r["shape"] else 1), 128]]
        else:  # [S, N] full rows
            assert r["outputs"] == [[4, 128]]
        if r["kernel"] != "top_k_per_row":
            assert r["flops"] > 0


def test_fp8_kernels_are_set_against_the_fp8_matmul_rate(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """With a time (the timing stubbed: no CUDA here), the rates and fractions: GB/s of the
    copy, TFLOP/s of the bf16 matmul, or of the fp8 one for the indexer's logits, none where
    that was not measured; the heading names the fp8 rate or why it is missing."""
    from mla.bench import report, timing
    from mla.bench.runner import Target, run_bench

    monkeypatch.setattr(timing, "time_call", lambda fn, **kw: timing.Timing(10.0, "graph",
                                                                           "flushed", 3))
    by_name = {s.name: s for s in SHAPES}
    shapes = [tiny(by_name["deepseek-v3.2/logits-decode-32k"]),
              tiny(by_name["deepseek-v2/decode-memory"])]
    target = Target("reference", {k: getattr(ref, k)
                                  for k in ("fp8_paged_mqa_logits", "mla_decode_paged")})
    ceil = {"copy_GBps": 1000.0, "matmul_TFLOPs": 100.0, "fp8_matmul_TFLOPs": 200.0}
    fp8, bf16 = run_bench(shapes, [target], "cpu", torch.float32, ceil=ceil, reps=3)
    for r, rate in ((fp8, 200.0), (bf16, 100.0)):
        assert r.us == 10.0 and r.GBps == pytest.approx(r.bytes / 1e-5 / 1e9)
        assert r.frac_copy == pytest.approx(r.GBps / 1000.0)
        assert r.frac_matmul == pytest.approx(r.flops / 1e-5 / 1e12 / rate)
    without = {"copy_GBps": 1000.0, "matmul_TFLOPs": 100.0, "fp8_matmul_error": "no fp8"}
    fp8, bf16 = run_bench(shapes, [target], "cpu", torch.float32, ceil=without, reps=3)
    assert fp8.frac_matmul is None and bf16.frac_matmul is not None
    meta = {"target": "reference", "dtype": "float32", "reps": 3, "graph": True,
            "flush": True}
    assert "fp8 matmul 200 TFLOP/s" in report.heading({**meta, "ceilings": ceil})[1]
    assert "no fp8 matmul (no fp8)" in report.heading({**meta, "ceilings": without})[1]


@pytest.mark.parametrize("flush", [True, False])
def test_each_timed_run_has_work_queued_before_it(monkeypatch: pytest.MonkeyPatch,
                                                  flush: bool) -> None:
    """Before each timed run ``time_call`` queues GPU work (the L2 flush's read, or warm a
    ``torch.cuda._sleep``), so that the start event does not fire on an idle GPU and the time
    leaves out the host's launch (CUDA stubbed here: what is queued, not how long it takes)."""
    from mla.bench import timing

    queued: list[str] = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: queued.append(f"sleep {cycles}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch, "ones", lambda *a, **k: type("Buf", (), {
        "sum": lambda self, dtype: queued.append("flush")})())

    def median(run, reps: int, before) -> float:  # type: ignore[no-untyped-def]
        assert before is not None
        for _ in range(reps):
            before()
            run()
        return 0.004

    monkeypatch.setattr(timing, "median_ms", median)
    t = timing.time_call(lambda: None, reps=3, flush=flush, graph=False)
    want = "flush" if flush else f"sleep {timing.BUSY_CYCLES}"
    assert (t.us, t.method, t.l2) == (4.0, "eager", "flushed" if flush else "warm")
    assert queued == [want] * 3
