"""`inferlab fake-server`: serve the deterministic fake server until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import sys

from inferlab.common.units import parse_duration as _duration


def _faults(text: str) -> dict[str, float]:
    """'http500=0.1,drop=0.05' -> {'http500': 0.1, 'drop': 0.05}"""
    out = {}
    for part in filter(None, text.split(",")):
        kind, sep, share = part.partition("=")
        try:
            out[kind.strip()] = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--faults {text!r}: write KIND=SHARE[,KIND=SHARE], e.g. http500=0.1") from None
        if not sep:
            raise argparse.ArgumentTypeError(f"--faults {text!r}: write KIND=SHARE[,KIND=SHARE], e.g. http500=0.1")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port (printed on start)")
    p.add_argument("--ttft", type=_duration, default=0.05, help="time to first token, e.g. 50ms (default 50ms)")
    p.add_argument("--itl", type=_duration, default=0.01, help="time per output token, e.g. 10ms (default 10ms)")
    p.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens carried by each SSE chunk")
    p.add_argument("--jitter", type=_duration, default=0.0, help="each chunk is up to this much later (seeded)")
    p.add_argument("--ttft-per-input-token", type=_duration, default=0.0, help="prefill cost per prompt token")
    p.add_argument("--output-len", type=int, default=None, help="answer every request with this many tokens")
    p.add_argument("--max-concurrency", type=int, default=None, help="queue requests beyond this many (saturation)")
    p.add_argument("--reasoning-tokens", type=int, default=0, help="chat: stream the first N tokens as reasoning")
    p.add_argument("--reasoning-field", choices=["reasoning_content", "reasoning"], default="reasoning_content",
                   help="the delta field reasoning goes in (vLLM: reasoning_content)")
    p.add_argument("--model", default="fake-model", help="the model name served on /v1/models")
    p.add_argument("--api-key", default=None, help="require this bearer token on /v1/*")
    p.add_argument("--tokenizer", default=None, help="count prompt tokens with this tokenizer (default: words)")
    p.add_argument("--faults", type=_faults, default={}, help="inject faults: http500, drop, malformed, stall, "
                                                              "each with a share, e.g. http500=0.1,drop=0.05")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from inferlab.bench.fake_server import FakeConfig, FakeServer

    count = None
    if args.tokenizer:
        from inferlab.bench.tokenizer import TokenizerError, load_tokenizer

        try:
            tok = load_tokenizer(args.tokenizer)
        except TokenizerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        count = tok.count if tok else None
    try:
        cfg = FakeConfig(ttft=args.ttft, itl=args.itl, tokens_per_chunk=args.tokens_per_chunk, jitter=args.jitter,
                         ttft_per_input_token=args.ttft_per_input_token, output_len=args.output_len,
                         max_concurrency=args.max_concurrency, reasoning_tokens=args.reasoning_tokens,
                         reasoning_field=args.reasoning_field,
                         model=args.model, api_key=args.api_key, seed=args.seed, faults=args.faults,
                         count_tokens=count)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = FakeServer(cfg)

    async def main():
        try:
            port = await server.start(args.host, args.port)
        except OSError as e:
            print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
            return 1
        print(f"fake server listening on http://{args.host}:{port} (ttft {cfg.ttft * 1e3:g} ms, "
              f"itl {cfg.itl * 1e3:g} ms, {cfg.tokens_per_chunk} token(s)/chunk)", flush=True)
        await server.serve_forever()
        return 0

    # The standard loop: uvloop's add_reader swallows socket errors, and arrivals are stamped by the kernel.
    return asyncio.run(main())
