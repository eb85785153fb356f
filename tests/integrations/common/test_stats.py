"""PatchStats: one counter per kind of fallback, whatever the trainer."""

from shared_prefix_logps.integrations.common.stats import PatchStats


def test_fallbacks_count_calls_and_reasons_once():
    stats = PatchStats()
    stats.count_fallback("multimodal inputs")
    stats.count_fallback("multimodal inputs")
    stats.count_fallback("chunked: return_outputs=True", log_prob_call=False)
    assert stats.fallback_calls == 2  # the chunked micro-batch is not a log-prob call
    assert stats.fallback_reasons == {"multimodal inputs": 2, "chunked: return_outputs=True": 1}
    assert "fallbacks: 2" in stats.summary()
