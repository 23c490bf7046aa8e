"""Multi-instance serving through Ray Serve: each replica one vLLM `AsyncLLM` with the
DSpine proposer (DESIGN section 3, last bullet). Optional: needs `pip install
"vllm-dspine[ray]"` (`ray[serve]==2.60.0`).

    from ray import serve
    from vllm_dspine.serving.ray_serve import build_app

    serve.run(build_app(TARGET, DRAFT_DIR, num_replicas=2,
                        engine_kwargs={"dtype": "bfloat16"}))

Routes of every replica (FastAPI ingress):
  POST /v1/completions   OpenAI-style completion (one prompt; `stream: true` gives SSE)
  GET  /v1/models        the served model name
  GET  /stats            vLLM's spec-decode counters of the replica that answers
  GET  /health           200 while the replica's engine is alive

Ray Serve's own LLM API (`ray.serve.llm`, `ray[llm]==2.60.0`) pins vLLM 0.29.0, so it is
not used: this is a small deployment of our own. See docs/ray-serve.md.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "vllm_dspine.serving.ray_serve needs Ray Serve: pip install 'vllm-dspine[ray]' "
        f"(ray[serve]==2.60.0); import failed: {e}") from e

# Environment the replica needs before it imports vLLM, forwarded from the process that
# calls build_app() when set there (Ray workers of an external `ray start` cluster do
# not inherit the driver's environment). scripts/env.sh sets the CPU ones.
FORWARDED_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS",
                 "VLLM_LOGGING_LEVEL", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "TOKENIZERS_PARALLELISM")

# Response header naming the replica that answered a completion (its /stats "replica").
REPLICA_HEADER = "x-dspine-replica"

# Concurrent requests Serve hands one replica; vLLM batches and queues them itself, so
# this is generous rather than Serve's default of 5.
MAX_ONGOING_REQUESTS = 128

# Fields /v1/completions accepts. Anything else is refused with 400 (nothing is
# silently ignored): "n", "best_of", "echo", "logprobs", "suffix" are not implemented.
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "stop", "ignore_eos", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
_ACCEPTED_FIELDS = frozenset(("prompt", "model", "stream", "user") + _SAMPLING_FIELDS)


# ----------------------------------------------------------------------- requests
class BadRequest(ValueError):
    """A client mistake: answered with `status` (400, or 404 for an unknown model)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class CompletionRequest:
    prompt: dict  # vLLM TextPrompt {"prompt": str} or TokensPrompt {"prompt_token_ids": [...]}
    sampling: dict  # keyword arguments of vllm.SamplingParams
    stream: bool = False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_completion_request(body: Any, served_model: str) -> CompletionRequest:
    """Check a /v1/completions JSON body; raise BadRequest naming the field and the fix.

    Only the shape is checked here; value ranges (temperature < 0, top_p > 1, ...) are
    left to `vllm.SamplingParams`, whose VLLMValidationError the route also answers
    with 400.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - _ACCEPTED_FIELDS)
    if unknown:
        raise BadRequest(f"unsupported field(s) {unknown}; this endpoint accepts "
                         f"{sorted(_ACCEPTED_FIELDS)}")
    model = body.get("model")
    if model is not None and model != served_model:
        raise BadRequest(f"the model {model!r} does not exist; this server serves "
                         f"{served_model!r}", status=404)

    if "prompt" not in body:
        raise BadRequest("missing field 'prompt' (a string or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI clients send ["text"] for one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty")
        engine_prompt = {"prompt": prompt}
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        engine_prompt = {"prompt_token_ids": list(prompt)}
    else:
        raise BadRequest("'prompt' must be a non-empty string or a non-empty list of "
                         "token ids (one prompt per request; send a batch as separate "
                         "requests)")

    max_tokens = body.get("max_tokens", 16)  # OpenAI's default
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    sampling: dict = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            if not _is_number(body[name]):
                raise BadRequest(f"'{name}' must be a number, got {body[name]!r}")
            sampling[name] = float(body[name])
    sampling.setdefault("temperature", 1.0)  # OpenAI's default
    for name in ("top_k", "seed"):
        if body.get(name) is not None:
            if not _is_int(body[name]):
                raise BadRequest(f"'{name}' must be an integer, got {body[name]!r}")
            sampling[name] = body[name]
    if body.get("stop") is not None:
        stop = body["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("'stop' must be a string or a list of non-empty strings")
        sampling["stop"] = stop
    for name in ("ignore_eos",):
        if body.get(name) is not None:
            if not isinstance(body[name], bool):
                raise BadRequest(f"'{name}' must be true or false, got {body[name]!r}")
            sampling[name] = body[name]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    return CompletionRequest(engine_prompt, sampling, stream)


def _error(message: str, status: int) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


# -------------------------------------------------------------------- statistics
@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters (the same numbers as `vllm:spec_decode_*`), summed
    over the life of one replica's engine."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [K]

    def add(self, stats) -> None:  # stats: vllm.v1.spec_decode.metrics.SpecDecodingStats
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = list(stats.num_accepted_tokens_per_pos)
        if len(self.num_accepted_tokens_per_pos) < len(per_pos):
            self.num_accepted_tokens_per_pos += [0] * (
                len(per_pos) - len(self.num_accepted_tokens_per_pos))
        for i, n in enumerate(per_pos):
            self.num_accepted_tokens_per_pos[i] += n

    def as_dict(self) -> dict:
        mean = (1.0 + self.num_accepted_tokens / self.num_drafts) if self.num_drafts else None
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "mean_acceptance_length": mean}


def _stat_logger_factory(counters: SpecDecodeCounters):
    """A per-engine stat-logger factory for `AsyncLLM(stat_loggers=[...])` that adds each
    step's `scheduler_stats.spec_decoding_stats` into `counters`. vLLM's default loggers
    (log lines, Prometheus) stay on beside it."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SpecDecodeCounterLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0):
            if scheduler_stats is not None and scheduler_stats.spec_decoding_stats:
                counters.add(scheduler_stats.spec_decoding_stats)

        def log_engine_initialized(self):
            pass

    # A plain callable (not a class) so vLLM wraps it per engine
    # (PerEngineStatLoggerAdapter) and calls it as factory(vllm_config, engine_index).
    return lambda vllm_config, engine_index: _SpecDecodeCounterLogger(vllm_config,
                                                                      engine_index)


# ---------------------------------------------------------------------- deployment
def _replica_id() -> str:
    # Defined above DSpineServer on purpose: @serve.ingress freezes (pickles) the
    # FastAPI app when the class is decorated, so route code sees only the module
    # globals that exist at that point.
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (direct calls in tests)
        return "local"


_api = FastAPI(title="vllm-dspine on Ray Serve")


@serve.ingress(_api)
class DSpineServer:
    """One Serve replica: a vLLM AsyncLLM with `"method": "dspine"` speculation."""

    def __init__(self, target: str, spec: dict, engine_kwargs: dict, env: dict):
        # spec: the full speculative_config dict ({"method": "dspine", ...}), built and
        # checked by build_app(); engine_kwargs: the other AsyncEngineArgs fields.
        os.environ.update(env)  # before the first vLLM import in this process
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm_dspine import plugin

        kwargs = dict(engine_kwargs)
        # EngineArgs.__post_init__ runs vLLM's load_general_plugins(), which registers
        # our entry point in this process (and vLLM does the same in the engine-core
        # and worker processes it spawns).
        args = AsyncEngineArgs(model=target, speculative_config=dict(spec), **kwargs)
        if not plugin.is_registered():
            raise RuntimeError(
                "the vllm_dspine plugin did not register in this Ray Serve replica: "
                "install vllm-dspine into the Python the Ray workers run, and if "
                "VLLM_PLUGINS is set, include 'dspine' in it")
        served = kwargs.get("served_model_name") or target
        self._model_name = served if isinstance(served, str) else served[0]
        self._counters = SpecDecodeCounters()
        self._engine = AsyncLLM.from_engine_args(
            args, stat_loggers=[_stat_logger_factory(self._counters)])

    # --- Serve hooks
    async def check_health(self) -> None:
        # Serve calls this periodically; raising marks the replica unhealthy and Serve
        # replaces it (a dead engine core cannot come back inside the same replica).
        await self._engine.check_health()

    def __del__(self):
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()

    # --- routes
    @_api.get("/health")
    async def health(self):
        try:
            await self._engine.check_health()
        except Exception as e:  # the engine is dead: say so, Serve will replace us
            return _error(f"engine is not healthy: {e}", 503)
        return {"status": "ok"}

    @_api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self._model_name, "object": "model",
                                            "owned_by": "vllm-dspine"}]}

    @_api.get("/stats")
    async def stats(self):
        return {"replica": _replica_id(), "model": self._model_name,
                "spec_decode": self._counters.as_dict()}

    @_api.post("/v1/completions")
    async def completions(self, request: Request):
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from e
            parsed = parse_completion_request(body, self._model_name)
            try:
                params = SamplingParams(
                    **parsed.sampling,
                    output_kind=(RequestOutputKind.DELTA if parsed.stream
                                 else RequestOutputKind.FINAL_ONLY))
            except (ValueError, TypeError, VLLMClientError) as e:
                # VLLMValidationError (a VLLMClientError, not a ValueError) names the field
                raise BadRequest(str(e)) from e
        except BadRequest as e:
            return _error(str(e), e.status)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        results = self._engine.generate(parsed.prompt, params, request_id)
        if parsed.stream:
            try:  # the first output surfaces bad prompts (too long, ...) as a 400
                first = await anext(results)
            except StopAsyncIteration:
                first = None
            except (ValueError, VLLMClientError) as e:
                return _error(str(e), 400)
            return StreamingResponse(
                self._sse(first, results, request_id, created),
                media_type="text/event-stream", headers={REPLICA_HEADER: _replica_id()})

        final = None
        try:
            async for out in results:
                final = out
        except (ValueError, VLLMClientError) as e:
            return _error(str(e), 400)
        assert final is not None and final.finished, "vLLM ended a request without output"
        choice = final.outputs[0]
        prompt_tokens = len(final.prompt_token_ids or [])
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created,
            "model": self._model_name,
            "choices": [{"index": 0, "text": choice.text, "logprobs": None,
                         "finish_reason": choice.finish_reason}],
            "usage": {"prompt_tokens": prompt_tokens,
                      "completion_tokens": len(choice.token_ids),
                      "total_tokens": prompt_tokens + len(choice.token_ids)},
        }, headers={REPLICA_HEADER: _replica_id()})

    async def _sse(self, first, results, request_id: str, created: int):
        def chunk(out) -> str:
            c = out.outputs[0]
            return "data: " + json.dumps({
                "id": request_id, "object": "text_completion", "created": created,
                "model": self._model_name,
                "choices": [{"index": 0, "text": c.text, "logprobs": None,
                             "finish_reason": c.finish_reason}]}) + "\n\n"

        if first is not None:
            yield chunk(first)
            async for out in results:  # cancelled on client disconnect: vLLM aborts
                yield chunk(out)
        yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------- public
def build_app(target: str, draft: str, *, num_replicas: int = 1,
              engine_kwargs: dict | None = None,
              ray_actor_options: dict | None = None) -> serve.Application:
    """A Ray Serve application of `num_replicas` vLLM engines serving `target` with the
    DSpine drafter in `draft` (`"num_speculative_tokens"`: the draft's block_size - 1,
    15 for the released drafter).

    engine_kwargs: further `vllm.AsyncEngineArgs` fields (dtype, max_model_len, ...);
    a `speculative_config` dict in it adds DSpine keys (e.g. `dspine_retrieval`) to the
    spec dict but may not change `method` or `model`. ray_actor_options: Ray resources of
    each replica (e.g. `{"num_gpus": 1}`; Serve's default is one CPU).
    Start it with `serve.run(build_app(...))`.
    """
    from vllm_dspine.config import DSpineConfig

    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be a model path or hub id, got {target!r}")
    if not _is_int(num_replicas) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    engine_kwargs = dict(engine_kwargs or {})
    if "model" in engine_kwargs:
        raise ValueError("engine_kwargs must not set 'model': pass it as `target`")
    extra_spec = engine_kwargs.pop("speculative_config", None) or {}
    if not isinstance(extra_spec, dict):
        raise ValueError("engine_kwargs['speculative_config'] must be a dict of extra "
                         "DSpine keys (e.g. {'dspine_retrieval': 'bf16'})")
    _check_engine_kwargs(engine_kwargs)
    # Reads and checks the draft's config.json here, so a wrong folder fails in the
    # caller instead of in every replica Serve retries.
    draft = os.path.abspath(str(draft))
    config = DSpineConfig.from_pretrained(draft)
    spec = {"method": "dspine", "model": draft,
            "num_speculative_tokens": config.num_proposals}
    for key, want in spec.items():
        if key in extra_spec and extra_spec[key] != want:
            raise ValueError(f"engine_kwargs['speculative_config'][{key!r}] is "
                             f"{extra_spec[key]!r}; build_app sets it to {want!r}: "
                             f"remove the key")
    spec.update(extra_spec)

    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    deployment = serve.deployment(
        DSpineServer, name="DSpineServer", num_replicas=num_replicas,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options=dict(ray_actor_options or {}))
    return deployment.bind(target, spec, engine_kwargs, env)


def _check_engine_kwargs(engine_kwargs: dict) -> None:
    """Refuse unknown engine arguments here, before a replica fails on them repeatedly.
    Reads the field names without importing vLLM's heavy modules when it is absent."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:  # the driver may lack vLLM; the replica will check
        return
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise ValueError(f"engine_kwargs has unknown vLLM engine argument(s) {unknown}; "
                         f"see vllm.AsyncEngineArgs")
