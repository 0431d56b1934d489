"""Request routers for the engine replicas: Ray Serve RequestRouter classes, run inside the ingress's handle.

- PrefixAffinityRouter: Ray's PrefixCacheAffinityRouter (ray.serve.llm.request_router), reading our forwarded
  request. Ray 2.60's public alias imports ray.serve.llm, which requires vLLM or SGLang, so the class is taken
  from the module that defines it (the same class). Ray's extractor looks for a `.prompt` or `.messages`
  attribute and raises (or divides by zero) on a request without one; ours routes those by load alone.
- RoundRobinRouter: each request to the next replica in a fixed order, blind to load and prefix; for comparison.
"""

from __future__ import annotations

import itertools

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from inferlab.scaleout.messages import ForwardedRequest

_PREFIX = f"{__name__}.PrefixAffinityRouter"
_ROUND_ROBIN = f"{__name__}.RoundRobinRouter"
# --router -> the class path Ray Serve imports in every process that holds a handle (None: Ray's default,
# power of two choices on queue length).
ROUTER_CLASSES: dict[str, str | None] = {"prefix-affinity": _PREFIX, "round-robin": _ROUND_ROBIN,
                                         "power-of-two": None}


class PrefixAffinityRouter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request: PendingRequest) -> str | None:
        for arg in pending_request.args:
            if isinstance(arg, ForwardedRequest):
                return arg.routing_text or None
        return None


class RoundRobinRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        # Ray hands the candidates in no fixed order: sort by id so "next" means the same replica each time.
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        return [[ordered[next(self._turn) % len(ordered)]]]
