"""The autoscaler's inputs: Prometheus samples and p90s over sliding windows of cumulative histograms."""

from __future__ import annotations

import math

from ember.control.autoscaling.signals import (
    HistogramWindow,
    buckets,
    merged_p90,
    parse_samples,
    quantile,
    total,
)

EXPOSITION = """# TYPE ember_gateway_queue_depth gauge
ember_gateway_queue_depth{model="tiny"} 3.0
ember_gateway_queue_depth{model="other"} 5.0
# TYPE ember_gateway_requests counter
ember_gateway_requests_total{model="tiny",key="a",replica="r1",status="200"} 4.0
ember_gateway_requests_total{model="tiny",key="b",replica="r2",status="200"} 6.0
# TYPE ember_gateway_time_to_first_token_seconds histogram
ember_gateway_time_to_first_token_seconds_bucket{model="tiny",le="0.1"} 2.0
ember_gateway_time_to_first_token_seconds_bucket{model="tiny",le="1.0"} 8.0
ember_gateway_time_to_first_token_seconds_bucket{model="tiny",le="+Inf"} 10.0
ember_gateway_time_to_first_token_seconds_count{model="tiny"} 10.0
ember_gateway_time_to_first_token_seconds_sum{model="tiny"} 4.0
"""


def test_samples_sum_over_matching_labels_and_histograms_read_as_cumulative_buckets():
    samples = parse_samples(EXPOSITION)
    assert total(samples, "ember_gateway_queue_depth", model="tiny") == 3.0
    assert total(samples, "ember_gateway_requests_total", model="tiny") == 10.0
    assert total(samples, "ember_gateway_requests_total", model="none") == 0.0
    assert buckets(samples, "ember_gateway_time_to_first_token_seconds", model="tiny") == {0.1: 2.0, 1.0: 8.0, math.inf: 10.0}


def test_quantile_interpolates_within_the_bucket_like_histogram_quantile():
    counts = {0.1: 2.0, 1.0: 8.0, math.inf: 10.0}
    assert quantile(0.5, counts) == 0.1 + 0.9 * (5 - 2) / 6  # rank 5 of 10: 3 of the 6 in (0.1, 1]
    assert quantile(0.9, counts) == 1.0  # rank 9 falls in +Inf: the largest finite bound
    assert quantile(0.9, {0.1: 0.0, math.inf: 0.0}) is None


def test_a_window_counts_only_what_was_observed_inside_it_and_survives_a_counter_reset():
    window = HistogramWindow(horizon_s=30)
    window.record(0, {0.1: 100.0, 1.0: 100.0, math.inf: 100.0})  # 100 fast requests long ago
    window.record(25, {0.1: 100.0, 1.0: 100.0, math.inf: 100.0})
    window.record(28, {0.1: 100.0, 1.0: 110.0, math.inf: 110.0})  # 10 slow ones just now
    assert window.delta(28, 2) == {0.1: 0.0, 1.0: 10.0, math.inf: 10.0}
    assert 0.9 < window.p90(28, 2) <= 1.0
    assert math.isclose(window.p90(28, 30), 0.1 * 99 / 100)  # rank 99 of 110: among the 100 fast ones
    window.record(29, {0.1: 1.0, 1.0: 1.0, math.inf: 1.0})  # the process restarted
    assert window.delta(29, 2) == {0.1: 1.0, 1.0: 1.0, math.inf: 1.0}
    # Two replicas' windows merge bucket by bucket.
    other = HistogramWindow(horizon_s=30)
    other.record(29, {0.1: 0.0, 1.0: 9.0, math.inf: 9.0})
    assert math.isclose(merged_p90([window, other], 29, 2), 0.1 + 0.9 * 8 / 9)  # rank 9 of 10, 8th of 9 in (0.1, 1]
