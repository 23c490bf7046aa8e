"""`vllm serve` with `--speculative-config '{"method": "dspine", ...}'` and nothing else:
an OpenAI completion, a streamed chat completion, vLLM's metrics, and an aborted
stream that frees its slot and KV blocks. Loopback only; every loop is bounded."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from engine_utils import HOST, dspine_spec, engine_env, free_port, sse_payloads

pytestmark = pytest.mark.engine



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine_env()
    import httpx

    from vllm_dspine.pairs.tiny import write_tiny_pair

    pair = write_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=0)
    port = free_port()
    vllm_bin = shutil.which("vllm", path=os.path.dirname(sys.executable)) or "vllm"
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [vllm_bin, "serve", pair.target_dir, "--host", HOST, "--port", str(port),
         "--speculative-config", json.dumps(dspine_spec(pair.draft_dir)),
         "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
         "--gpu-memory-utilization", "0.15", "--served-model-name", "tiny"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://{HOST}:{port}"
    deadline = time.time() + 400
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {open(log_path).read()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"vllm serve not up in 400 s: "
                                   f"{open(log_path).read()[-3000:]}")
            time.sleep(2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _metric(base: str, name: str) -> float:
    import httpx

    text = httpx.get(base + "/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_completion(server):
    import httpx

    r = httpx.post(server + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "abcdefgh", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 24
    assert body["choices"][0]["text"]
    assert _metric(server, "vllm:spec_decode_num_draft_tokens_total") > 0


def test_streamed_chat_completion(server):
    import httpx

    chunks = []
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "stream": True, "max_tokens": 32, "temperature": 0.7,
            "seed": 3, "messages": [{"role": "user", "content": "say abc"}]}) as r:
        assert r.status_code == 200
        for payload in sse_payloads(r):
            delta = payload["choices"][0]["delta"]
            if delta.get("content"):
                chunks.append(delta["content"])
    assert len(chunks) > 1
    assert "".join(chunks)


def test_aborted_stream_frees_everything(server):
    import httpx

    with httpx.stream("POST", server + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 400, "temperature": 1.0,
            "ignore_eos": True, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # closing the connection aborts the request
    deadline = time.time() + 60
    while time.time() < deadline:
        if (_metric(server, "vllm:num_requests_running") == 0
                and _metric(server, "vllm:kv_cache_usage_perc") == 0):
            break
        time.sleep(1)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0
    # The engine still serves after the abort.
    r = httpx.post(server + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "xyz", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
