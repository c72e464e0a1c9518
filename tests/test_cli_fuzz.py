"""``mla conform --fuzz`` on the CPU, as ``benchmarks/device_run.sh fuzz-peers`` runs it on a GPU
(``--target T --kernels K --fuzz N --keep-going --properties all --fuzz-db D --out --json``):
a user's broken ``module:function`` fails with exit status 1, each of its failure modes
shrunk and reported with its convention and a snippet that reproduces it on its own; kernels
that keep the conventions pass with exit status 0; the flags' misuse is a usage error."""

from __future__ import annotations

import json
import textwrap

import pytest

from mla.cli import main

USER = "fuzz_cli_user_kernels"
USER_SOURCE = '''
    import mla.reference as ref


    def two_bugs(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=False,
                 head_dim_v=512, **kw):
        """The causal mask whatever ``causal`` says (over the budgets where s_q > 1), and an
        lse that depends on the batch size by two ulps (within the budgets, but not batch
        invariant)."""
        out, lse = ref.mla_decode_paged(q, kv_cache, block_table, cache_seqlens,
                                        softmax_scale, True, head_dim_v, **kw)
        return out, lse + 1e-6 * (q.shape[0] - 1)
'''
CAUSAL = "causal mask applied although causal=False"
BATCH = "not batch invariant"


@pytest.fixture
def user_module(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / f"{USER}.py").write_text(textwrap.dedent(USER_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return USER


def test_fuzz_keep_going_with_properties_reports_each_mode(user_module: str, tmp_path,
                                                           capsys: pytest.CaptureFixture
                                                           ) -> None:
    target = f"{user_module}:two_bugs"
    md, js, db = tmp_path / "f.md", tmp_path / "f.json", tmp_path / "db"
    rc = main(["conform", "--target", target, "--kernels", "mla_decode_paged",
               "--device", "cpu", "--fuzz", "40", "--keep-going", "--properties", "all",
               "--fuzz-db", str(db), "--out", str(md), "--json", str(js)])
    captured = capsys.readouterr()
    assert rc == 1, captured.out
    assert f"mla conform --fuzz: target {target}, float32 on cpu" in captured.out
    assert "fuzzed mla_decode_paged: " in captured.err and db.is_dir()
    doc = json.loads(js.read_text())
    assert doc["target"] == target and not doc["passed"]
    (run,) = doc["kernels"]
    by_convention = {f["convention"].split(":")[0]: f for f in run["failures"]}
    # the budgets' failure and the property's, each shrunk to one request and one head
    causal, batch = by_convention[CAUSAL], by_convention[BATCH]
    assert causal["property"] == "" and causal["status"] == "fail"
    assert "s_q=2, causal=False" in causal["spec"] and "heads=1," in causal["spec"]
    assert batch["property"] == "batch_invariance" and "lens=(" in batch["spec"]
    assert "heads=1," in batch["spec"]
    text = md.read_text()
    assert text.startswith(f"# Fuzz of `{target}`") and "| mla_decode_paged | fail |" in text
    for f in (causal, batch):
        assert f"Convention: {f['convention']}." in text
        assert f["snippet"] in captured.out and f["snippet"].rstrip() in text
        # each snippet loads the target from the spec and fails as the search did
        assert f"load_target({target!r}" in f["snippet"]
        with pytest.raises(AssertionError):
            exec(compile(f["snippet"], "<snippet>", "exec"), {})


def test_fuzz_of_kernels_that_keep_the_conventions_passes(tmp_path,
                                                        capsys: pytest.CaptureFixture) -> None:
    js, md = tmp_path / "f.json", tmp_path / "f.md"
    rc = main(["conform", "--target", "reference", "--kernels", "merge_attn_states",
               "cp_lse_ag_out_rs", "--device", "cpu", "--fuzz", "5", "--keep-going",
               "--fuzz-db", str(tmp_path / "db"), "--json", str(js), "--out", str(md)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(js.read_text())
    assert doc["passed"] and [k["kernel"] for k in doc["kernels"]] == [
        "merge_attn_states", "cp_lse_ag_out_rs"]
    assert all(k["examples"] >= 5 and k["failures"] == [] for k in doc["kernels"])
    assert "| merge_attn_states | pass | 5 |" in md.read_text()


@pytest.mark.parametrize("argv, says", [
    (["--fuzz", "0"], "positive budget"),
    (["--fuzz", "ten"], "number of examples"),
    (["--fuzz", "3", "--properties", "batch_variance"], "--properties"),
    (["--properties", "batch_variance"], "--properties: unknown properties"),
    (["--keep-going"], "goes on fuzzing"),
    (["--fuzz", "3", "--kernels", "gather_cache"], "no strategy"),
    (["--fuzz", "3", "--cases", "length_1"], "no --cases"),
])
def test_fuzz_usage_errors(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["conform", "--target", "reference", "--device", "cpu", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "mla conform: error:" in err and says in err, err
