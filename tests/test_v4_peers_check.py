"""benchmarks.v4_peers_check: its arguments, its JSON rows and table, its schedules, and
benchmarks.peers --v4's extraction of the kernels from a wheel's sources (no wheel needed)."""

from __future__ import annotations

import ast
import json

import pytest

from benchmarks import peers
from benchmarks import v4_peers_check as v4


def test_parse_args_defaults_and_cpu(tmp_path):
    a = v4.parse_args(["--out-dir", str(tmp_path)])
    assert (a.device, a.tokens, a.q_tokens, a.only) == ("cuda", 300, 64, "")
    b = v4.parse_args(["--out-dir", str(tmp_path), "--device", "cpu", "--tokens", "40",
                       "--only", "indexer-q"])
    assert (b.device, b.tokens, b.only) == ("cpu", 40, "indexer-q")
    with pytest.raises(SystemExit):
        v4.parse_args(["--out-dir", str(tmp_path), "--tokens", "0"])
    with pytest.raises(SystemExit):
        v4.parse_args([])


def test_check_row_status_and_json():
    exact = v4.check_row("a", kind="compressor", counts={"bytes_compared": 10,
                                                        "bytes_diff_nope": 0, "entries": 2},
                         maxima={"m": 0.0})
    assert exact["status"] == "exact" and "error" not in exact
    differs = v4.check_row("b", kind="compressor",
                           counts={"bytes_compared": 10, "bytes_diff_scale": 3},
                           examples=[{"entry": i} for i in range(20)])
    assert differs["status"] == "differs" and len(differs["examples"]) == v4.N_EXAMPLES
    try:
        raise ValueError("boom")
    except ValueError as e:
        err = v4.check_row("c", kind="indexer_q", error=e)
    assert err["status"] == "error" and err["error"] == "ValueError: boom"
    assert "Traceback" in err["traceback"]
    json.dumps([exact, differs, err])
    text = v4.table([exact, differs, err])
    assert text.count("\n") == 3 and "differs" in text and "boom" in text


@pytest.mark.parametrize("tokens", [1, 4, 37, 300])
def test_schedules_cover_the_tokens(tokens):
    s = v4.schedules(tokens)
    assert set(s) == {"prefill", "chunked", "decode"}
    assert all(sum(steps) == tokens and min(steps) >= 1 for steps in s.values())


def _fake_jit_source(path: str, name: str) -> str:
    if "." in name:
        cls, fn = name.split(".")
        return (f"class {cls}:\n    x = 1\n\n    @staticmethod\n    @triton.jit\n"
                f"    def {fn}(a, B: tl.constexpr):\n        return a\n")
    return f"@triton.jit\ndef {name}(a):\n    return a  # {path}\n"


def test_peers_v4_module_from_sources():
    sources = {p: "import triton\n\n" + "\n\n".join(_fake_jit_source(p, n) for n in names)
               for p, names in peers.V4_KERNELS.items()}
    text = peers.v4_kernels_source(sources)
    tree = ast.parse(text)
    defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    want = [peers.V4_RENAMES.get(n, n) for ns in peers.V4_KERNELS.values() for n in ns]
    assert defs == want
    assert "staticmethod" not in text and "from vllm.triton_utils import tl, triton" in text
    bad = dict(sources)
    first = next(iter(bad))
    bad[first] = "import triton\n"
    with pytest.raises(SystemExit):
        peers.v4_kernels_source(bad)
