"""Targets and ``mla conform``: every named target loads, a user's module or function is a
target, bad specs say what was expected, the adapters report "unsupported" with the reason
where their peer cannot run (never "fail"), the vLLM decode adapter's row expansion keeps the
causal rule, and the command's exit status follows the rows."""

from __future__ import annotations

import json
import os
import textwrap
from functools import partial

import pytest
import torch

from mla.cli import main
from mla.conformance import KERNELS, Unsupported, kernels_of, run
from mla.conformance.adapters import import_peer, peers_dir, vllm_triton
from mla.conformance.targets import TARGETS, load_target
from mla.reference.paged_cache import cache_rows

USER = "conform_user_kernels"  # the module the fixture writes

USER_SOURCE = '''
import torch
from mla.reference import mla_decode_paged, merge_attn_states

NUMBER = 3
MAPPING = {"mla_decode_paged": mla_decode_paged}


def decode_impl(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=False,
                head_dim_v=512):
    return mla_decode_paged(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal,
                            head_dim_v)


def scale_576(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=False,
              head_dim_v=512):
    """The classic bug: the absorbed row's width in the scale."""
    return mla_decode_paged(q, kv_cache, block_table, cache_seqlens, q.shape[-1] ** -0.5,
                            causal, head_dim_v)


def crashes(*args, **kwargs):
    raise RuntimeError("kernel launch failed")


def helper(x):
    return x
'''



@pytest.fixture
def user_module(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / f"{USER}.py").write_text(textwrap.dedent(USER_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return USER


@pytest.fixture
def no_peers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapters look for their peers in an empty directory."""
    monkeypatch.setenv("MLA_PEERS", str(tmp_path / "no_peers"))


# ---- load_target ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TARGETS))
def test_named_targets_load(name: str) -> None:
    if name == "mla.fast":
        pytest.importorskip("triton")
    got, target = load_target(name)
    assert got == name
    fns = kernels_of(target)
    assert fns and set(fns) <= set(KERNELS)


def test_reference_target_has_every_kernel() -> None:
    assert set(kernels_of(load_target("reference")[1])) == set(KERNELS)


def test_module_and_attribute_specs(user_module: str) -> None:
    assert set(kernels_of(load_target(user_module)[1])) == {"mla_decode_paged",
                                                            "merge_attn_states"}
    assert set(kernels_of(load_target(f"{user_module}:MAPPING")[1])) == {"mla_decode_paged"}
    # a function supplies the kernel named in kernels, or the one its name names
    name, target = load_target(f"{user_module}:decode_impl", ["mla_decode_paged"])
    assert name == f"{user_module}:decode_impl" and list(target) == ["mla_decode_paged"]
    assert list(load_target("mla.reference:merge_attn_states")[1]) == ["merge_attn_states"]


@pytest.mark.parametrize("spec, kernels, error, says", [
    ("", None, ValueError, "is not a name"),
    ("two words", None, ValueError, "is not a name"),
    ("mla.reference:", None, ValueError, "is not a name"),
    ("no_such_package_xyz.kernels", None, ValueError, "cannot import"),
    (f"{USER}:missing", None, ValueError, "has no attribute 'missing'"),
    (f"{USER}:helper", None, ValueError, "not a kernel name"),
    (f"{USER}:decode_impl", ["mla_decode_paged", "merge_attn_states"], ValueError,
     "one function"),
    (f"{USER}:NUMBER", None, TypeError, "is a int"),
    ("mla.compare", None, ValueError, "holds none of the kernels"),
    ("reference", ["no_such_kernel"], ValueError, "unknown kernels"),
])
def test_bad_specs(user_module: str, spec: str, kernels: list[str] | None, error: type,
                   says: str) -> None:
    with pytest.raises(error, match=says) as e:
        load_target(spec, kernels)
    if spec:
        assert repr(spec) in str(e.value) or "unknown kernels" in str(e.value)


def test_non_string_spec() -> None:
    with pytest.raises(TypeError, match="target must be a str"):
        load_target(3)  # type: ignore[arg-type]


# ---- adapters where their peers cannot run ----------------------------------------------------

@pytest.mark.parametrize("name, says", [
    ("flashmla", "runs on cuda tensors only"),
    ("vllm-triton", "runs on cuda tensors only"),
    ("flashinfer", "runs on cuda tensors only"),
])
def test_adapters_on_the_cpu_are_unsupported(no_peers: None, name: str, says: str) -> None:
    report = run(load_target(name)[1], kernels=["mla_decode_paged"], device="cpu",
                 cases=["length_1", "causal_s_q_2"])
    assert [r.status for r in report.rows] == ["unsupported"] * 2
    assert all(says in r.detail and "q is on cpu" in r.detail for r in report.rows)
    assert not report.passed  # nothing ran


def test_missing_peer_is_unsupported_with_the_way_to_get_it(no_peers: None) -> None:
    with pytest.raises(Unsupported, match="not importable.*benchmarks.peers"):
        import_peer("no_such_peer_pkg_xyz.ops", "a peer")
    assert str(peers_dir()).endswith("no_peers")


@pytest.mark.parametrize("call, says", [
    (lambda: vllm_triton.merge_attn_states(*[torch.zeros(2, 3, 8, dtype=torch.float64)] * 4),
     "takes float16, bfloat16, float32 only; prefix_output is float64"),
    (lambda: vllm_triton.mla_decode_paged(torch.zeros(1, 1, 2, 8, device="meta"),
                                          torch.zeros(1, 4, 8, device="meta"),
                                          torch.zeros(1, 1, dtype=torch.int32),
                                          torch.ones(1, dtype=torch.int32), 1.0),
     "runs on cuda tensors only; q is on meta"),
])
def test_inputs_a_peer_does_not_take_are_unsupported(call, says: str) -> None:
    with pytest.raises(Unsupported, match=says):
        call()


# ---- the vLLM decode adapter's plumbing, with a stand-in for its kernel ----------------------

def _stand_in_decode(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits,
                     num_kv_splits, sm_scale, page_size, is_mla=False):
    """What ``decode_attention_fwd`` computes, in torch: row ``r`` attends to the first
    ``b_seq_len[r]`` tokens of block-table row ``r``; natural-log lse."""
    assert is_mla and attn_logits.shape[2] == num_kv_splits
    assert k_buffer.shape[1] == page_size
    cache = k_buffer[:, :, 0]
    for r, n in enumerate(b_seq_len.tolist()):
        rows = cache_rows(cache, req_to_token[r], 0, n).float()  # [n, D]
        s = q[r].float() @ rows.T * sm_scale  # [N, n]
        lse[r] = torch.logsumexp(s, dim=-1)
        o[r] = (torch.softmax(s, dim=-1) @ rows[:, : v_buffer.shape[-1]]).to(o.dtype)


def test_decode_rows_expand_s_q_as_vllm_backend() -> None:
    """s_q > 1 becomes one row per query token; with causal, row i sees L - s_q + 1 + i keys:
    the stand-in passes the causal and non-causal cases, and fails every causal one when the
    adapter is handed the opposite flag (the twin)."""
    fn = partial(vllm_triton.decode_rows, _stand_in_decode)
    report = run({"mla_decode_paged": fn}, device="cpu", dtype=torch.float32,
                 cases=["causal_s_q_2", "causal_s_q_4", "causal_diagonal_page_edge",
                        "non_causal_s_q_2", "length_1"])
    assert len(report.rows) == 5 and all(r.status == "pass" for r in report.rows), \
        report.to_text()

    def flipped(q, kv, table, lens, scale, causal=False, head_dim_v=512):
        return vllm_triton.decode_rows(_stand_in_decode, q, kv, table, lens, scale,
                                       not causal, head_dim_v)

    broken = run({"mla_decode_paged": flipped}, device="cpu", dtype=torch.float32,
                 cases=["causal_s_q_2", "causal_diagonal_page_edge"])
    assert len(broken.rows) == 2 and all(r.status == "fail" for r in broken.rows)


def test_dcp_correction_runs_when_the_peer_is_unpacked() -> None:
    """With ``peers/`` unpacked (``python -m benchmarks.peers``), vLLM's copied correction
    kernel runs under the interpreter and combines like the reference."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    try:
        import_peer("vllm.v1.attention.ops.dcp_correct_attn_out", "the DCP kernel")
    except Unsupported as e:
        pytest.skip(str(e))
    from mla.reference import cp_lse_ag_out_rs
    from mla.reference.dcp.comm import run_simulated

    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(3, 4, 16, generator=g) for _ in range(2)]
    lses = [torch.randn(3, 4, generator=g) for _ in range(2)]
    lses[0][0, 0] = float("inf")  # rank 0 saw no key for one query

    def ranks(fn):
        return run_simulated(2, lambda c: fn(outs[c.rank], lses[c.rank], c, return_lse=True))

    for (o, lse), (o_ref, lse_ref) in zip(ranks(vllm_triton.cp_lse_ag_out_rs),
                                          ranks(cp_lse_ag_out_rs)):
        torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)


# ---- mla conform ------------------------------------------------------------------------------

def test_conform_passes_the_reference(capsys: pytest.CaptureFixture) -> None:
    assert main(["conform", "--target", "reference", "--cases", "length_1", "empty_request",
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "[1/2] pass" in captured.err and "[2/2] pass" in captured.err
    assert "pass        mla_decode_paged/length_1" in captured.out
    assert "reference on cpu (float32): 2 pass" in captured.out


def test_conform_fails_a_broken_kernel_and_writes_reports(user_module: str, tmp_path,
                                                          capsys: pytest.CaptureFixture
                                                          ) -> None:
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    assert main(["conform", "--target", f"{user_module}:scale_576", "--kernels",
                 "mla_decode_paged", "--cases", "scale", "--device", "cpu", "--out", str(md),
                 "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert "fail        mla_decode_paged/scale_deepseek" in out
    assert "1/sqrt(576)" in out  # the convention named
    doc = json.loads(js.read_text())
    assert doc["target"] == f"{user_module}:scale_576" and not doc["passed"]
    assert md.read_text().startswith(f"# Conformance of `{user_module}:scale_576`")


def test_conform_error_rows_fail_the_run(user_module: str, capsys: pytest.CaptureFixture
                                         ) -> None:
    assert main(["conform", "--target", f"{user_module}:crashes", "--kernels",
                 "mla_decode_paged", "--cases", "length_1", "--device", "cpu"]) == 1
    assert "RuntimeError: kernel launch failed" in capsys.readouterr().out


def test_conform_unsupported_only_is_not_a_failure(no_peers: None,
                                                   capsys: pytest.CaptureFixture) -> None:
    assert main(["conform", "--target", "flashmla", "--cases", "length_1",
                 "--device", "cpu"]) == 0
    assert "unsupported mla_decode_paged/length_1" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--target", "no_such_package_xyz"],
    ["--target", "reference", "--kernels", "no_such_kernel"],
    ["--target", "reference", "--cases", "no_such_case"],
    ["--target", "reference", "--device", "nodevice"],
    ["--target", "reference", "--dtype", "int8"],
])
def test_conform_usage_errors(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["conform", *argv])
    assert e.value.code == 2
    assert "mla conform: error:" in capsys.readouterr().err


def test_conform_mla_fast_on_the_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture
                                                           ) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit) as e:
        main(["conform", "--target", "mla.fast", "--device", "cpu"])
    assert e.value.code == 2 and "TRITON_INTERPRET must be 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_conform_missing_device(capsys: pytest.CaptureFixture) -> None:
    assert main(["conform", "--target", "reference", "--device", "cuda"]) == 3
    assert "CUDA is not available" in capsys.readouterr().err
