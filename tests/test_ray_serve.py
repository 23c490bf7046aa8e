"""Ray Serve (docs/design.md section 3, optional; docs/ray-serve.md): two replicas, each vLLM's own
OpenAI server around an engine with the DSpine proposer, behind Serve's proxy.

- both replicas answer /v1/completions and /v1/chat/completions (streamed and not), with
  greedy answers identical to plain `vllm serve` on the same pair and flags;
- each replica's /metrics is vLLM's, with its own vllm:spec_decode_* counters;
- a replica killed mid-run: the other keeps answering, nothing is answered twice or in
  part, and Serve starts a replacement;
- a replica whose environment would not load the plugin fails the deployment with
  PluginNotInstalledError, and a worker without the package says so too;
- shutdown leaves no process of the cluster and no listening port behind.

Loopback only (Serve's proxy and `vllm serve` on 127.0.0.1); every wait is bounded. The
tests that start a cluster are in the `full` tier (docs/testing.md). `ray[serve]` is in the
test extras (pyproject.toml): a broken Ray install fails here, it is not skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

import ray.serve  # noqa: F401 - in the test extras: a broken install must fail, not skip

from engine_utils import SERVE_ARGS, check_counters_account_for, engine_env, sse_payloads
from vllm_dspine.serving.metrics import metric_page
from vllm_dspine.serving.openai_server import HOST, free_port

pytestmark = [pytest.mark.engine]

APP = "dspine"
MODEL = "tiny"  # SERVE_ARGS' --served-model-name
# The same `vllm serve` flags for the reference server (conftest.py's `tiny_server`) and
# for every replica: engine_utils.SERVE_ARGS.

# Greedy requests whose answers are compared with `vllm serve`'s (name -> route, body).
REQUESTS = {
    "completion": ("/v1/completions", {
        "model": MODEL, "prompt": "abcdefgh", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True}),
    "chat": ("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "say abc"}],
        "max_tokens": 24, "temperature": 0, "ignore_eos": True}),
    # Longer, so that a replica killed during the run has requests in flight.
    "long": ("/v1/completions", {
        "model": MODEL, "prompt": "the quick brown fox", "max_tokens": 96,
        "temperature": 0, "ignore_eos": True}),
}
REPLICA_HEADER = "x-dspine-replica"  # vllm_dspine.serving.ray_serve.REPLICA_HEADER


# ------------------------------------------------------------------------- helpers
def _answer(route: str, body: dict) -> str:
    """The generated text of a non-streamed answer."""
    choice = body["choices"][0]
    return choice["message"]["content"] if "chat" in route else choice["text"]


def _post(base: str, name: str, timeout: float = 180):
    import httpx

    route, body = REQUESTS[name]
    r = httpx.post(base + route, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return _answer(route, r.json()), r.headers.get(REPLICA_HEADER)


def _stream(base: str, name: str, timeout: float = 180):
    """(text, replica, complete): `complete` is whether the stream ended with [DONE]
    (False too when the connection broke off after the response had started)."""
    import httpx

    route, body = REQUESTS[name]
    pieces = []
    with httpx.stream("POST", base + route, json={**body, "stream": True},
                      timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers.get(REPLICA_HEADER)
        try:
            for payload in sse_payloads(r):
                if not payload.get("choices"):
                    continue
                choice = payload["choices"][0]
                piece = (choice["delta"].get("content") if "chat" in route
                         else choice.get("text"))
                pieces.append(piece or "")
        except (AssertionError, httpx.HTTPError):  # no [DONE], or cut off
            return "".join(pieces), replica, False
    return "".join(pieces), replica, True


def _marked_processes(marker: str):
    """Live processes whose environment carries `marker` (everything the Ray cluster
    started, including processes that outlived their parent), except this one."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("DSPINE_RAY_TEST") == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
    return found


def _wait_for(predicate, timeout: float, what: str, every: float = 1.0):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# ------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


@pytest.fixture(scope="module")
def reference(tiny_server):
    """`vllm serve`'s answer to each of REQUESTS (the session's server of the same pair
    and flags, conftest.py)."""
    tiny_server.wait_up(400)
    return {name: _post(tiny_server.base, name)[0] for name in REQUESTS}


class Cluster:
    """A fresh local Ray instance with Serve's proxy on 127.0.0.1 and the app deployed."""

    def __init__(self, pair):
        engine_env()
        import ray
        from ray import serve

        from vllm_dspine.serving.ray_serve import build_app

        self.marker = uuid.uuid4().hex
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.stopped = False
        # Every process the cluster starts inherits this (raylet -> workers -> vLLM's
        # engine core and workers), so none can hide from the shutdown check.
        os.environ["DSPINE_RAY_TEST"] = self.marker
        try:
            # address="local": always a fresh single-node cluster, never one found on
            # the machine. Two CPUs: one per replica.
            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     log_to_driver=False)
        finally:
            del os.environ["DSPINE_RAY_TEST"]
        try:
            serve.start(http_options={"host": HOST, "port": self.port})
            # serve.run returns once both replicas' constructors (engine starts) have
            # finished, and raises if the deployment fails.
            serve.run(build_app(pair.target_dir, pair.draft_dir, num_replicas=2,
                                serve_args=SERVE_ARGS),
                      name=APP, route_prefix="/")
        except BaseException:
            self.stop()
            raise

    def running_replicas(self) -> int:
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is None:
            return 0
        states = app.deployments["DSpine"].replica_states
        return states.get("RUNNING", 0)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def cluster(pair, tiny_server):
    # The reference `vllm serve` (started, maybe not up) comes up meanwhile (engine
    # starts are mostly waiting on imports and handshakes; overlapping them saves time).
    c = Cluster(pair)
    try:
        yield c
    finally:
        c.stop()


# --------------------------------------------------------------------------- tests
@pytest.mark.full
def test_both_replicas_answer_like_vllm_serve(cluster, reference):
    """Each kind of request, repeated until both replicas have answered it (Serve
    spreads requests over replicas): every answer equals `vllm serve`'s."""
    def whole_stream(name):
        text, replica, complete = _stream(cluster.base, name)
        assert complete, (name, replica, text)
        return text, replica

    kinds = {
        "completion": lambda: _post(cluster.base, "completion"),
        "chat": lambda: _post(cluster.base, "chat"),
        "chat-stream": lambda: whole_stream("chat"),
        "completion-stream": lambda: whole_stream("completion"),
    }
    seen: dict[str, set] = {}
    for kind, call in kinds.items():
        ref = reference[kind.split("-")[0]]
        replicas: set = set()
        for _ in range(12):  # P(one replica never picked in 12) = 2 * 2**-12
            text, replica = call()
            assert text == ref, (kind, replica, text, ref)
            assert replica, "no replica header"
            replicas.add(replica)
            if len(replicas) == 2:
                break
        seen[kind] = replicas
    assert all(len(r) == 2 for r in seen.values()), seen
    assert len(set().union(*seen.values())) == 2, seen


def _replica_pages(base: str) -> dict[str, dict]:
    """vLLM's /metrics page of each replica (Serve routes each GET to one of them)."""
    import httpx

    pages: dict[str, dict] = {}

    def both():
        r = httpx.get(base + "/metrics", timeout=30)
        assert r.status_code == 200
        pages[r.headers[REPLICA_HEADER]] = metric_page(r.text)
        return len(pages) == 2

    _wait_for(both, 60, "/metrics of both replicas", every=0.1)
    return pages


@pytest.mark.full
def test_metrics_of_each_replica(cluster):
    """/metrics is vLLM's own page of the replica that answers it, and each replica's
    counters account for exactly the requests it answered, recomputed from the
    responses (usage and the replica header) over this test's own requests:

    - request_success and generation_tokens grew by the number of answers and the sum
      of their completion_tokens;
    - every generated token is the request's first token, the one token each decode
      step emits (the target's own), or an accepted draft. With vLLM's decode
      request-steps counted by DSpine's verified-length histogram (0-draft steps
      included): sum(completion_tokens - 1) = steps + accepted, i.e. the accepted
      counter equals the accepted drafts the answers imply (greedy, ignore_eos, no
      overshoot past max_tokens: DSpine caps verified drafts at the remaining budget);
    - the histogram's sum is vLLM's draft-token counter and its non-zero observations
      vLLM's draft counter; speculation ran on both replicas (drafts > 0).
    """
    import httpx

    before = _replica_pages(cluster.base)
    answers: dict[str, list[int]] = {}  # replica -> completion_tokens of each answer
    for i in range(40):
        route, body = REQUESTS["completion" if i % 2 else "chat"]
        r = httpx.post(cluster.base + route, json=body, timeout=180)
        assert r.status_code == 200, r.text
        answers.setdefault(r.headers[REPLICA_HEADER], []).append(
            r.json()["usage"]["completion_tokens"])
        if len(answers) == 2 and min(len(v) for v in answers.values()) >= 4:
            break
    assert len(answers) == 2 and min(len(v) for v in answers.values()) >= 4, answers
    after = _replica_pages(cluster.base)
    assert set(after) == set(before) == set(answers), (set(before), set(after), answers)
    for replica, tokens in answers.items():
        check_counters_account_for(before[replica], after[replica], tokens, where=replica)


@pytest.mark.full
def test_killed_replica_others_keep_answering(cluster, reference):
    """Four clients send long greedy requests (half of them streamed) while one replica
    is killed. Every answer that arrives is whole and equals `vllm serve`'s; requests
    lost with the killed replica fail visibly (an error status, a broken connection or
    a stream without [DONE]); the surviving replica answers every request that starts
    after the kill, each exactly once (its engine finished as many requests as it
    answered); Serve starts a replacement, which answers like the others."""
    import httpx
    import ray

    GRACE = 3.0  # s
    ref = reference["long"]
    first_text, victim = _post(cluster.base, "long")
    assert first_text == ref
    results: list[dict] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int):
        n = 0
        while not stop.is_set():
            n += 1
            streamed = (i + n) % 2 == 0
            started = time.time()
            rec = {"started": started, "streamed": streamed}
            try:
                if streamed:
                    text, replica, complete = _stream(cluster.base, "long", timeout=120)
                    rec.update(text=text, replica=replica, complete=complete, ok=complete)
                else:
                    route, body = REQUESTS["long"]
                    r = httpx.post(cluster.base + route, json=body, timeout=120)
                    rec.update(status=r.status_code, replica=r.headers.get(REPLICA_HEADER),
                               ok=r.status_code == 200)
                    if r.status_code == 200:
                        rec["text"] = _answer(route, r.json())
            except (httpx.HTTPError, AssertionError) as e:
                rec.update(ok=False, error=repr(e))
            rec["ended"] = time.time()
            with lock:
                results.append(rec)

    def survivor_successes() -> float:
        # vLLM's finished-request counter of the replica that answers /metrics
        for _ in range(200):
            r = httpx.get(cluster.base + "/metrics", timeout=30)
            if r.headers[REPLICA_HEADER] != victim:
                return r.headers[REPLICA_HEADER], metric_page(r.text).get(
                    "vllm:request_success_total", 0)
        raise AssertionError("no /metrics answer from the surviving replica")

    survivor, before = survivor_successes()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    # Kill the victim once the clients are running (each has a request in flight all
    # the time, about half of them on the victim).
    time.sleep(2)
    killed_at = time.time()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#DSpine#{victim}", namespace="serve"),
             no_restart=True)
    time.sleep(10)
    stop.set()
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads)
    survivor_again, after = survivor_successes()
    assert survivor_again == survivor

    ok = [r for r in results if r["ok"]]
    failed = [r for r in results if not r["ok"]]
    summary = [(round(r["started"] - killed_at, 1), r["ok"], r.get("replica"),
                r.get("status"), r.get("error", "")[:80]) for r in results]
    print("requests (start - kill s, ok, replica, status, error):", *summary, sep="\n  ")
    # Whole answers only: every success is exactly vllm serve's answer.
    for r in ok:
        assert r["text"] == ref, r
    # Every request that started after the kill was answered, by the survivor (or by
    # the replacement, should it be up already), never by the victim. (Serve's router
    # retries a request that a dead replica did not accept; GRACE covers requests that
    # reached the victim while ray.kill was still taking effect.)
    after_kill = [r for r in results if r["started"] > killed_at + GRACE]
    assert after_kill and all(r["ok"] and r["replica"] != victim for r in after_kill), \
        summary
    # Failures: only requests that were in flight when the victim died.
    assert all(r["started"] <= killed_at + GRACE for r in failed), summary
    assert all(r.get("replica") in (None, victim) for r in failed), summary
    assert len(failed) <= 4, summary
    # Exactly once: the survivor's engine finished as many requests as it answered.
    answered_by_survivor = sum(1 for r in ok if r["replica"] == survivor)
    assert after - before == answered_by_survivor, (after, before, summary)

    # Serve replaces the dead replica: two running again, a new one among them.
    _wait_for(lambda: cluster.running_replicas() == 2, 400, "a replacement replica")
    replicas = set()

    def new_one():
        text, replica = _post(cluster.base, "completion")
        assert text == reference["completion"], (replica, text)
        replicas.add(replica)
        return replicas - {survivor, victim}

    _wait_for(new_one, 120, "an answer from the replacement", every=0)


@pytest.mark.full
def test_replica_without_plugin_fails_the_deployment(cluster, pair, monkeypatch):
    """VLLM_PLUGINS without 'dspine' in the replicas' environment: vLLM would not load
    the plugin, so the replica refuses to start and the deployment fails with the
    reason (Serve tries the constructor 3 times per replica)."""
    from ray import serve

    from vllm_dspine.serving.ray_serve import build_app

    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    app = build_app(pair.target_dir, pair.draft_dir, serve_args=SERVE_ARGS,
                    ray_actor_options={"num_cpus": 0})
    monkeypatch.delenv("VLLM_PLUGINS")
    try:
        with pytest.raises(RuntimeError):
            serve.run(app, name="noplugin", route_prefix="/noplugin")
        message = serve.status().applications["noplugin"].deployments["DSpine"].message
        assert "PluginNotInstalledError" in message and "VLLM_PLUGINS" in message, message
    finally:
        serve.delete("noplugin")


@pytest.mark.full
def test_shutdown_leaves_no_process_and_no_port(cluster):
    import psutil

    procs = _marked_processes(cluster.marker)
    names = sorted({" ".join(p.cmdline())[:60] for p in procs})
    assert len(procs) >= 6, names  # gcs, raylet, controller, proxy, 2 replicas, ...
    ports = {cluster.port}
    for p in procs:
        try:
            ports |= {c.laddr.port for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    cluster.stop()

    def gone():
        return not _marked_processes(cluster.marker)

    try:
        _wait_for(gone, 60, "the cluster's processes to exit")
    except AssertionError:
        left = [(p.pid, " ".join(p.cmdline())[:100]) for p in _marked_processes(cluster.marker)]
        raise AssertionError(f"processes left after shutdown: {left}") from None
    def still_listening():
        return ports & {c.laddr.port for c in psutil.net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN}

    # Ray's helper processes that do not carry the marker (spawned with a fresh
    # environment) can take a few seconds longer to go on a loaded machine; a port that
    # is still held after a minute is a leak.
    _wait_for(lambda: not still_listening(), 60,
              f"the cluster's ports to close ({sorted(ports)})")


# --------------------------------------------------- no cluster: checks in the caller
@pytest.mark.parametrize("kwargs, words", [
    pytest.param(dict(draft="/nonexistent-draft"), "config.json", id="no-draft-folder"),
    pytest.param(dict(speculative_config={"method": "dflash"}), "method",
                 id="method-override"),
    pytest.param(dict(speculative_config={"num_speculative_tokens": 7}),
                 "num_speculative_tokens", id="spec-tokens-override"),
    pytest.param(dict(num_replicas=0), "num_replicas", id="zero-replicas"),
    pytest.param(dict(serve_args=["--port", "8001"]), "--port", id="port-flag"),
    pytest.param(dict(serve_args=["--host=0.0.0.0"]), "--host", id="host-flag"),
    pytest.param(dict(serve_args=["--api-server-count", "2"]), "--api-server-count",
                 id="api-server-count"),
    pytest.param(dict(serve_args=["--speculative-config", "{}"]), "speculative",
                 id="speculative-config-flag"),
    pytest.param(dict(serve_args=["--no-such-flag", "1"]), "no-such-flag", id="unknown-flag"),
    pytest.param(dict(serve_args="--dtype float32"), "list of strings", id="args-string"),
    pytest.param(dict(serve_args=["--enable-auto-tool-choice"]), "tool-call-parser",
                 id="vllm-serve-check"),
    pytest.param(dict(deployment_options={"num_replicas": 3}), "num_replicas",
                 id="num-replicas-in-options"),
])
def test_build_app_refuses_bad_arguments(tmp_path, kwargs, words):
    engine_env()
    from vllm_dspine.config import RELEASED_QWEN38_27B
    from vllm_dspine.serving.ray_serve import build_app

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(RELEASED_QWEN38_27B))  # block 16
    args = {"target": "some/target", "draft": str(draft), **kwargs}
    with pytest.raises(ValueError, match=words):
        build_app(args.pop("target"), args.pop("draft"), **args)


_WITHOUT_PACKAGE = r"""
import asyncio, importlib.metadata as md, sys

class Hide:  # this Python "lacks" vllm-dspine: no module, no entry point
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm_dspine":
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Hide())
_entry_points = md.entry_points
md.entry_points = lambda **kw: [e for e in _entry_points(**kw)
                                if not e.value.startswith("vllm_dspine")]
from ray import cloudpickle

cls = cloudpickle.loads(sys.stdin.buffer.read())
replica = cls.__new__(cls)
try:
    asyncio.run(cls.__init__(replica, "t", [], {}, {}, "0.1.0"))
except Exception as e:
    print(type(e).__name__, e)
"""


def test_worker_without_the_package_says_so():
    """The replica class travels by value: a Ray worker whose Python lacks vllm-dspine
    unpickles it and fails with PluginNotInstalledError naming the fix, not with a
    ModuleNotFoundError from the unpickler."""
    from ray import cloudpickle
    from ray import serve

    from vllm_dspine.serving import ray_serve

    ray_serve._ship_by_value()
    payload = cloudpickle.dumps(serve.ingress()(ray_serve.DSpineReplica))
    out = subprocess.run([sys.executable, "-c", _WITHOUT_PACKAGE], input=payload,
                         capture_output=True, timeout=120)
    text = out.stdout.decode()
    assert text.startswith("PluginNotInstalledError"), (text, out.stderr.decode()[-2000:])
    assert "vllm-dspine is not installed" in text and "entry point" in text, text
