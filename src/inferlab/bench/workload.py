"""Workloads: what each request asks. Synthetic prompts of exact token lengths, shared-prefix groups,
JSONL prompt or chat files, ShareGPT conversations (every assistant turn) and timestamped trace replay."""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inferlab.bench.arrivals import STREAM_TEXT, STREAM_WORKLOAD, rng_for
from inferlab.bench.tokenizer import BenchTokenizer


class WorkloadError(ValueError):
    """A workload that cannot be built: bad flags or a bad file (the message names the place)."""


@dataclass(slots=True)
class RequestSpec:
    prompt: str | None = None
    messages: list[dict] | None = None
    input_len: int | None = None  # prompt tokens by the bench tokenizer (message contents for chat)
    output_len: int | None = None  # max_tokens; None leaves it to the server
    group: int | None = None  # shared-prefix group
    timestamp: float | None = None  # trace replay: due time in seconds from the start


@dataclass(slots=True)
class Workload:
    requests: list[RequestSpec]
    spec: dict  # how it was built, for the results' provenance
    cache_free: bool = False  # no two prompts share a prefix on purpose
    warnings: list[str] = field(default_factory=list)
    sessions: list | None = None  # conversations: list[conversation.Session], run turn by turn

    @property
    def schedule(self) -> list[float] | None:
        if self.requests and all(r.timestamp is not None for r in self.requests):
            return [r.timestamp for r in self.requests]
        return None


# --- length distributions -----------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class LengthDist:
    """fixed N | uniform:LO,HI (inclusive) | normal:MEAN,STD | lognormal:MEDIAN,SIGMA (sigma of log length)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int, flag: str = "length") -> "LengthDist":
        s = str(text).strip().lower()
        try:
            if ":" not in s:
                d = cls("fixed", float(int(s)))
            else:
                kind, _, rest = s.partition(":")
                a, b = (float(x) for x in rest.split(","))
                d = cls(kind, a, b)
        except ValueError:
            raise WorkloadError(
                f"{flag} {text!r}: write N, uniform:LO,HI, normal:MEAN,STD or lognormal:MEDIAN,SIGMA") from None
        if d.kind not in ("fixed", "uniform", "normal", "lognormal"):
            raise WorkloadError(f"{flag} {text!r}: unknown distribution {d.kind!r}")
        if d.a < 1 or (d.kind == "uniform" and d.b < d.a) or (d.kind in ("normal", "lognormal") and d.b < 0):
            raise WorkloadError(f"{flag} {text!r}: lengths must be at least 1 token and ranges ordered")
        return d

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, n)
        elif self.kind == "normal":
            x = np.rint(rng.normal(self.a, self.b, n))
        else:
            x = np.rint(rng.lognormal(math.log(self.a), self.b, n))
        return np.maximum(x, 1).astype(np.int64)

    def describe(self) -> str:
        return str(int(self.a)) if self.kind == "fixed" else f"{self.kind}:{self.a:g},{self.b:g}"


# --- synthetic prompts --------------------------------------------------------------------------------------

_WORD = re.compile(r"^ [a-z]{2,12}$")
_POOLS: dict[str, np.ndarray] = {}


def word_pool(tok: BenchTokenizer) -> np.ndarray:
    """Token ids that decode to ' word' and encode back to themselves: prompts made of them keep their
    length through decode and re-encode (random vocabulary ids would merge and drift)."""
    if tok.name not in _POOLS:
        ids = list(range(tok.vocab_size))
        texts = tok.decode_batch([[i] for i in ids])
        cand = [i for i, t in zip(ids, texts) if _WORD.match(t)]
        back = tok.encode_batch([texts[i] for i in cand])
        pool = np.array([i for i, b in zip(cand, back) if b == [i]], dtype=np.int64)
        if pool.size < 100:
            raise WorkloadError(f"tokenizer {tok.name}: too few plain-word tokens to build synthetic prompts")
        _POOLS[tok.name] = pool
    return _POOLS[tok.name]


def exact_texts(tok: BenchTokenizer, lengths: list[int], rng: np.random.Generator,
                prefixes: list[str] | None = None) -> tuple[list[str], list[int]]:
    """Texts of exactly `lengths[i]` tokens (counting prefixes[i] when given), verified by re-encoding.
    Returns the texts and their real token counts (equal to lengths unless drift could not be fixed)."""
    pool = word_pool(tok)
    pre = prefixes or [""] * len(lengths)
    pre_len = [tok.count(p) if p else 0 for p in pre]
    ids = [rng.choice(pool, max(n - p, 0)).tolist() for n, p in zip(lengths, pre_len)]
    texts = [p + s for p, s in zip(pre, tok.decode_batch(ids))]
    counts = [len(e) for e in tok.encode_batch(texts)]
    for _ in range(4):  # fix the rare prompts whose re-encoding merged or split a token
        bad = [i for i, (c, n) in enumerate(zip(counts, lengths)) if c != n]
        if not bad:
            break
        for i in bad:
            enc = tok.encode(texts[i])
            want = lengths[i]
            enc = enc[:want] if len(enc) > want else enc + rng.choice(pool, want - len(enc)).tolist()
            texts[i] = tok.decode(enc)
            counts[i] = tok.count(texts[i])
    return texts, counts


def synthetic(n: int, input_len: LengthDist, output_len: LengthDist, tok: BenchTokenizer, seed: int,
              prefix_groups: int = 0, prefix_len: int = 0, part: int = 0, text_seed: int | None = None) -> Workload:
    """`part` draws a fresh set of prompts for the same seed (each load point of a sweep gets its own, so one
    point cannot warm the prefix cache for the next). `text_seed` draws the words apart from the lengths (and the
    prefix groups): the same seed then gives the same lengths with words no run of another text seed has put in
    the server's prefix cache, so two runs can differ in one variable (the rate, say) on the same draw."""
    if tok is None:
        raise WorkloadError("synthetic prompts need a tokenizer: drop --tokenizer none, or use --dataset")
    rng = rng_for(seed, STREAM_WORKLOAD, part)
    ins = input_len.sample(n, rng).tolist()
    outs = output_len.sample(n, rng).tolist()
    words = rng if text_seed is None else rng_for(text_seed, STREAM_TEXT, part)
    groups: list[int | None] = [None] * n
    prefixes = None
    if prefix_groups:
        if prefix_len < 1:
            raise WorkloadError("--prefix-groups needs --prefix-len P (tokens shared within a group)")
        if min(ins) <= prefix_len:
            raise WorkloadError(f"--input-len must exceed --prefix-len {prefix_len} so each prompt has its own suffix")
        shared, _ = exact_texts(tok, [prefix_len] * prefix_groups, words)
        groups = rng.integers(0, prefix_groups, n).tolist()
        prefixes = [shared[g] for g in groups]
    texts, counts = exact_texts(tok, ins, words, prefixes)
    spec = {"kind": "synthetic", "num_prompts": n, "input_len": input_len.describe(),
            "output_len": output_len.describe(), "tokenizer": tok.name}
    if prefix_groups:
        spec.update(prefix_groups=prefix_groups, prefix_len=prefix_len)
    wl = Workload([RequestSpec(prompt=t, input_len=c, output_len=o, group=g)
                   for t, c, o, g in zip(texts, counts, outs, groups)], spec, cache_free=not prefix_groups)
    drift = sum(1 for c, want in zip(counts, ins) if c != want)
    if drift:
        wl.warnings.append(f"{drift} of {n} synthetic prompts could not be made exactly their requested length")
    return wl


# --- files --------------------------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise WorkloadError(f"workload file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{path}:{no}: each line must be a JSON object")
            rows.append((no, row))
    if not rows:
        raise WorkloadError(f"{path}: no requests in the file")
    return rows


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise WorkloadError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _int(row: dict, keys: tuple[str, ...], where: str) -> int | None:
    for k in keys:
        if k in row and row[k] is not None:
            v = row[k]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise WorkloadError(f"{where}: {k!r} must be a positive integer, got {v!r}")
            return v
    return None


def _count(tok: BenchTokenizer | None, prompt: str | None, messages: list[dict] | None) -> int | None:
    if tok is None:
        return None
    if prompt is not None:
        return tok.count(prompt)
    return sum(tok.count(m["content"]) for m in messages or [])


def jsonl(path: str | Path, tok: BenchTokenizer | None, default_output: int | None) -> Workload:
    """One request per line: {"prompt": str} or {"messages": [...]}, with optional "output_len" (or
    "max_tokens")."""
    path = Path(path)
    reqs = []
    for no, row in _read_jsonl(path):
        where = f"{path}:{no}"
        prompt, messages = row.get("prompt"), row.get("messages")
        if messages is not None:
            messages = _messages(messages, where)
        elif not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"{where}: needs a 'prompt' string or a 'messages' list")
        out = _int(row, ("output_len", "max_tokens"), where) or default_output
        reqs.append(RequestSpec(prompt=None if messages else prompt, messages=messages,
                                input_len=_count(tok, None if messages else prompt, messages), output_len=out))
    return Workload(reqs, {"kind": "jsonl", "path": str(path), "num_prompts": len(reqs)})


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "system": "system"}


def read_sharegpt(path: str | Path) -> list[list[dict]]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]} ->
    each conversation as OpenAI-style messages [{"role", "content"}]."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: ShareGPT data must be a JSON list of conversations")
    convs = []
    for ci, conv in enumerate(data):
        turns = conv.get("conversations") or conv.get("conversation") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise WorkloadError(f"{path}: conversation {ci} has no 'conversations' list")
        msgs = []
        for ti, t in enumerate(turns):
            role = _ROLES.get(str(t.get("from", t.get("role", ""))).lower()) if isinstance(t, dict) else None
            text = t.get("value", t.get("content")) if isinstance(t, dict) else None
            if role is None or not isinstance(text, str):
                raise WorkloadError(f"{path}: conversation {ci} turn {ti}: needs 'from' (human/gpt/system) and 'value'")
            msgs.append({"role": role, "content": text})
        convs.append(msgs)
    return convs


def sharegpt(path: str | Path, tok: BenchTokenizer | None, output_len: int | None) -> Workload:
    """Every assistant turn of a ShareGPT file (read_sharegpt) becomes a request whose messages are all the turns
    before it; its output length is the real reply's token count (with a tokenizer) unless --output-len is given."""
    reqs = []
    for conv in read_sharegpt(path):
        for i, m in enumerate(conv):
            if m["role"] == "assistant" and m["content"] and any(p["role"] == "user" for p in conv[:i]):
                out = output_len or (tok.count(m["content"]) if tok else None)
                reqs.append(RequestSpec(messages=conv[:i], input_len=_count(tok, None, conv[:i]), output_len=out))
    if not reqs:
        raise WorkloadError(f"{path}: no assistant turn follows a user turn; nothing to replay")
    return Workload(reqs, {"kind": "sharegpt", "path": str(path), "num_prompts": len(reqs)})


def trace(path: str | Path, tok: BenchTokenizer | None, seed: int, time_unit: str = "s",
          block_size: int = 512) -> Workload:
    """Trace replay, one request per line: {"timestamp": t, "input_len": n, "output_len": m} (Mooncake's
    input_length/output_length accepted), optionally "prompt"/"messages", or "hash_ids": ids of block_size-token
    blocks, so requests naming the same blocks share those prompt prefixes, as in the original trace."""
    path = Path(path)
    scale = {"s": 1.0, "ms": 1e-3}[time_unit]
    rows = _read_jsonl(path)
    reqs, blocks = [], {}
    need: list[tuple[int, int, list]] = []  # (request index, length, hash ids) for synthetic prompts
    for no, row in rows:
        where = f"{path}:{no}"
        ts = row.get("timestamp")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            raise WorkloadError(f"{where}: needs a non-negative 'timestamp' (in {time_unit})")
        out = _int(row, ("output_len", "output_length", "max_tokens"), where)
        prompt, messages = row.get("prompt"), row.get("messages")
        r = RequestSpec(timestamp=ts * scale, output_len=out)
        if messages is not None:
            r.messages = _messages(messages, where)
            r.input_len = _count(tok, None, r.messages)
        elif isinstance(prompt, str):
            r.prompt, r.input_len = prompt, _count(tok, prompt, None)
        else:
            n = _int(row, ("input_len", "input_length"), where)
            if n is None:
                raise WorkloadError(f"{where}: needs 'input_len', a 'prompt' or 'messages'")
            if tok is None:
                raise WorkloadError(f"{where}: building a prompt from 'input_len' needs a tokenizer")
            hashes = row.get("hash_ids") or []
            if not isinstance(hashes, list):
                raise WorkloadError(f"{where}: 'hash_ids' must be a list")
            need.append((len(reqs), n, hashes))
        reqs.append(r)
    if need:
        pool = word_pool(tok)
        for _, _, hashes in need:
            for h in hashes:
                if h not in blocks:
                    key = h if isinstance(h, int) and h >= 0 else zlib.crc32(str(h).encode())
                    blocks[h] = tok.decode(rng_for(seed, STREAM_WORKLOAD, 1, key).choice(pool, block_size).tolist())
        rng = rng_for(seed, STREAM_WORKLOAD, 2)
        for i, n, hashes in need:
            ids = tok.encode("".join(blocks[h] for h in hashes))[:n]
            text = tok.decode(ids)
            texts, counts = exact_texts(tok, [n], rng, [text] if ids else None)
            reqs[i].prompt, reqs[i].input_len = texts[0], counts[0]
    t0 = min(r.timestamp for r in reqs)
    for r in reqs:
        r.timestamp -= t0
    reqs.sort(key=lambda r: r.timestamp)
    return Workload(reqs, {"kind": "trace", "path": str(path), "num_prompts": len(reqs), "time_unit": time_unit})


def messages_to_prompt(messages: list[dict]) -> str:
    """Chat turns sent to the completions endpoint: one 'role: content' line each."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
