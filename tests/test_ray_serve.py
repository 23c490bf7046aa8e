"""Ray Serve (DESIGN section 3, optional): one replica on CPU, a vLLM AsyncLLM with the
DSpine proposer behind /v1/completions. Loopback only; bounded waits; Serve and Ray are
always shut down. Skipped where `ray[serve]` is not installed."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("ray.serve")

from engine_utils import HOST, engine_env, free_port, sse_payloads  # noqa: E402

pytestmark = [pytest.mark.engine]

ENGINE_KWARGS = dict(dtype="float32", max_model_len=512, enforce_eager=True,
                     gpu_memory_utilization=0.15, seed=0, served_model_name="tiny")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine_env()
    import ray
    from ray import serve

    from vllm_dspine.serving.ray_serve import build_app
    from vllm_dspine.pairs.tiny import write_tiny_pair

    pair = write_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=0)
    port = free_port()
    # address="local": always a fresh single-node cluster, never one found on the machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": HOST, "port": port})
        # serve.run returns once the replica's constructor (engine start) has finished,
        # and raises if the deployment fails.
        serve.run(build_app(pair.target_dir, pair.draft_dir, num_replicas=1,
                            engine_kwargs=ENGINE_KWARGS),
                  name="dspine", route_prefix="/")
        yield f"http://{HOST}:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _complete(base: str, **body):
    import httpx

    return httpx.post(base + "/v1/completions", timeout=120, json=body)


def test_greedy_completion_and_spec_stats(server):
    import httpx

    body = dict(model="tiny", prompt="abcdefgh", max_tokens=24, temperature=0,
                ignore_eos=True)
    first = _complete(server, **body)
    assert first.status_code == 200, first.text
    out = first.json()
    assert out["usage"]["completion_tokens"] == 24
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["text"]
    # Greedy is deterministic: a second identical request gives identical text.
    second = _complete(server, **body)
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["text"] == out["choices"][0]["text"]

    # The replica's engine ran DSpine speculation: vLLM's spec-decode counters moved.
    # Stats are recorded by the engine's output loop right after it hands the tokens
    # over, so allow a few polls.
    deadline, answer = time.time() + 20, {}
    while time.time() < deadline:
        answer = httpx.get(server + "/stats", timeout=10).json()
        if answer["spec_decode"]["num_drafts"] > 0:
            break
        time.sleep(0.5)
    # One replica: the one that answered the completion is the one /stats reports.
    assert answer["replica"] == first.headers["x-dspine-replica"]
    stats = answer["spec_decode"]
    assert stats["num_drafts"] > 0, stats
    # Up to 15 drafts per step (vLLM may schedule fewer near max_tokens/max_model_len).
    assert stats["num_drafts"] <= stats["num_draft_tokens"] <= 15 * stats["num_drafts"], stats
    assert len(stats["num_accepted_tokens_per_pos"]) == 15
    assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]


def test_token_id_prompt_matches_text_prompt(server):
    # The tiny pair's tokenizer is byte-level: "abcdefgh" is ids 97..104.
    by_text = _complete(server, prompt="abcdefgh", max_tokens=8, temperature=0,
                        ignore_eos=True)
    by_ids = _complete(server, prompt=list(b"abcdefgh"), max_tokens=8, temperature=0,
                       ignore_eos=True)
    assert by_text.status_code == by_ids.status_code == 200, (by_text.text, by_ids.text)
    assert by_ids.json()["choices"][0]["text"] == by_text.json()["choices"][0]["text"]


@pytest.mark.parametrize("body, status, words", [
    pytest.param({"max_tokens": 4}, 400, "prompt", id="missing-prompt"),
    pytest.param({"prompt": "ab", "max_tokens": 0}, 400, "max_tokens", id="max-tokens-0"),
    pytest.param({"prompt": "ab", "max_tokens": "4"}, 400, "max_tokens", id="max-tokens-str"),
    pytest.param({"prompt": "ab", "temperature": -1.0}, 400, "temperature",
                 id="negative-temperature"),
    pytest.param({"prompt": "ab", "n": 2}, 400, "'n'", id="unsupported-n"),
    pytest.param({"prompt": "ab", "model": "other"}, 404, "does not exist",
                 id="unknown-model"),
    pytest.param({"prompt": "a" * 600, "max_tokens": 4}, 400, "maximum",
                 id="prompt-too-long"),
])
def test_bad_request_is_refused_and_replica_survives(server, body, status, words):
    r = _complete(server, **body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    ok = _complete(server, prompt="xyz", max_tokens=4, temperature=0, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_invalid_json_is_400(server):
    import httpx

    r = httpx.post(server + "/v1/completions", timeout=30, content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "JSON" in r.json()["error"]["message"]


def test_stream_equals_non_stream(server):
    import httpx

    body = dict(prompt="hello", max_tokens=20, temperature=0, ignore_eos=True)
    whole = _complete(server, **body).json()["choices"][0]["text"]
    with httpx.stream("POST", server + "/v1/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        pieces = [p["choices"][0]["text"] for p in sse_payloads(r)]
    assert len(pieces) > 1
    assert "".join(pieces) == whole


def test_health_and_models(server):
    import httpx

    assert httpx.get(server + "/health", timeout=30).status_code == 200
    models = httpx.get(server + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


@pytest.mark.parametrize("kwargs, words", [
    pytest.param(dict(draft="/nonexistent-draft"), "config.json", id="no-draft-folder"),
    pytest.param(dict(engine_kwargs={"speculative_config": {"method": "dflash"}}),
                 "method", id="method-override"),
    pytest.param(dict(num_replicas=0), "num_replicas", id="zero-replicas"),
    pytest.param(dict(engine_kwargs={"dtyp": "float32"}), "dtyp", id="unknown-engine-arg"),
    pytest.param(dict(engine_kwargs={"model": "x"}), "target", id="model-in-engine-kwargs"),
    pytest.param(dict(engine_kwargs={"speculative_config": {"num_speculative_tokens": 7}}),
                 "num_speculative_tokens", id="spec-tokens-override"),
])
def test_build_app_refuses_bad_arguments(tmp_path, kwargs, words):
    # Refused in the caller, before any replica starts (no Ray needed).
    engine_env()
    from vllm_dspine.config import RELEASED_QWEN38_27B
    from vllm_dspine.serving.ray_serve import build_app

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(RELEASED_QWEN38_27B))  # block 16
    args = {"target": "some/target", "draft": str(draft), **kwargs}
    with pytest.raises(ValueError, match=words):
        build_app(args.pop("target"), args.pop("draft"), **args)
