"""`inferlab serve`: load the engine, then serve the OpenAI API on uvicorn until SIGTERM/SIGINT.

The engine steps on the main thread (the one that loaded the model) and uvicorn serves from a second one. On a
signal uvicorn stops accepting connections, lets running requests finish for up to --shutdown-grace seconds,
cancels what is left (which aborts those requests in the engine), then the engine loop stops and we exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from inferlab.engine.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond the running batch; more get 429 at once (default 256)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may wait and run before it is aborted with an error (default: no limit)")
    g.add_argument("--api-key", default=os.environ.get("INFERLAB_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $INFERLAB_API_KEY; unset = open)")
    g.add_argument("--api-keys-file", type=Path, default=None,
                   help="YAML/JSON mapping of API key -> tenant; a tenant's requests share prefix cache only "
                        "with the same tenant")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM/SIGINT (default 30)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def load_api_keys(api_key: str | None, path: Path | None) -> dict[str, str | None]:
    """--api-key and --api-keys-file together -> {key: tenant}. Raises ValueError naming what is wrong."""
    keys: dict[str, str | None] = {}
    if api_key is not None:
        if not api_key.strip():
            raise ValueError("--api-key is empty")
        keys[api_key] = None
    if path is not None:
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read --api-keys-file {path}: {e}") from None
        if not isinstance(data, dict) or not data:
            raise ValueError(f"--api-keys-file {path} must be a non-empty mapping of API key -> tenant name")
        for key, tenant in data.items():
            if not isinstance(key, str) or not key.strip() or not isinstance(tenant, str) or not tenant:
                raise ValueError(f"--api-keys-file {path}: every entry must be `KEY: TENANT` with non-empty strings, "
                                 f"got {key!r}: {tenant!r}")
            keys[key] = tenant
    return keys


def run(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        print("inferlab serve: --max-queue must be >= 0", file=sys.stderr)
        return 2
    if args.request_timeout is not None and not args.request_timeout > 0:
        print("inferlab serve: --request-timeout must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        keys = load_api_keys(args.api_key, args.api_keys_file)
    except ValueError as e:
        print(f"inferlab serve: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from inferlab.engine.llm_engine import LLMEngine
    from inferlab.server.api import ServerConfig, build_app

    from inferlab.common.errors import ModelLoadError

    try:
        engine_config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        print(f"inferlab serve: {e}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(engine_config)
    except (ModelLoadError, FileNotFoundError) as e:
        print(f"inferlab serve: cannot load the model: {e}", file=sys.stderr)
        return 2
    # The engine steps on this thread, the one that loaded the model, and HTTP runs on another: see
    # server/async_engine.py for why (OpenMP teams; batch-1 decode 1.8x slower on a second thread).
    app = build_app(engine, ServerConfig(max_queue=args.max_queue, request_timeout=args.request_timeout, api_keys=keys))
    auth = f"{len(keys)} API key(s)" if keys else "no auth"
    print(f"inferlab serve: {engine.model_name} (context {engine.max_model_len}) on http://{args.host}:{args.port}"
          f" | max-num-seqs {engine_config.max_num_seqs}, max-queue {args.max_queue}, {auth}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.log_level == "debug",
                                           timeout_graceful_shutdown=args.shutdown_grace))
    # uvicorn installs no signal handlers off the main thread: SIGTERM/SIGINT land here and ask it to stop
    # gracefully (drain, then the app's shutdown stops the engine loop below); a second signal stops it at once.
    def stop(*_):
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    http = threading.Thread(target=server.run, name="inferlab-http")
    http.start()
    app.state.server.engine.run_engine(should_stop=lambda: not http.is_alive())
    http.join()
    if not server.started:  # uvicorn said why (a port in use, ...) and exits 3 on its own thread: so do we
        print("inferlab serve: the HTTP server did not start (see the error above)", file=sys.stderr, flush=True)
        return 3
    print("inferlab serve: stopped", flush=True)
    return 0
