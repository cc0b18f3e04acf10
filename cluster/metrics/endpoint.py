"""`GET /metrics` on the API port: the application's series as Ray already exports them.

Ray's metrics agent on every node already aggregates the metrics of that node's processes and
serves them on the node's metrics port (what KubeRay's PodMonitors and Ray's service-discovery
file point Prometheus at). This endpoint adds no aggregation of its own: it reads the alive
nodes from Ray's node table, fetches each node's metrics port, keeps the raytp and Ray Serve
families, and concatenates them (families merged by name, series passed through unchanged, so
names, labels and values are exactly those on the node ports).

The two ways to scrape are therefore alternatives, not complements: scrape the node ports (the
cluster way) OR the API port's /metrics (the `vllm serve` way). Scraping both stores every series
twice under two jobs, and a `sum()` across jobs would double count.

Usage from the ingress (the route is one line):

    text = await application_metrics()
    return Response(text, media_type=CONTENT_TYPE)
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterable, Iterator, Sequence

import ray
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text exposition format
# raytp's engine series and Ray Serve's own (HTTP requests, errors, latency, replica health): what
# the generated dashboard queries, so a Prometheus that scrapes only /metrics fills every panel.
DEFAULT_PREFIXES: tuple[str, ...] = ("ray_raytp_", "ray_serve_")
FETCH_TIMEOUT_S = 5.0


def node_metrics_urls() -> list[str]:
    """The metrics port of every alive node, from Ray's node table (needs a connected Ray)."""
    return sorted(
        f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        for n in ray.nodes()
        if n.get("Alive") and n.get("MetricsExportPort")
    )


def _family_of(line: str) -> str:
    """The metric name a line of the text format is about ('' for other comments)."""
    if line.startswith("#"):
        parts = line.split(maxsplit=3)
        return parts[2] if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") else ""
    return line.split("{", 1)[0].split(" ", 1)[0]


def _keep(text: str, prefixes: Sequence[str]) -> str:
    # Cut the page down before parsing: a node's page holds thousands of Ray system series.
    return "\n".join(line for line in text.splitlines() if _family_of(line).startswith(tuple(prefixes))) + "\n"


class _Merged:
    """A prometheus_client collector over families merged from several node pages."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(texts: Iterable[str], prefixes: Sequence[str] = DEFAULT_PREFIXES) -> str:
    """One Prometheus text page holding the `prefixes` families of all `texts`, series unchanged.

    A family present on several nodes is written once (the text format allows one HELP/TYPE per
    family). Two nodes never export the same series (Ray labels each with its NodeAddress and
    WorkerId); should one repeat anyway, the first copy is kept, as Prometheus would refuse it.
    """
    by_name: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for text in texts:
        for fam in text_string_to_metric_families(_keep(text, prefixes)):
            merged = by_name.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in seen:
                    seen.add(key)
                    merged.samples.append(s)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([by_name[n] for n in sorted(by_name)]))
    return generate_latest(registry).decode()


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body: bytes = resp.read()
    return body.decode()


def collect(urls: Sequence[str], prefixes: Sequence[str] = DEFAULT_PREFIXES, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """Blocking: fetch `urls` one after another and merge them (for scripts and tests)."""
    pages, errors = [], []
    for url in urls:
        try:
            pages.append(_fetch(url, timeout_s))
        except OSError as e:
            errors.append(f"# raytp: skipped {url}: {e}")
    return _with_errors(merge_expositions(pages, prefixes), errors)


async def application_metrics(prefixes: Sequence[str] = DEFAULT_PREFIXES, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """What `GET /metrics` answers: every alive node's raytp and Serve series, fetched concurrently.

    A node that does not answer within timeout_s is skipped and named in a comment line of the
    page (Prometheus ignores comments), so one unreachable node cannot fail the whole scrape.
    """
    urls = await asyncio.to_thread(node_metrics_urls)
    results = await asyncio.gather(*(asyncio.to_thread(_fetch, u, timeout_s) for u in urls), return_exceptions=True)
    pages = [r for r in results if isinstance(r, str)]
    errors = [f"# raytp: skipped {u}: {r}" for u, r in zip(urls, results, strict=True) if not isinstance(r, str)]
    text = await asyncio.to_thread(merge_expositions, pages, prefixes)
    return _with_errors(text, errors)


def _with_errors(text: str, errors: list[str]) -> str:
    return "".join(e.replace("\n", " ") + "\n" for e in errors) + text
