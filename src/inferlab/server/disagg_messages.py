"""The messages between the router (server/disagg_engine.py) and its prefill and decode workers
(server/disagg_worker.py), one pipe per worker. KV blocks never travel here: they go through the KV transport
(engine/kv_transfer.py), and only their handle does."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from inferlab.engine.kv_transfer import HandOff, KVHandle
from inferlab.engine.outputs import EngineStats, RequestOutput
from inferlab.engine.sampling_params import SamplingParams


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


# router -> worker
@dataclass(slots=True)
class Add:  # to prefill
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None


@dataclass(slots=True)
class Inject:  # to decode: a prefilled request whose KV waits in the transport
    hand_off: HandOff


@dataclass(slots=True)
class Release:  # to prefill: the decode side has read (or dropped) these transfer-buffer blocks
    handle: KVHandle


@dataclass(slots=True)
class Abort:  # to either
    request_id: str


# worker -> router
@dataclass(slots=True)
class Ready:
    role: Role
    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    max_token_chars: int
    block_size: int
    transfer_blocks: int  # blocks the KV transfer buffer holds: a longer prompt could never be handed over
    cores: list[int]  # where the worker runs (after pinning)


@dataclass(slots=True)
class Outputs:  # one engine step's deltas and the stats after it
    role: Role
    outputs: list[RequestOutput]
    stats: EngineStats
    handled: int  # router messages the worker has handled so far: the router steps until all are answered


@dataclass(slots=True)
class HandedOff:  # from prefill: forward to decode
    hand_off: HandOff


@dataclass(slots=True)
class Released:  # from decode: forward to prefill
    handle: KVHandle
