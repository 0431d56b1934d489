"""`inferlab serve`: one process (server/cli.py), or with --replicas / --ray-address, N engine replicas on Ray
Serve behind one endpoint (this package's __init__ has the design). Ray is imported only on the second path.

With --replicas and no --ray-address a local Ray cluster is started for this command and stopped when it ends;
with --ray-address the application is deployed on that cluster (inferlab must be installed on its nodes) and
deleted when this command ends. SIGTERM/SIGINT stop it: Serve drains the replicas (graceful_shutdown_timeout_s).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from inferlab.common.units import parse_bytes
from inferlab.server import cli as server_cli

EXIT_OK, EXIT_BAD_OPTIONS, EXIT_RAY_FAILED = 0, 2, 5
_ROUTERS = ("prefix-affinity", "round-robin", "power-of-two")  # routers.ROUTER_CLASSES, without importing Ray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server_cli.add_arguments(parser)
    g = parser.add_argument_group("replicas (Ray Serve; needs `pip install 'inferlab[ray]'`)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas behind this one endpoint, each its own process with --num-threads "
                        "CPU threads (default --num-threads: the CPUs divided among them)")
    g.add_argument("--ray-address", default=None,
                   help="deploy on this existing Ray cluster (e.g. ray://head:10001 or auto) instead of starting a "
                        "local one")
    g.add_argument("--router", choices=_ROUTERS, default="prefix-affinity",
                   help="prefix-affinity: requests whose prompts start alike go to the replica that has their prefix "
                        "cached, unless its queue is --affinity-imbalance longer than another's (default); "
                        "round-robin; power-of-two: the shorter queue of two random replicas")
    g.add_argument("--affinity-imbalance", type=int, default=8,
                   help="queue-length gap between replicas beyond which prefix affinity gives way to load (default 8)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscale on queue depth down to this many")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale on queue depth up to this many")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target: requests running or queued per replica (default: --max-num-seqs)")
    g.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests one replica takes at once; more wait at the ingress (default: 2 x --max-num-seqs)")
    g.add_argument("--object-store-memory", type=lambda t: parse_bytes(t, "--object-store-memory"),
                   default=128 << 20, help="the local Ray cluster's object store (default 128MiB; Ray's minimum is "
                                           "75MiB)")


def run(args: argparse.Namespace) -> int:
    if args.replicas is None and args.ray_address is None:
        return server_cli.run(args)
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        print(f"inferlab serve: --replicas/--ray-address need Ray Serve: pip install 'inferlab[ray]' ({e})",
              file=sys.stderr)
        return EXIT_BAD_OPTIONS
    return _run_on_ray(args)


def _run_on_ray(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from inferlab.engine.config import EngineConfig
    from inferlab.scaleout.application import APP_NAME, ReplicaOptions, build_application
    from inferlab.server.api import ServerConfig

    if (problem := server_cli._check_options(args)) is not None:
        print(f"inferlab serve: {problem}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    replicas = args.replicas if args.replicas is not None else 1  # --ray-address alone: one replica
    try:
        keys = server_cli.load_api_keys(args.api_key, args.api_keys_file)
        engine_config = EngineConfig.from_cli_args(args)
        threads = engine_config.num_threads or max(1, (os.cpu_count() or 1) // max(replicas, 1))
        opts = ReplicaOptions(replicas=replicas, threads=threads, min_replicas=args.min_replicas,
                              max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                              max_ongoing_requests=args.max_ongoing_requests, router=args.router,
                              affinity_imbalance=args.affinity_imbalance)
        opts.check()
        # Checked here, where the command runs: a replica that cannot load its model fails in a worker's log only
        # after Ray retried it several times.
        if engine_config.model is not None and not Path(engine_config.model).exists():
            raise ValueError(f"--model {engine_config.model}: no such file or folder")
    except ValueError as e:
        print(f"inferlab serve: {e}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    server_config = ServerConfig(max_queue=args.max_queue, request_timeout=args.request_timeout, api_keys=keys,
                                 max_request_bytes=args.max_request_bytes)
    local = args.ray_address is None
    try:
        if local:
            # Logical CPUs: enough for every replica's threads even on fewer cores (then they share the cores).
            ray.init(num_cpus=max(os.cpu_count() or 1, threads * max(replicas, args.max_replicas or 0)),
                     object_store_memory=args.object_store_memory, include_dashboard=True, logging_level="warning")
        else:
            ray.init(address=args.ray_address, logging_level="warning")
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = "start a local Ray cluster" if local else f"connect to the Ray cluster at {args.ray_address}"
        print(f"inferlab serve: cannot {where}: {e}", file=sys.stderr)
        return EXIT_RAY_FAILED
    # A signal at any point, also while serve.run waits for the replicas to come up, unwinds to the clean-up in
    # `finally`; a second one during the clean-up ends the process at once.
    def stop(signum, _frame) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        scale = (f"autoscaling {opts.min_replicas if opts.min_replicas is not None else 1}.."
                 f"{opts.max_replicas or replicas}" if opts.autoscaling else f"{replicas} replicas")
        print(f"inferlab serve: starting {scale} x {threads} thread(s), router {opts.router}; "
              f"Ray at {ray.get_runtime_context().gcs_address}", flush=True)
        serve.run(build_application(engine_config, server_config, opts), name=APP_NAME, route_prefix="/",
                  blocking=False, logging_config={"enable_access_log": args.log_level == "debug"})
        print(f"inferlab serve: {scale} on http://{args.host}:{args.port} (one endpoint; /metrics labels each "
              f"replica's series replica=\"...\")", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("inferlab serve: stopping the replicas", file=sys.stderr, flush=True)
        return EXIT_OK
    except (RuntimeError, ray.exceptions.RayError) as e:
        print(f"inferlab serve: Ray Serve failed: {e}", file=sys.stderr, flush=True)
        return EXIT_RAY_FAILED
    finally:
        if local:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
