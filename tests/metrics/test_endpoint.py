"""merge_expositions: node pages in, one valid Prometheus page out, series passed through as they are."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics.endpoint import merge_expositions

# Two node pages as Ray 2.60 writes them (labels trimmed to the ones that matter here).
NODE_A = """# HELP ray_node_cpu_utilization Total CPU usage on a ray node
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{NodeAddress="n1"} 12.5
# HELP ray_raytp_prompt_tokens_total Number of prefill tokens processed.
# TYPE ray_raytp_prompt_tokens_total counter
ray_raytp_prompt_tokens_total{NodeAddress="n1",WorkerId="a1",model_name="m",replica="r1"} 30.0
# HELP ray_raytp_time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE ray_raytp_time_to_first_token_seconds histogram
ray_raytp_time_to_first_token_seconds_bucket{NodeAddress="n1",WorkerId="a1",le="0.5",model_name="m",replica="r1"} 1.0
ray_raytp_time_to_first_token_seconds_bucket{NodeAddress="n1",WorkerId="a1",le="+Inf",model_name="m",replica="r1"} 2.0
ray_raytp_time_to_first_token_seconds_count{NodeAddress="n1",WorkerId="a1",model_name="m",replica="r1"} 2.0
ray_raytp_time_to_first_token_seconds_sum{NodeAddress="n1",WorkerId="a1",model_name="m",replica="r1"} 1.75
# HELP ray_serve_num_http_requests_total The number of HTTP requests processed.
# TYPE ray_serve_num_http_requests_total counter
ray_serve_num_http_requests_total{application="app",method="POST",route="/v1",status_code="200"} 4.0
"""
NODE_B = """# HELP ray_raytp_prompt_tokens_total Number of prefill tokens processed.
# TYPE ray_raytp_prompt_tokens_total counter
ray_raytp_prompt_tokens_total{NodeAddress="n2",WorkerId="b7",model_name="m",replica="r2"} 12.0
# HELP ray_tasks Current number of tasks currently in a particular state.
# TYPE ray_tasks gauge
ray_tasks{State="RUNNING"} 3.0
"""


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def test_families_from_all_nodes_are_merged_and_series_kept() -> None:
    out = merge_expositions([NODE_A, NODE_B])
    samples = _samples(out)
    prompt = [(lab["replica"], v) for n, lab, v in samples if n == "ray_raytp_prompt_tokens_total"]
    assert sorted(prompt) == [("r1", 30.0), ("r2", 12.0)], "one series per node, not a sum"
    # One HELP and one TYPE per family, whichever node it came from.
    assert out.count("# TYPE ray_raytp_prompt_tokens_total counter") == 1
    assert out.count("# HELP ray_raytp_prompt_tokens_total Number of prefill tokens processed.") == 1
    assert ("ray_raytp_time_to_first_token_seconds_bucket", "+Inf") in {(n, lab.get("le")) for n, lab, _ in samples}
    assert ("ray_serve_num_http_requests_total", "200") in {(n, lab.get("status_code")) for n, lab, _ in samples}


def test_only_raytp_and_serve_families_are_kept() -> None:
    names = {n for n, _, _ in _samples(merge_expositions([NODE_A, NODE_B]))}
    assert names and all(n.startswith(("ray_raytp_", "ray_serve_")) for n in names)
    assert not any(n.startswith(("ray_node_", "ray_tasks")) for n in names)
    only_raytp = {n for n, _, _ in _samples(merge_expositions([NODE_A], prefixes=("ray_raytp_",)))}
    assert only_raytp and all(n.startswith("ray_raytp_") for n in only_raytp)


def test_a_series_repeated_across_pages_is_written_once() -> None:
    out = merge_expositions([NODE_A, NODE_A])
    assert _samples(out) == _samples(merge_expositions([NODE_A]))


def test_values_pass_through_unchanged() -> None:
    kept = {(n, tuple(sorted(lab.items()))): v for n, lab, v in _samples(NODE_A) if n.startswith("ray_raytp_")}
    merged = {(n, tuple(sorted(lab.items()))): v for n, lab, v in _samples(merge_expositions([NODE_A]))}
    assert {k: v for k, v in merged.items() if k[0].startswith("ray_raytp_")} == kept


def test_no_pages_is_an_empty_valid_page() -> None:
    assert _samples(merge_expositions([])) == []
