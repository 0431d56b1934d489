"""`python -m inferlab.server.demo`: start `inferlab serve` on the bundled model, stream a few chat answers to the
terminal through the official `openai` client, then stop the server with SIGTERM (its graceful shutdown).

Any extra arguments go to `inferlab serve` (e.g. `--dtype float32`).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences why the sky is blue.",
]


def main(argv: list[str] | None = None) -> int:
    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "inferlab", "serve", "--port", str(port), "--log-level", "warning",
           *(sys.argv[1:] if argv is None else argv)]
    print("$ " + " ".join(["inferlab", *cmd[3:]]), flush=True)
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                print(f"inferlab serve exited with status {server.returncode} before it was ready", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print("inferlab serve did not become ready within 600 s", file=sys.stderr)
                return 1
            time.sleep(0.2)

        client = openai.OpenAI(base_url=base + "/v1", api_key="not-needed", max_retries=0)
        model = client.models.list().data[0].id
        for question in QUESTIONS:
            print(f"\n>>> {question}\n", flush=True)
            t0 = time.perf_counter()
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                    max_tokens=96, temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    print(chunk.choices[0].delta.content, end="", flush=True)
                if chunk.usage:
                    dt = time.perf_counter() - t0
                    print(f"\n[{chunk.usage.completion_tokens} tokens in {dt:.2f} s, "
                          f"{chunk.usage.completion_tokens / dt:.1f} tok/s]", flush=True)
        print(f"\nSame thing with curl:\n  curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}], "
              f"\"stream\": true}}'\n", flush=True)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return 0 if server.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
