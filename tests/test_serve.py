"""`vllm serve` with `--speculative-config '{"method": "dspine", ...}'` and nothing else:
an OpenAI completion, streamed chat completions equal to the non-streamed ones, vLLM's
metrics, an aborted stream that frees its slot and KV blocks, and a storm of 50
concurrent streams each cut by the client. One server for the session (conftest.py's
`tiny_server`, also the reference of tests/test_ray_serve.py); loopback only; every wait
is bounded."""

from __future__ import annotations

import random
import threading
import time

import pytest

from engine_utils import check_counters_account_for, sse_payloads
from vllm_dspine.serving.metrics import metric_page, prometheus_samples

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def served(tiny_server):
    """The session's `vllm serve` of the tiny pair with its distilled drafter (drafts get
    accepted, so the counter checks see accepted tokens), up."""
    return tiny_server.wait_up(400)


@pytest.fixture(scope="module")
def server(served):
    return served.base


def _metric(base: str, name: str) -> float:
    import httpx

    values = prometheus_samples(httpx.get(base + "/metrics", timeout=10).text, name)
    assert values, f"{name} not in /metrics"
    return sum(v for _, v in values)


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


def test_spec_decode_counters_account_for_the_answers(server):
    """vLLM's counters (and DSpine's verified-length histogram) grow by exactly what
    the answers imply (engine_utils.check_counters_account_for): 8 greedy requests of
    different lengths, completions and chats."""
    import httpx

    before = metric_page(httpx.get(server + "/metrics", timeout=10).text)
    tokens = []
    for i in range(8):
        common = {"model": "tiny", "max_tokens": 5 + 13 * i, "temperature": 0,
                  "ignore_eos": True}
        if i % 2:
            route, body = "/v1/completions", {**common, "prompt": "abc" * (i + 1)}
        else:
            route, body = "/v1/chat/completions", {**common, "messages": [
                {"role": "user", "content": "say " + "xyz" * i}]}
        r = httpx.post(server + route, json=body, timeout=120)
        assert r.status_code == 200, r.text
        tokens.append(r.json()["usage"]["completion_tokens"])
    assert tokens == [5 + 13 * i for i in range(8)]
    after = metric_page(httpx.get(server + "/metrics", timeout=10).text)
    d = check_counters_account_for(before, after, tokens, where="vllm serve")
    print("counters grew by", {k: v for k, v in sorted(d.items()) if v and "spec" in k})


@pytest.mark.parametrize("sampling", [
    pytest.param({"temperature": 0}, id="greedy"),
    pytest.param({"temperature": 0.7, "seed": 3}, id="seeded"),
])
def test_streamed_chat_completion_equals_the_answer(server, sampling):
    """A streamed chat completion arrives in several chunks whose text is the
    non-streamed answer to the same request, greedy and seeded sampled (a seeded request
    reproduces)."""
    import httpx

    body = {"model": "tiny", "max_tokens": 32, "ignore_eos": True, **sampling,
            "messages": [{"role": "user", "content": "say abc"}]}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    chunks = []
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for payload in sse_payloads(r):
            delta = payload["choices"][0]["delta"]
            if delta.get("content"):
                chunks.append(delta["content"])
    assert len(chunks) > 1
    assert answer and "".join(chunks) == answer


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


# ------------------------------------------------------------------ abort storm
STORM = 50
# Greedy requests answered before and after the storm (name -> route, body).
PROBES = {
    "completion": ("/v1/completions", {
        "model": "tiny", "prompt": "the quick brown fox", "max_tokens": 48,
        "temperature": 0, "ignore_eos": True}),
    "chat": ("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "say abc"}],
        "max_tokens": 32, "temperature": 0, "ignore_eos": True}),
}


def _probe(base: str, name: str) -> list:
    """A probe's generated text and token count (non-streamed)."""
    import httpx

    route, body = PROBES[name]
    r = httpx.post(base + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] if "chat" in route else choice["text"]
    return [text, out["usage"]["completion_tokens"]]


def _storm_requests(rng: random.Random) -> list[dict]:
    """STORM streamed requests: completions and chats, greedy, sampled and seeded
    sampled, max_tokens 4..300, each with the number of SSE events after which the
    client hangs up (0: right after the response headers). Some are allowed to run to
    their end."""
    words = "the quick brown fox jumps over the lazy dog while five wizards box".split()
    reqs = []
    for i in range(STORM):
        max_tokens = rng.choice([4, 16, 48, 120, 300])
        body = {"model": "tiny", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        kind = rng.choice(["greedy", "sampled", "seeded"])
        if kind == "greedy":
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.6, 1.0, 1.4]),
                        top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 20]))
            if kind == "seeded":
                body["seed"] = 1000 + i
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.5:
            route, body["prompt"] = "/v1/completions", text
        else:
            route, body["messages"] = "/v1/chat/completions", [
                {"role": "user", "content": text}]
        # One in five is read to its end (cut None), the others are cut.
        cut = None if rng.random() < 0.2 else rng.randint(0, max_tokens // 3 + 1)
        reqs.append({"i": i, "route": route, "body": body, "kind": kind, "cut": cut,
                     "delay": rng.uniform(0.0, 1.5)})
    return reqs


def _run_storm(base: str, reqs: list[dict], timeout: float) -> list[dict]:
    """Open every request at once (each after its small delay) in its own thread; each
    reads `cut` SSE events and closes its connection, which makes vLLM abort the
    request. Returns one record per request; raises if a thread is still alive when
    `timeout` is up."""
    import httpx

    records = [{"i": r["i"], "events": 0, "done": False} for r in reqs]
    go = threading.Event()

    def client(req, rec):
        go.wait(30)
        time.sleep(req["delay"])
        try:
            with httpx.stream("POST", base + req["route"], json=req["body"],
                              timeout=httpx.Timeout(120, connect=30)) as r:
                rec["status"] = r.status_code
                if r.status_code != 200 or req["cut"] == 0:
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        rec["done"] = True
                        return
                    if line.startswith("data: "):
                        rec["events"] += 1
                        # a token event: the request is inside vLLM, unfinished, from
                        # here until [DONE] or the client's cut
                        rec.setdefault("t_first", time.monotonic())
                        if req["cut"] is not None and rec["events"] >= req["cut"]:
                            return  # leaving the block closes the connection
        except Exception as e:  # recorded, asserted on by the test
            rec["error"] = repr(e)
        finally:
            rec["t_last"] = time.monotonic()

    threads = [threading.Thread(target=client, args=(q, rec), daemon=True)
               for q, rec in zip(reqs, records)]
    # requests inside vLLM (running + waiting: both hold state an abort must free),
    # sampled during the storm
    running: list[float] = []

    def monitor():
        while any(t.is_alive() for t in threads) and time.time() < deadline:
            try:
                running.append(_metric(base, "vllm:num_requests_running")
                               + _metric(base, "vllm:num_requests_waiting"))
            except Exception:
                pass
            time.sleep(0.2)

    deadline = time.time() + timeout
    for t in threads:
        t.start()
    go.set()
    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    alive = [rec["i"] for t, rec in zip(threads, records) if t.is_alive()]
    assert not alive, f"storm requests {alive} still open after {timeout:.0f} s"
    mon.join(5)
    # Two lower bounds on the requests vLLM held at once: its gauges, sampled every
    # 0.2 s (they miss short overlaps), and the client's streams that had received a
    # token event and were not yet finished or cut (each such request is inside vLLM)
    edges = sorted([(rec["t_first"], 1) for rec in records if "t_first" in rec]
                   + [(rec["t_last"], -1) for rec in records if "t_first" in rec],
                   key=lambda e: (e[0], e[1]))
    open_streams, most = 0, 0
    for _, step in edges:
        open_streams += step
        most = max(most, open_streams)
    records.append({"max_running": max(max(running, default=0), most),
                    "gauges": max(running, default=0), "streams": most})
    return records


def _wait_idle(base: str, timeout: float) -> dict:
    """Waits, bounded, until vLLM reports no running or waiting request and an empty
    KV cache; returns the last readings."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:kv_cache_usage_perc")
    deadline = time.time() + timeout
    while True:
        now = {n: _metric(base, n) for n in names}
        if not any(now.values()) or time.time() > deadline:
            return now
        time.sleep(0.5)


def _success_by_reason(base: str) -> dict:
    import httpx

    out: dict[str, float] = {}
    text = httpx.get(base + "/metrics", timeout=10).text
    for labels, v in prometheus_samples(text, "vllm:request_success_total"):
        reason = dict(kv.split("=", 1) for kv in labels.split(",") if "=" in kv).get(
            "finished_reason", "").strip('"')
        out[reason] = out.get(reason, 0.0) + v
    return out


def test_abort_storm_frees_everything_and_serving_continues(served):
    """50 concurrent streamed requests (completions and chats; greedy, sampled and
    seeded; max_tokens 4..300), cut by the client at random points (fixed seed) from
    right after the response headers on, one in five read to its end. Afterwards vLLM's own gauges read no
    running or waiting request and an empty KV cache (which holds the drafter's context
    K/V too: DSpine's draft layers live in vLLM's KV block pool, there is no other
    per-request draft slot); the engine is alive and answers the greedy probes exactly
    as before the storm, and the server logged no traceback. Every finished request is
    counted once: vLLM's request_success counter grew by at most STORM and at least by
    the streams the client read to their end."""
    base = served.base
    before = {name: _probe(base, name) for name in PROBES}
    assert not any(_wait_idle(base, 30).values())
    success0 = _success_by_reason(base)
    reqs = _storm_requests(random.Random(20261201))
    t0 = time.time()
    records = _run_storm(base, reqs, timeout=300)
    overlap = records.pop()
    max_running = overlap["max_running"]
    storm_s = time.time() - t0
    errors = [(r["i"], r.get("status"), r.get("error")) for r in records
              if r.get("status") != 200 or "error" in r]
    assert not errors, errors
    cut = [r for r in records if not r["done"]]
    done = sum(r["done"] for r in records)
    assert len(cut) >= 30 and done >= 3, (len(cut), done)
    # The storm really was concurrent: vLLM held several of them at once, so aborts hit
    # requests that share steps. How many overlap depends on the machine's speed (the
    # HTTP front end admits them as fast as it can, the cut ones leave after a few
    # tokens): a slow 2-core machine (2026-12-03) peaked at 7 running where faster ones
    # reach 10+, so the bound is 5, far above the 1 of requests served one by one. The
    # gauges alone read 0 throughout one fresh-clone run (samples every 0.2 s missed
    # every overlap), so the count is also taken from the client's open streams
    # (`_run_storm`).
    assert max_running >= 5, max_running
    idle = _wait_idle(base, 90)
    assert not any(idle.values()), f"not freed after the storm: {idle}"
    success1 = _success_by_reason(base)
    grew = {k: success1.get(k, 0) - success0.get(k, 0) for k in success1}
    print(f"storm: {storm_s:.1f} s, {len(cut)} cut, {done} read to the end, at most "
          f"{max_running:.0f} running at once (gauges {overlap['gauges']:.0f}, open streams "
          f"{overlap['streams']}), finished by reason {grew}")
    # vLLM counts finished requests only (an abort is not a success): each stream read
    # to its end once, plus cut ones that had finished before their abort arrived.
    assert done <= grew.get("length", 0) <= STORM, (done, grew)
    assert sum(grew.values()) == grew.get("length", 0), grew  # ignore_eos, no stops
    after = {name: _probe(base, name) for name in PROBES}
    assert after == before
    with open(served.log_path, errors="replace") as f:
        log = f.read()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:][:6000]
