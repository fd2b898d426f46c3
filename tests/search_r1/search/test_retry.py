"""backoff_delay: base * 2**(attempt - 1) * U(1, 1.5), shared by the retriever client, web search and the
OpenAI-compatible backend."""
import pytest

from search_r1.search.retry import backoff_delay


def test_backoff_doubles_per_attempt_with_jitter():
    for attempt, low in ((1, 0.5), (2, 1.0), (3, 2.0)):  # 0.5 * 2**(attempt - 1)
        delays = [backoff_delay(attempt, 0.5) for _ in range(200)]
        assert all(low <= d < 1.5 * low for d in delays)
        assert max(delays) - min(delays) > 0.05 * low  # jittered, not lockstep
    assert backoff_delay(4, 0.0) == 0.0
    assert backoff_delay(2, 1.0, jitter=(1.0, 1.0)) == 2.0
    with pytest.raises(ValueError, match="from 1"):
        backoff_delay(0, 0.5)
