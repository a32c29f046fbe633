"""A real SGLang server loads the project's Qwen3 export and answers token-in/token-out /generate."""

import json
import urllib.request


def _post(url, body, timeout=120):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_generate_with_logprobs(start_sglang, tiny_qwen3_checkpoint):
    vocab = json.loads((tiny_qwen3_checkpoint / "config.json").read_text())["vocab_size"]
    server = start_sglang(tiny_qwen3_checkpoint, context_length=256, max_total_tokens=2048)
    out = _post(server.url + "/generate", {
        "input_ids": [1, 2, 3, 4, 5],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
    })
    ids, meta = out["output_ids"], out["meta_info"]
    assert len(ids) == 8 and all(0 <= t < vocab for t in ids), out
    assert meta["finish_reason"] == {"type": "length", "length": 8}, meta
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8, meta
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == ids, triples  # [logprob, token id, text (None: no tokenizer)]
    assert all(isinstance(lp, float) and lp <= 0.0 and text is None for lp, _, text in triples), triples
