"""benchmarks/copy_heads.py: its layer-by-layer attention reproduces the model's own logits (else it
prints nothing), and it reports every head of every layer and the moved-reply check."""

import re

import pytest
from flax import nnx

from rstar_jax.model.config import Qwen3Config
from rstar_jax.model.hf import save_pretrained
from rstar_jax.model.qwen3 import Qwen3
from tests.benchmark_scripts import benchmark_script



@pytest.fixture(scope="module")
def copy_heads():
    with benchmark_script("copy_heads") as module:
        yield module


def test_reports_every_head_from_a_recomputation_that_matches_the_model(copy_heads, tmp_path, capsys):
    config = Qwen3Config.tiny(num_layers=2)  # byte ids < 320; two layers: the residual carries over
    save_pretrained(Qwen3(config, rngs=nnx.Rngs(3)), tmp_path / "hf")
    assert copy_heads.main([str(tmp_path / "hf"), "--problems", "4"]) == 0
    out = capsys.readouterr().out
    heads = re.findall(r"layer (\d) head (\d): call (\d\.\d\d)  answer (\d\.\d\d)", out)
    assert [(int(layer), int(head)) for layer, head, *_ in heads] == [(l, h) for l in range(2) for h in range(4)]
    assert re.search(r"copy accuracy: call \d\.\d{3}, answer \d\.\d{3}", out)
    assert re.search(r"one position further from the question: call \d\.\d{3}, answer \d\.\d{3}", out)


def test_a_recomputation_that_differs_from_the_model_is_refused(copy_heads, tmp_path, capsys, monkeypatch):
    config = Qwen3Config.tiny(num_layers=1)
    save_pretrained(Qwen3(config, rngs=nnx.Rngs(4)), tmp_path / "hf")
    # The rotary embedding left out of the recomputation: the scores change, and so do the logits.
    monkeypatch.setattr(copy_heads, "rope", lambda x, positions, theta: x)
    assert copy_heads.main([str(tmp_path / "hf"), "--problems", "4"]) == 1
    assert "recomputed logits differ" in capsys.readouterr().err


def test_fix_conversations_report_the_second_calls_copy(copy_heads, tmp_path, capsys):
    """--behaviour fix (benchmarks/roc_effect.py's recovery): the copy into the second call, from the
    error's echo of the failed line, is scored and attended beside the other two."""
    save_pretrained(Qwen3(Qwen3Config.tiny(num_layers=1), rngs=nnx.Rngs(5)), tmp_path / "hf")
    tokens, rows = copy_heads.conversations(2, 0, "python", "fix", "release", 160, "unmatched")
    for (src, dst), (call_src, call_dst) in zip(rows[0][1]["fix"], rows[0][1]["call"]):
        assert tokens[0, src] == tokens[0, dst] == tokens[0, call_src] == tokens[0, call_dst]
        assert call_dst < src < dst and rows[0][2] < dst  # the echo lies between the calls; the moved reply holds the fix
    assert copy_heads.main([str(tmp_path / "hf"), "--problems", "4", "--behaviour", "fix", "--error-format", "release",
                            "--observation-chars", "160", "--fix-bug", "unmatched"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"copy accuracy: call \d\.\d{3}, answer \d\.\d{3}, fix \d\.\d{3}", out)
    assert len(re.findall(r"layer 0 head \d: call \d\.\d\d  answer \d\.\d\d  fix \d\.\d\d", out)) == 4
    assert re.search(r"further from the error: call \d\.\d{3}, answer \d\.\d{3}, fix \d\.\d{3}", out)
