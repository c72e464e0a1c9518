"""``mla bench`` on the CPU: its arguments, the shape listing, the bytes and FLOPs of a shape
worked by hand, the dry run's inputs and calls, the message without CUDA, a user's target."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from mla.bench import PRESETS, SHAPES, Shape, resolve_targets, select_shapes, work
from mla.bench.inputs import build_inputs
from mla.bench.shapes import tiny
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
    ["--kernels", "top_k_per_row"], ["--kernels", "no_such_kernel"],
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
        assert {s.name.split("/")[1] for s in SHAPES if s.preset == preset} == {
            "decode-memory", "decode-compute", "prefill-memory", "prefill-compute"}
    kernels = {s.kernel for s in SHAPES}
    assert {"mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill",
            "merge_attn_states"} <= kernels


def test_memory_and_compute_bound_sides_of_the_ridge() -> None:
    """Memory-bound shapes under 60 FLOP/byte, compute-bound ones over 200 (the H200's
    ridge), every bandwidth shape's traffic larger than a 60 MB L2."""
    for s in SHAPES:
        flops, nbytes = work(s)
        if s.bound == "memory":
            assert flops / nbytes <= 61 and nbytes > 60e6, s.name
        else:
            assert flops / nbytes > 200, s.name


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
