"""Multi-instance serving through Ray Serve (docs/design.md section 3, last bullet): every replica
is one vLLM `AsyncLLM` with `"method": "dspine"` speculation behind vLLM's own
OpenAI-compatible app, the one `vllm serve` runs. Optional: `pip install
"vllm-dspine[ray]"` (`ray[serve]==2.60.0`).

    from ray import serve
    from vllm_dspine.serving.ray_serve import build_app

    serve.run(build_app(TARGET, DRAFT_DIR, num_replicas=2,
                        serve_args=["--dtype", "bfloat16", "--max-model-len", "32768"],
                        ray_actor_options={"num_gpus": 1}),
              name="dspine", route_prefix="/")

`serve_args` are `vllm serve` flags (everything after the model). Each replica parses
them with vLLM's own parser, starts the engine the way `vllm serve` does
(`vllm.entrypoints.launchers.api_server.entry.build_async_engine_client`) and hands Serve
vLLM's FastAPI app (`vllm.entrypoints.launchers.build_app` + `init_app_state`) through
Serve's late-bound ingress (`@serve.ingress()` with `__serve_build_asgi_app__`). So every
route of `vllm serve` (chat and text completions, streaming, tools, structured outputs,
`/tokenize`, `/metrics`, `/health`, ...) is vLLM's code; nothing here parses a request or
writes a stream. Why not `ray.serve.llm`: docs/ray-serve.md.

This module must stay importable without vLLM and without the rest of vllm_dspine: the
replica class is shipped to the Ray workers by value (see `_ship_by_value`), so that a
worker whose Python lacks the package gets `PluginNotInstalledError`, not a bare
`ModuleNotFoundError` while unpickling. Import vLLM and vllm_dspine inside functions only.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

try:
    from ray import serve
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "vllm_dspine.serving.ray_serve needs Ray Serve: pip install 'vllm-dspine[ray]' "
        f"(ray[serve]==2.60.0); import failed: {e}") from e

# Environment a replica needs before it imports vLLM, forwarded from the process that
# calls build_app() when set there: Ray workers of a cluster started with `ray start`
# do not inherit the driver's environment. scripts/env.sh sets the CPU ones.
FORWARDED_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS",
                 "VLLM_LOGGING_LEVEL", "VLLM_LOG_STATS_INTERVAL", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "HF_HOME")

# Response header naming the Serve replica that answered (every route, /metrics too).
REPLICA_HEADER = "x-dspine-replica"

# Concurrent requests Serve hands one replica. vLLM batches and queues them itself, so
# this is generous rather than Serve's default of 5.
MAX_ONGOING_REQUESTS = 128

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_ENTRY = "vllm_dspine.plugin:register"
DISTRIBUTION = "vllm-dspine"

# `vllm serve` flags that have no meaning inside a Serve replica (Serve's proxy owns the
# socket; a replica is one API server with one engine), by argparse dest.
_REFUSED_FLAGS = {
    "host": "Serve's HTTP proxy listens for the replicas: serve.start(http_options=...)",
    "port": "Serve's HTTP proxy listens for the replicas: serve.start(http_options=...)",
    "uds": "Serve's HTTP proxy listens for the replicas",
    "headless": "each replica is an API server with its own engine",
    "api_server_count": "each replica is one API server; add replicas instead",
    "grpc": "Serve's proxy speaks HTTP to this app",
    "data_parallel_size": "replicas are the data parallelism: raise num_replicas",
    "speculative_config": "build_app sets it; pass DSpine keys as speculative_config=",
    "model": "pass the model as build_app's `target`",
    "ssl_keyfile": "TLS ends at Serve's proxy (or in front of it)",
    "ssl_certfile": "TLS ends at Serve's proxy (or in front of it)",
}


class PluginNotInstalledError(RuntimeError):
    """The Python a Ray worker runs lacks vllm-dspine, or vLLM would not load its plugin."""


# ------------------------------------------------------------- checks in the replica
def check_plugin_installed(driver_version: str | None = None) -> None:
    """Raise PluginNotInstalledError unless this process's Python has vllm-dspine's
    `vllm.general_plugins` entry point (and, if `driver_version` is given, the same
    version as the process that built the app) and VLLM_PLUGINS does not exclude it.
    Reads package metadata only: runs before vLLM is imported."""
    where = f"{sys.executable} on {os.uname().nodename}"
    entries = [e for e in importlib.metadata.entry_points(group=PLUGIN_GROUP)
               if e.value.replace(" ", "") == PLUGIN_ENTRY]
    if not entries:
        raise PluginNotInstalledError(
            f"vllm-dspine is not installed in the Python this Ray worker runs ({where}): "
            f"no '{PLUGIN_GROUP}' entry point '{PLUGIN_ENTRY}', so vLLM would not know "
            f"the 'dspine' method. Install the same vllm-dspine as the driver's into that "
            f"environment on every node (pip install 'vllm-dspine[ray,gpu]', or "
            f"'[ray,cpu]'), or start the Ray workers from the environment that has it.")
    if driver_version is not None:
        try:
            here = importlib.metadata.version(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            here = None
        if here != driver_version:
            raise PluginNotInstalledError(
                f"vllm-dspine {here} is installed in the Python this Ray worker runs "
                f"({where}), the driver has {driver_version}: install the same version "
                f"on every node")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and entries[0].name not in {p.strip() for p in allowed.split(",")}:
        raise PluginNotInstalledError(
            f"VLLM_PLUGINS={allowed!r} in this Ray worker ({where}) leaves out "
            f"'{entries[0].name}', so vLLM would not load the DSpine plugin: add it "
            f"(VLLM_PLUGINS='{allowed},{entries[0].name}') or unset VLLM_PLUGINS")


def _check_plugin_registered() -> None:
    # vLLM's load_general_plugins() runs our entry point; it is what vLLM runs in every
    # process it starts (engine core, workers), so registering by hand here would hide
    # a setup in which those processes lack the plugin.
    from vllm.plugins import load_general_plugins

    from vllm_dspine import plugin

    load_general_plugins()
    if not plugin.is_registered():
        raise PluginNotInstalledError(
            "vLLM's load_general_plugins() did not run vllm_dspine.plugin:register in "
            "this Ray worker: check VLLM_PLUGINS and that vllm-dspine is installed in "
            "the Python the Ray workers run")


# ------------------------------------------------------------------ vllm serve args
def _parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _Parser(FlexibleArgumentParser):
        def error(self, message):  # argparse would exit the replica (or the driver)
            raise ValueError(f"serve_args: {message}")

    return make_arg_parser(_Parser(prog="vllm serve (Ray Serve replica)"))


def parse_serve_args(target: str, serve_args: Sequence[str], spec: dict | None = None):
    """`vllm serve TARGET *serve_args --speculative-config SPEC` as vLLM's own parser and
    checks read it (the argparse.Namespace `vllm serve` would run with). Raises
    ValueError for flags that do not belong in a replica (`_REFUSED_FLAGS`)."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    serve_args = list(serve_args)
    defaults = _parser().parse_args([target])
    given = _parser().parse_args([target, *serve_args])
    for dest, why in _REFUSED_FLAGS.items():
        if getattr(given, dest, None) != getattr(defaults, dest, None):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"serve_args sets {flag}: not in a Ray Serve replica ({why})")
    if given.model_tag != target:
        raise ValueError(f"serve_args names a model ({given.model_tag!r}); pass it as "
                         f"`target`")
    cli = [target, *serve_args]
    if spec is not None:
        cli += ["--speculative-config", json.dumps(spec)]
    args = _parser().parse_args(cli)
    args.model = args.model_tag  # what `vllm serve` does with the positional model
    try:
        validate_parsed_serve_args(args)
    except TypeError as e:  # vLLM raises TypeError for some flag combinations
        raise ValueError(f"serve_args: {e}") from e
    return args


# ---------------------------------------------------------------------- the replica
def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica
        return "local"


class _ReplicaHeader:
    """vLLM's app with `REPLICA_HEADER: <replica id>` added to every HTTP response. A
    wrapper, not `app.add_middleware`: vLLM's app has built its middleware stack by the
    time it is handed over. Attributes Serve reads from the app (`add_exception_handler`,
    `docs_url`, ...) are the wrapped app's."""

    def __init__(self, app, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    def __getattr__(self, name):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        return await self.app(scope, receive, send_with_header)


class DSpineReplica:
    """One Serve replica: `vllm serve TARGET *serve_args --speculative-config SPEC` minus
    the socket. Deployed by build_app() (wrapped with `serve.ingress()`)."""

    async def __init__(self, target: str, serve_args: list[str], spec: dict, env: dict,
                       driver_version: str | None = None):
        os.environ.update(env)  # before the first vLLM import in this process
        check_plugin_installed(driver_version)
        from contextlib import AsyncExitStack

        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

        cli_env_setup()  # what `vllm serve` sets up before parsing
        self._args = parse_serve_args(target, serve_args, spec)
        _check_plugin_registered()
        self._replica = _replica_id()
        self._stack = AsyncExitStack()
        # vLLM's own engine start and stop (the context `vllm serve` runs in); the
        # stack's exit (in __del__) shuts the engine down.
        self._engine = await self._stack.enter_async_context(
            build_async_engine_client(self._args))

    async def __serve_build_asgi_app__(self):
        # What vLLM's build_and_serve() does before it binds a socket.
        import types

        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app as build_vllm_app

        tasks = await self._engine.get_supported_tasks()
        app = build_vllm_app(self._args, tasks, self._engine.model_config)
        await init_app_state(self._engine, app.state, self._args, tasks)
        # vLLM's engine-error handler flips `should_exit` on the uvicorn server its
        # launcher stores here. Under Serve there is none: a dead engine fails
        # check_health() below and Serve replaces the replica.
        app.state.server = types.SimpleNamespace(should_exit=False)
        return _ReplicaHeader(app, self._replica)

    async def check_health(self) -> None:
        # Serve calls this periodically; raising marks the replica unhealthy and Serve
        # replaces it (a dead engine core cannot come back inside the same replica).
        await self._engine.check_health()

    async def __del__(self):
        stack = getattr(self, "_stack", None)
        if stack is not None:
            self._stack = None
            await stack.aclose()


def _ship_by_value() -> None:
    """Pickle this module's functions and classes by value when Serve ships the
    deployment, so a worker without vllm-dspine can run `check_plugin_installed` and
    say so, instead of failing to unpickle a class from a module it cannot import."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------- public
def build_app(target: str, draft: str, *, num_replicas: int = 1,
              serve_args: Sequence[str] = (), speculative_config: dict | None = None,
              ray_actor_options: dict | None = None,
              deployment_options: dict | None = None,
              name: str = "DSpine") -> serve.Application:
    """A Ray Serve application of `num_replicas` replicas, each vLLM's OpenAI server
    around one engine serving `target` with the DSpine drafter in `draft`.

    serve_args: `vllm serve` flags (after the model), e.g. `["--dtype", "bfloat16"]`;
    flags that make no sense in a replica (`--host`, `--port`, `--api-server-count`,
    `--data-parallel-size`, `--speculative-config`, ...) are refused.
    speculative_config: extra DSpine keys for the speculative config (e.g.
    `{"dspine_retrieval": "bf16"}`); `method`, `model` and `num_speculative_tokens` are
    set here (the latter to the draft's block_size - 1) and may not be changed.
    ray_actor_options: Ray resources of each replica, e.g. `{"num_gpus": 1}` (Serve's
    default is one CPU). deployment_options: further `serve.deployment` options
    (`autoscaling_config`, `health_check_period_s`, `max_ongoing_requests`, ...).
    Everything is checked here, in the caller, before any replica starts (a ValueError).
    """
    from vllm_dspine.config import DSpineConfig

    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be a model path or hub id, got {target!r}")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    if isinstance(serve_args, str) or not all(isinstance(a, str) for a in serve_args):
        raise ValueError("serve_args must be a list of strings (vllm serve flags), got "
                         f"{serve_args!r}")
    if speculative_config is not None and not isinstance(speculative_config, dict):
        raise ValueError("speculative_config must be a dict of DSpine keys (e.g. "
                         f"{{'dspine_retrieval': 'bf16'}}), got {speculative_config!r}")
    extra = dict(speculative_config or {})
    # The draft's config.json is read here, so a wrong folder fails in the caller
    # instead of in every replica Serve retries. A local target path is made absolute
    # (replicas do not run in the caller's working directory).
    draft = os.path.abspath(str(draft))
    config = DSpineConfig.from_pretrained(draft)
    if os.path.isdir(target):
        target = os.path.abspath(target)
    spec = {"method": "dspine", "model": draft, "num_speculative_tokens": config.num_proposals}
    for key, want in spec.items():
        if key in extra and extra[key] != want:
            raise ValueError(f"speculative_config[{key!r}] is {extra[key]!r}; build_app "
                             f"sets it to {want!r}: remove the key")
    spec.update(extra)
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass  # a driver without vLLM: each replica parses and checks the same
    else:
        parse_serve_args(target, serve_args, spec)

    options = {"max_ongoing_requests": MAX_ONGOING_REQUESTS, **dict(deployment_options or {})}
    for key in ("num_replicas", "ray_actor_options", "name"):
        if key in options:
            raise ValueError(f"deployment_options[{key!r}]: use build_app's {key}=")
    if "autoscaling_config" in options and num_replicas != 1:
        raise ValueError("give either num_replicas or deployment_options"
                         "['autoscaling_config'], not both")
    if "autoscaling_config" not in options:
        options["num_replicas"] = num_replicas
    try:
        driver_version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        driver_version = None
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}

    _ship_by_value()
    deployment = serve.deployment(
        serve.ingress()(DSpineReplica), name=name,
        ray_actor_options=dict(ray_actor_options or {}), **options)
    return deployment.bind(target, list(serve_args), spec, env, driver_version)
