"""Scale-out: N inferlab engine replicas on Ray Serve behind one OpenAI-compatible endpoint (`inferlab serve
--replicas N`, or `--ray-address` for an existing cluster).

The design, following ray.serve.llm's split of an OpenAI ingress from the engine replicas:

    client ──HTTP──> Ray Serve proxy ──> Ingress (one, no CPUs) ──DeploymentHandle(stream=True)──> EngineReplica × N
                                            │ reads the prompt for the router        each: LLMEngine + inferlab's own
                                            │ passes SSE bytes through               FastAPI app, called in-process
                                            └─ /metrics: every replica's series, labelled replica="…" (MetricsBoard)

- A replica (replica.py) is one Ray actor process: it loads the engine on its own thread, which then steps it
  (as `inferlab serve` does on its main thread), and answers forwarded HTTP requests by calling inferlab's own
  ASGI app in-process, so validation, errors, SSE framing and per-replica metrics are exactly `inferlab serve`'s.
  Its CPU threads are `--num-threads`; Ray reserves as many CPUs for it (`num_cpus`).
- The ingress (ingress.py) reads each body once to extract the prompt (for routing), forwards method, path, headers
  and body to a replica through a streaming DeploymentHandle, and streams the replica's bytes back unchanged.
- Routing (routers.py) is Ray Serve's pluggable RequestRouter, which runs in the ingress's handle:
  `prefix-affinity` is Ray's own PrefixCacheAffinityRouter (a prefix tree of the prompts each replica has seen;
  the longest match wins while the replicas' queues differ by at most --affinity-imbalance, otherwise the
  shorter of two random queues); `round-robin` is ours, for comparison; `power-of-two` is Ray's default.
- Autoscaling is Ray Serve's, on ongoing requests (running + queued at the replica, plus those waiting in the
  handle's queue) per replica, between --min-replicas and --max-replicas.
- Failure: Ray restarts a dead replica (its actor dies, the controller starts a new one). Requests in flight on
  it end with an error event and [DONE] on a stream, or a 503 before the first byte; a request that failed before
  any byte reached the client is retried once on another replica.
"""
