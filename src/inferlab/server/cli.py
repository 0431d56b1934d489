"""`inferlab serve`: load the engine, then serve the OpenAI API on uvicorn until SIGTERM/SIGINT.

The engine steps on the main thread (the one that loaded the model) and uvicorn serves from a second one. On a
signal uvicorn stops accepting connections, lets running requests finish for up to --shutdown-grace seconds,
cancels what is left (which aborts those requests in the engine), then the engine loop stops and we exit 0.
A second signal ends the drain at once: every request still in flight gets an error (an error event and [DONE] on
a stream), and we exit 4. When the engine thread dies the requests in flight fail with 503 and we exit 1, so that
systemd or Kubernetes restarts the server rather than leaving a process that serves nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading
from pathlib import Path

from inferlab.common.thread_name import set_os_thread_name
from inferlab.common.units import parse_bytes
from inferlab.engine.config import EngineConfig
from inferlab.server.http_limits import (DEFAULT_KEEP_ALIVE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HEADER_BYTES,
                                         DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT)

# Exit codes (README, "Serve").
EXIT_OK = 0  # drained and stopped
EXIT_ENGINE_FAILED = 1  # the engine thread stopped on an exception
EXIT_BAD_OPTIONS = 2  # bad flags, or the model cannot be loaded
EXIT_HTTP_FAILED = 3  # the HTTP server did not start (a port in use, ...)
EXIT_DRAIN_CUT_SHORT = 4  # a second SIGTERM/SIGINT ended the graceful drain

# Test-only: "engine_crash_after_steps:N" makes the engine's step N+1 raise, to test that a dead engine ends the
# process (tests/server/test_server_engine.py). Read once at startup; never set it in production.
FAULT_INJECT_ENV = "INFERLAB_FAULT_INJECT"
_FORCE_EXIT_AFTER = 5.0  # seconds the HTTP side gets to send final errors once the engine is gone or cut short


def _size(text: str) -> int:
    return parse_bytes(text, "--max-request-bytes", bare="B")


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
    d = parser.add_argument_group("disaggregated prefill/decode (server/disagg_engine.py)")
    d.add_argument("--disaggregate", action="store_true",
                   help="run a prefill worker and a decode worker process, one core each, behind this API process: "
                        "prompts are prefilled on one and their KV handed to the other, which streams the rest")
    d.add_argument("--kv-transfer-buffer", type=lambda t: parse_bytes(t, "--kv-transfer-buffer", bare="B"),
                   default="256MiB", help="shared-memory buffer for KV in transit from prefill to decode; when it is "
                                          "full prefill waits (default 256MiB)")
    h = parser.add_argument_group("HTTP limits")
    h.add_argument("--max-request-bytes", type=_size, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body; larger ones get 413 before they are read (default 4MiB)")
    h.add_argument("--http-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT,
                   help="seconds a client has to send a whole request (headers and body) before it gets 408 and "
                        "the connection closes (default 30)")
    h.add_argument("--keep-alive-timeout", type=int, default=DEFAULT_KEEP_ALIVE_TIMEOUT,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    h.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections (and running HTTP tasks) beyond which new ones get 503 (default 1024)")
    h.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                   help="largest request line + headers; larger gets 400 (default 16384, h11's own)")


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


def _check_options(args: argparse.Namespace) -> str | None:
    if args.max_queue < 0:
        return "--max-queue must be >= 0"
    if args.request_timeout is not None and not args.request_timeout > 0:
        return "--request-timeout must be > 0 seconds"
    for flag in ("max_request_bytes", "http_read_timeout", "keep_alive_timeout", "max_connections",
                 "max_header_bytes"):
        if not getattr(args, flag) > 0:
            return f"{EngineConfig.flag(flag)} must be > 0"
    spec = os.environ.get(FAULT_INJECT_ENV)
    if spec is not None and not (spec.startswith("engine_crash_after_steps:") and spec.rpartition(":")[2].isdigit()):
        return f"${FAULT_INJECT_ENV}={spec!r}: the only fault is engine_crash_after_steps:N"
    return None


def _inject_engine_crash(engine, after_steps: int) -> None:
    """Test-only (see FAULT_INJECT_ENV)."""
    step, done = engine.step, 0

    def crashing_step():
        nonlocal done
        if done >= after_steps:
            raise RuntimeError(f"{FAULT_INJECT_ENV}: injected engine crash after {after_steps} steps")
        done += 1
        return step()

    engine.step = crashing_step


def _log_engine(level: str) -> None:
    """The engine's own decisions (the model it loaded, CPU thread changes and why) go to stderr beside uvicorn's
    lines; without a handler Python would drop everything below WARNING."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    log = logging.getLogger("inferlab")
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


def release_load_memory() -> None:
    """Once every model this server uses is loaded: what loading kept for a next load (the parsed GGUF readers) and
    the heap it freed go back to the system (benchmarks/memory_footprint.py measures it)."""
    from inferlab.common.host_memory import release_free_heap
    from inferlab.models.config import forget_gguf_files

    forget_gguf_files()
    gc.collect()
    release_free_heap()


def run(args: argparse.Namespace) -> int:
    if (problem := _check_options(args)) is not None:
        print(f"inferlab serve: {problem}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    try:
        keys = load_api_keys(args.api_key, args.api_keys_file)
    except ValueError as e:
        print(f"inferlab serve: {e}", file=sys.stderr)
        return 2

    from inferlab.common.errors import ModelLoadError

    try:
        engine_config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        print(f"inferlab serve: {e}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    _log_engine(args.log_level)
    try:
        if args.disaggregate:
            from inferlab.server.disagg_engine import DisaggEngine, WorkerDiedError

            try:
                engine = DisaggEngine(engine_config, args.kv_transfer_buffer)
            except (ValueError, WorkerDiedError) as e:
                print(f"inferlab serve: {e}", file=sys.stderr)
                return EXIT_BAD_OPTIONS
            roles = ", ".join(f"{w.role.value} worker pid {w.process.pid} on cores {w.ready.cores}"
                              for w in engine.workers.values())
            print(f"inferlab serve: disaggregated: {roles}", flush=True)
        else:
            from inferlab.engine.llm_engine import LLMEngine

            engine = LLMEngine(engine_config)
    except (ModelLoadError, FileNotFoundError) as e:
        print(f"inferlab serve: cannot load the model: {e}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    except ValueError as e:  # options that only the model can judge (a KV pool smaller than one block, ...)
        print(f"inferlab serve: {e}", file=sys.stderr)
        return EXIT_BAD_OPTIONS
    release_load_memory()
    try:
        return _serve(args, engine, engine_config, keys)
    finally:
        if args.disaggregate:
            engine.close()


def _serve(args: argparse.Namespace, engine, engine_config: EngineConfig, keys: dict[str, str | None]) -> int:
    import uvicorn

    from inferlab.server.api import ServerConfig, build_app
    from inferlab.server.http_limits import h11_protocol

    if (spec := os.environ.get(FAULT_INJECT_ENV)) is not None:
        print(f"inferlab serve: ${FAULT_INJECT_ENV}={spec}: TEST-ONLY fault injection is on", file=sys.stderr)
        _inject_engine_crash(engine, int(spec.rpartition(":")[2]))
    # The engine steps on this thread, the one that loaded the model, and HTTP runs on another: see
    # server/async_engine.py for why (OpenMP teams; batch-1 decode 1.8x slower on a second thread).
    app = build_app(engine, ServerConfig(max_queue=args.max_queue, request_timeout=args.request_timeout, api_keys=keys,
                                         max_request_bytes=args.max_request_bytes))
    async_engine = app.state.server.engine
    auth = f"{len(keys)} API key(s)" if keys else "no auth"
    print(f"inferlab serve: {engine.model_name} (context {engine.max_model_len}) on http://{args.host}:{args.port}"
          f" | max-num-seqs {engine_config.max_num_seqs}, max-queue {args.max_queue}, {auth}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.log_level == "debug",
                                           timeout_graceful_shutdown=args.shutdown_grace,
                                           http=h11_protocol(args.http_read_timeout),
                                           limit_concurrency=args.max_connections,
                                           timeout_keep_alive=args.keep_alive_timeout,
                                           h11_max_incomplete_event_size=args.max_header_bytes))

    def force_exit_soon() -> None:
        """The requests in flight have been sent their errors; whatever the HTTP side still waits for (a client that
        does not read) gets a few seconds, then uvicorn stops without waiting."""
        timer = threading.Timer(_FORCE_EXIT_AFTER, lambda: setattr(server, "force_exit", True))
        timer.daemon = True
        timer.start()

    # uvicorn installs no signal handlers off the main thread: SIGTERM/SIGINT land here. The first asks it to stop
    # gracefully (drain, then the app's shutdown stops the engine loop below); the second ends every request in
    # flight with an error and stops the engine loop at once.
    cut_short = False

    def stop(signum, _frame) -> None:
        nonlocal cut_short
        if not server.should_exit:
            server.should_exit = True
            print(f"inferlab serve: {signal.Signals(signum).name}: draining for up to {args.shutdown_grace:g} s "
                  f"(send it again to stop now)", file=sys.stderr, flush=True)
        elif not cut_short:
            cut_short = True
            async_engine.cut_short(f"a second {signal.Signals(signum).name} ended the graceful drain")
            force_exit_soon()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)

    def serve_http() -> None:
        set_os_thread_name("inferlab-http")  # the engine keeps the process's name, as do torch's workers it starts
        server.run()

    http = threading.Thread(target=serve_http, name="inferlab-http")
    http.start()
    async_engine.run_engine(should_stop=lambda: not http.is_alive())
    if async_engine.error is not None:  # the requests in flight got their 503s; a supervisor restarts us
        print(f"inferlab serve: the engine stopped: {async_engine.error!r}; exiting {EXIT_ENGINE_FAILED}",
              file=sys.stderr, flush=True)
        server.should_exit = True
        force_exit_soon()
    http.join()
    if not server.started:  # uvicorn said why (a port in use, ...) and exits 3 on its own thread: so do we
        print("inferlab serve: the HTTP server did not start (see the error above)", file=sys.stderr, flush=True)
        return EXIT_HTTP_FAILED
    if async_engine.error is not None:
        return EXIT_ENGINE_FAILED
    if cut_short:
        print(f"inferlab serve: stopped before the drain finished; exiting {EXIT_DRAIN_CUT_SHORT}", file=sys.stderr,
              flush=True)
        return EXIT_DRAIN_CUT_SHORT
    print("inferlab serve: stopped", flush=True)
    return EXIT_OK
