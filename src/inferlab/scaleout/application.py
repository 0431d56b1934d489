"""The Ray Serve application `inferlab serve --replicas` runs: a metrics board, the engine replicas (with their
router and autoscaling) and the ingress in front of them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from inferlab.engine.config import EngineConfig
from inferlab.scaleout.ingress import Ingress
from inferlab.scaleout.metrics_board import MetricsBoard
from inferlab.scaleout.replica import EngineReplica
from inferlab.scaleout.routers import ROUTER_CLASSES
from inferlab.server.api import ServerConfig

APP_NAME = "inferlab"


@dataclass(slots=True)
class ReplicaOptions:
    replicas: int = 2  # fixed count, or the initial one when autoscaling
    threads: int = 1  # CPU threads of each replica (the engine's num_threads, and the CPUs Ray reserves)
    min_replicas: int | None = None  # either bound set: autoscale between them
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target per replica (default: max_num_seqs)
    max_ongoing_requests: int | None = None  # sent to one replica at once; more wait in the ingress's queue
    router: str = "prefix-affinity"  # a key of routers.ROUTER_CLASSES
    affinity_imbalance: int = 8  # queue-length gap beyond which prefix affinity gives way to load
    health_check_period_s: float = 2.0

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def check(self) -> None:
        """Raises ValueError naming the flag that is wrong."""
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.threads < 1:
            raise ValueError("--num-threads must be >= 1 per replica")
        if self.router not in ROUTER_CLASSES:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_CLASSES)}, got {self.router!r}")
        if self.affinity_imbalance < 0:
            raise ValueError("--affinity-imbalance must be >= 0")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError("--max-ongoing-requests must be >= 1")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and lo < 0 or hi is not None and hi < 1:
            raise ValueError("--min-replicas must be >= 0 and --max-replicas >= 1")
        if self.autoscaling and not (lo or 0) <= self.replicas <= (hi if hi is not None else self.replicas):
            raise ValueError(f"--replicas {self.replicas} must lie within --min-replicas {lo} and "
                             f"--max-replicas {hi}")


def build_application(engine: EngineConfig, server: ServerConfig, opts: ReplicaOptions) -> serve.Application:
    opts.check()
    engine = replace(engine, num_threads=opts.threads)
    router_class = ROUTER_CLASSES[opts.router]
    router = RequestRouterConfig(
        request_router_kwargs={"imbalanced_threshold": opts.affinity_imbalance} if opts.router == "prefix-affinity"
        else {}, **({"request_router_class": router_class} if router_class else {}))
    max_ongoing = opts.max_ongoing_requests or 2 * engine.max_num_seqs  # a running batch and the next one
    scale: dict = {"num_replicas": opts.replicas}
    if opts.autoscaling:
        scale = {"autoscaling_config": AutoscalingConfig(
            min_replicas=opts.min_replicas if opts.min_replicas is not None else 1,
            max_replicas=opts.max_replicas if opts.max_replicas is not None else opts.replicas,
            initial_replicas=opts.replicas,
            target_ongoing_requests=opts.target_ongoing_requests or engine.max_num_seqs)}
    board = MetricsBoard.bind()
    replicas = EngineReplica.options(
        ray_actor_options={"num_cpus": opts.threads}, max_ongoing_requests=max_ongoing,
        request_router_config=router, health_check_period_s=opts.health_check_period_s, **scale,
    ).bind(engine, server, board)
    return Ingress.options(max_ongoing_requests=100_000).bind(replicas, board, server.max_request_bytes)
