"""vLLM's own speculative-decoding counters, read one way wherever the project reads them
(bench/, tests/, examples/): from an engine in this process (`LLM.get_metrics()`) or from
a server's Prometheus page (`/metrics` of `vllm serve` or of a Ray Serve replica), and
what they give between two readings: the mean acceptance length and the acceptance rate
per draft position.

Both readers return the same dict: vLLM's counter name -> value, the per-position counter
(`vllm:spec_decode_num_accepted_tokens_per_pos`) as a list, position 1 first. The names are
the offline ones (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`); on a /metrics page vLLM adds
`_total` to each counter and gives the per-position one a sample per `position` label,
which `spec_decode_counters_of_page` undoes.

Also the page parsers the tests and bench/serve.py read whole pages with
(`metric_page`, `prometheus_samples`), and `read_own_metrics`, which makes each of several
engines in one process read its own counters. Standard library only, but for
prometheus_client (vLLM's), imported where `read_own_metrics` runs.
"""

from __future__ import annotations

import re

SPEC_DECODE = "vllm:spec_decode"
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counters(llm) -> dict:
    """vLLM's spec-decode counters of an engine in this process (`vllm.LLM`): name ->
    value, per-position counters as lists. vLLM's metrics registry is one per process:
    where several engines live in one process only the last one started is read
    (vLLM unregisters the earlier ones' collectors)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith(SPEC_DECODE):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def _vllm_collectors() -> list:
    from prometheus_client import REGISTRY

    return [c for c in list(REGISTRY._collector_to_names)
            if getattr(c, "_name", "").startswith("vllm:")]


def read_own_metrics(llm) -> None:
    """Makes `llm.get_metrics()` read this engine's counters even after other engines
    started in this process. vLLM's Prometheus registry is one per process and every new
    `LLM` unregisters the collectors of those before it (`unregister_vllm_metrics`); call
    this right after the engine is built: the collectors registered then (this engine's)
    are put back before each read."""
    from prometheus_client import REGISTRY

    collectors = _vllm_collectors()
    own_get_metrics = llm.get_metrics

    def get_metrics():
        for c in _vllm_collectors():
            REGISTRY.unregister(c)
        for c in collectors:
            REGISTRY.register(c)
        return own_get_metrics()

    llm.get_metrics = get_metrics


def spec_decode_counters_of_page(text: str) -> dict:
    """The same counters from a Prometheus text page (`GET /metrics`): samples summed over
    their labels (engines), `_total` dropped from the names, the per-position counter a
    list ordered by its `position` label (the `_created` timestamps left out)."""
    out: dict = {}
    per_pos: dict[int, float] = {}
    for name in sorted(n for n in _sample_names(text)
                       if n.startswith(SPEC_DECODE) and not n.endswith("_created")):
        base = name[:-len("_total")] if name.endswith("_total") else name
        for labels, value in prometheus_samples(text, name):
            pos = _label(labels, "position")
            if base == ACCEPTED_PER_POS and pos is not None:
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + value
            else:
                out[base] = out.get(base, 0.0) + value
    if per_pos:
        out[ACCEPTED_PER_POS] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


def acceptance(before: dict, after: dict, *more: tuple[dict, dict]
               ) -> tuple[float | None, list[float]]:
    """(mean acceptance length, acceptance rate per draft position) between two counter
    readings (`spec_decode_counters`, `spec_decode_counters_of_page`; `{}` for "since the
    engine started"), or over several (before, after) spans together (`more`). The mean
    acceptance length is 1 + accepted / drafts: tokens per verification step, the
    target's own included. (None, []) where no draft was verified."""
    drafts = acc = 0
    per_pos: list[float] = []  # accepted tokens per position, summed over the spans
    for b, a in ((before, after), *more):
        drafts += a.get(NUM_DRAFTS, 0) - b.get(NUM_DRAFTS, 0)
        acc += a.get(NUM_ACCEPTED, 0) - b.get(NUM_ACCEPTED, 0)
        pa = a.get(ACCEPTED_PER_POS) or []
        pb = b.get(ACCEPTED_PER_POS) or [0] * len(pa)
        span = [x - y for x, y in zip(pa, pb)]
        per_pos = [x + y for x, y in zip(per_pos, span)] if per_pos else span
    if not drafts:
        return None, []
    return 1 + acc / drafts, [x / drafts for x in per_pos]


# ------------------------------------------------------------------ Prometheus pages
def prometheus_samples(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of metric `name` in a Prometheus text page."""
    return [(m.group(1) or "", float(m.group(2))) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.eE+-]+|NaN|[+-]Inf)$", text, re.M)]


def metric_page(text: str) -> dict:
    """Sum of every sample of each metric (labels dropped) in a Prometheus text page;
    histogram buckets also by bound, as `NAME_bucket|le=BOUND`. Lines whose value is not
    a number are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[name] = out.get(name, 0.0) + value
            le = re.search(r'le="([^"]+)"', line)
            if name.endswith("_bucket") and le:
                key = f"{name}|le={float(le.group(1)):g}"
                out[key] = out.get(key, 0.0) + value
    return out


def _sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def _label(labels: str, key: str) -> str | None:
    m = re.search(rf'(?:^|,){re.escape(key)}="([^"]*)"', labels)
    return m.group(1) if m else None
