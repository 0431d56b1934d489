"""The bench's tokenizer: builds prompts of exact token lengths and counts streamed tokens when the server
does not. Loaded with the `tokenizers` library only, so bench never imports torch; a GGUF file (or a folder
without tokenizer.json) is converted once by transformers in a child process and cached as tokenizer.json."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


class TokenizerError(ValueError):
    pass


class BenchTokenizer:
    def __init__(self, tok, name: str):
        self._tok = tok
        self.name = name

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return self._tok.decode_batch(batch, skip_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def tokens_per_chunk(self, chunks: list[str]) -> list[int]:
        """Tokenise the whole streamed text once and give each token to the chunk where its first character
        arrived: exact against the full text's tokenisation, unlike counting each chunk on its own."""
        if not chunks:
            return []
        enc = self._tok.encode("".join(chunks), add_special_tokens=False)
        ends = np.cumsum([len(c) for c in chunks])
        starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(enc.offsets))
        idx = np.minimum(np.searchsorted(ends, starts, side="right"), len(chunks) - 1)
        return np.bincount(idx, minlength=len(chunks)).tolist()


def cache_dir() -> Path:
    base = os.environ.get("INFERLAB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inferlab")
    return Path(base) / "tokenizers"


_CONVERT = """
import sys
from transformers import AutoTokenizer
src, gguf, out = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf or None)
if not getattr(tok, "is_fast", False):
    sys.exit(f"{src}: transformers gave a slow tokenizer only; cannot convert it to tokenizer.json")
tok.backend_tokenizer.save(out)
"""


def _convert(src: Path) -> Path:
    """GGUF file or HF folder -> a cached tokenizer.json, built once by transformers in a child process."""
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    out = cache_dir() / key / "tokenizer.json"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    folder, gguf = (src.parent, src.name) if src.is_file() else (src, "")
    proc = subprocess.run([sys.executable, "-c", _CONVERT, str(folder), gguf, str(tmp)],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise TokenizerError(f"could not load a tokenizer from {src}: {' '.join(tail)}")
    os.replace(tmp, out)
    return out


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str | None) -> BenchTokenizer | None:
    """spec: None for the bundled model's tokenizer, 'none' for no tokenizer, else a Hugging Face folder,
    a tokenizer.json or a GGUF file."""
    if spec is not None and spec.lower() == "none":
        return None
    from tokenizers import Tokenizer

    if spec is None:
        from inferlab.common.bundled import bundled_model_path

        try:
            src = bundled_model_path()
        except FileNotFoundError as e:
            raise TokenizerError(f"{e}; or pass --tokenizer PATH (or --tokenizer none)") from None
    else:
        src = Path(spec).expanduser()
        if not src.exists():
            raise TokenizerError(
                f"tokenizer not found: {spec} (give a Hugging Face folder, a tokenizer.json or a GGUF file, or 'none')")
    if src.is_file() and src.suffix == ".json":
        path = src
    elif src.is_dir() and (src / "tokenizer.json").is_file():
        path = src / "tokenizer.json"
    elif src.is_dir() or src.suffix == ".gguf":
        path = _convert(src)
    else:
        raise TokenizerError(f"{src}: not a tokenizer (give a Hugging Face folder, a tokenizer.json or a GGUF file)")
    try:
        return BenchTokenizer(Tokenizer.from_file(str(path)), str(src))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        raise TokenizerError(f"could not read tokenizer {path}: {e}") from None
