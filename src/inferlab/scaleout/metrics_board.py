"""One /metrics for N replicas: each replica posts its Prometheus text here every second, and the ingress serves
them all as one exposition, every series labelled `replica="<id>"` (sum or compare them in PromQL).

Per-replica series rather than pre-summed ones, because gauges do not add up meaningfully (KV-cache usage of two
pools) and histograms of different replicas must keep their own buckets. A replica that stops posting (it died)
drops out after STALE_AFTER seconds; its replacement posts under a new id, with counters starting from zero.
"""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from ray import serve

STALE_AFTER = 10.0  # seconds without a post before a replica's series leave /metrics


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class MetricsBoard:
    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self._posts[replica] = (time.monotonic(), text)

    def snapshot(self) -> dict[str, str]:
        now = time.monotonic()
        self._posts = {r: p for r, p in self._posts.items() if now - p[0] <= STALE_AFTER}
        return {r: text for r, (_, text) in self._posts.items()}


def merge_expositions(texts: dict[str, str]) -> str:
    """{replica: Prometheus text} -> one Prometheus text, each sample with a `replica` label added."""
    families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (type, help, sample lines)
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": replica}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{body}}} {floatToGoString(s.value)}")
    out = ["# HELP inferlab:replicas Engine replicas whose metrics are below.", "# TYPE inferlab:replicas gauge",
           f"inferlab:replicas {len(texts)}"]
    for name, (kind, doc, lines) in families.items():
        # the parser strips a counter's _total from the family name; the text format wants it on # TYPE
        name = name + "_total" if kind == "counter" else name
        out += [f"# HELP {name} {_escape_help(doc)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _escape_help(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


