"""vLLM's Prometheus metrics: row `verified-drafts-metric` of table.py."""

from __future__ import annotations

import functools

from vllm_dspine.plugin.patches.guard import is_applied, mark_applied

VERIFIED_DRAFTS_METRIC = "vllm:dspine_verified_drafts"


def _dspine_spec_decoding_prom():
    """vLLM's SpecDecodingProm plus, for a DSpine draft, the verified-length histogram."""
    import prometheus_client
    from vllm.v1.metrics.utils import create_metric_per_engine
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    class DSpineSpecDecodingProm(SpecDecodingProm):
        def __init__(self, speculative_config, labelnames, per_engine_labelvalues,
                     is_diffusion: bool = False):
            super().__init__(speculative_config, labelnames, per_engine_labelvalues,
                             is_diffusion=is_diffusion)
            from vllm_dspine.hf_config import is_dspine_draft

            self.histogram_dspine_verified = None
            if is_diffusion or not is_dspine_draft(speculative_config):
                return
            K = speculative_config.num_speculative_tokens
            self.histogram_dspine_verified = create_metric_per_engine(
                prometheus_client.Histogram(
                    name=VERIFIED_DRAFTS_METRIC,
                    documentation="DSpine: drafts verified per request and step (0: the "
                                  "request decoded without drafts that step).",
                    labelnames=labelnames, buckets=[float(n) for n in range(K + 1)]),
                per_engine_labelvalues)

        def observe(self, spec_decoding_stats, engine_idx: int = 0):
            super().observe(spec_decoding_stats, engine_idx)
            hist = self.histogram_dspine_verified
            if hist is None:
                return
            # per_pos[t] = requests verifying more than t drafts this step.
            per_pos = list(spec_decoding_stats.num_draft_tokens_per_pos) + [0]
            for n in range(1, len(per_pos)):
                for _ in range(per_pos[n - 1] - per_pos[n]):
                    hist[engine_idx].observe(n)

        def observe_without_drafts(self, count: int, engine_idx: int = 0) -> None:
            if self.histogram_dspine_verified is not None:
                for _ in range(max(count, 0)):
                    self.histogram_dspine_verified[engine_idx].observe(0)

    return DSpineSpecDecodingProm


def patch_verified_drafts_metric() -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    record = PrometheusStatLogger.record
    if is_applied(record, "verified-drafts-metric"):
        return
    current = PrometheusStatLogger._spec_decoding_cls
    if current is not SpecDecodingProm:
        raise RuntimeError(
            "vllm-dspine: PrometheusStatLogger._spec_decoding_cls is not vLLM's "
            f"SpecDecodingProm ({current!r}); another plugin replaced it")

    @functools.wraps(record)
    def wrapped_record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx=0):
        out = record(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
        prom = self.spec_decoding_prom
        if iteration_stats is not None and hasattr(prom, "observe_without_drafts"):
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            drafted = spec.num_drafts if spec is not None else 0
            prom.observe_without_drafts(
                len(iteration_stats.inter_token_latencies_iter) - drafted, engine_idx)
        return out

    PrometheusStatLogger._spec_decoding_cls = mark_applied(_dspine_spec_decoding_prom(),
                                                           "verified-drafts-metric")
    PrometheusStatLogger.record = mark_applied(wrapped_record, "verified-drafts-metric")
