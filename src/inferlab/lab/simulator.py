"""A discrete-event simulator of one or more inferlab engines, running the engine's own scheduling code.

Each instance owns a real `Scheduler` and `BlockManager` (src/inferlab/engine), and steps exactly as
`LLMEngine.step` does — `schedule()`, then `update_from_output(batch, sampled)`, then the sampled tokens are appended
and finished sequences released with `finish()` — except that the model forward is replaced by a step-cost model
(lab/step_cost.py): a step that starts at t ends at t + cost(batch), times a draw from the profile's step noise when
it has one. So batching, chunked prefill, the KV budget, preemption, prefix-cache hits and the admission limit are
the engine's, not a re-implementation of them.

What is modelled beside the engine:
  - the server's admission limit (`max_queue`, server/async_engine.py): a request that finds `max_queue` requests
    waiting is refused at once (HTTP 429), counted as rejected;
  - a per-request host overhead (HTTP, tokenization) that delays a request's entry into the scheduler;
  - each token's delivery to its client (the server's streaming path, the client's loop), when the profile has
    its quantiles: a token is read a draw after its step ends, never before the token before it, and a request
    leaves the system when its last token is read (so Little's law still holds);
  - several instances behind a router (round-robin, least-loaded, prefix-affinity), each on its own hardware;
  - disaggregated prefill/decode: P prefill instances compute the prompt and the first token, the prompt's KV
    crosses a link (latency + bytes per token x tokens / bandwidth, one transfer at a time per prefill instance),
    and a decode instance receives it as prefix-cache blocks (its BlockManager is seeded with the prompt's blocks,
    so admission finds them cached and only the last partial block is recomputed, by the engine's own prefix path).
    The real hand-off (`inferlab serve --disaggregate`, engine/kv_transfer.py) differs in three ways this model
    leaves out: it copies the partial last block too and admits the request straight into decoding
    (Scheduler.admit_injected), so decode recomputes nothing (here: up to block_size - 1 prompt tokens); the
    prefill instance holds a request's blocks until its KV is copied out; and a fixed transfer buffer bounds the
    KV in flight, so a full decode side stalls prefill (here the link queues without bound).
Tokens are appended at the end of the step that sampled them (plus their delivery), as the engine stamps them; times
are seconds.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.outputs import RequestMetrics
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.scheduler import ScheduledBatch, Scheduler
from inferlab.engine.sequence import Sequence
from inferlab.engine.step_budget import PrefillBudget
from inferlab.engine.step_trace import BatchShape
from inferlab.lab.step_cost import StepCost, shape_features

ROUTERS = ("round-robin", "least-loaded", "prefix-affinity")
SAMPLED_TOKEN = 7  # what a simulated step "samples": only lengths matter, and prompts never contain it by chance
NOISE_SEED = 20


@dataclass(slots=True)
class EngineShape:
    """The scheduler settings of one simulated instance (EngineConfig's names) and the server's queue bound."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_tokens_with_decodes: int | None = None
    block_size: int = 16
    num_blocks: int = 4096
    enable_prefix_caching: bool = True
    max_queue: int | None = 256  # None: never refuse
    # The engine's measured prefill budget (engine/step_budget.py), fed the simulated step times. None: unbounded,
    # as a profile made before the budget existed, or a black-box server, describes its engine.
    decode_stall_ratio: float | None = None

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(slots=True)
class Topology:
    replicas: int = 1  # colocated instances (ignored when prefill > 0)
    router: str = "round-robin"
    prefill: int = 0  # P prefill instances; 0 = colocated
    decode: int = 0  # D decode instances
    kv_bytes_per_token: float = 0.0
    link_bandwidth: float = 0.0  # bytes/s between a prefill and a decode instance
    link_latency: float = 0.0  # s per transfer

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    def validate(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of: {', '.join(ROUTERS)}")
        if self.disaggregated:
            if self.decode < 1:
                raise ValueError("disaggregated serving needs at least one decode instance")
            if self.kv_bytes_per_token <= 0 or self.link_bandwidth <= 0:
                raise ValueError("disaggregated serving needs the KV bytes per token and a link bandwidth")
        elif self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")

    def describe(self) -> str:
        if self.disaggregated:
            return f"{self.prefill}P+{self.decode}D ({self.router})"
        return "1 instance" if self.replicas == 1 else f"{self.replicas} replicas ({self.router})"


@dataclass(slots=True)
class SimRequest:
    request_id: str
    arrival: float  # open loop: seconds from the start; closed loop: ignored (sent when the user's last one ends)
    prompt_token_ids: list[int]
    output_len: int
    group: int | None = None  # shared-prefix group (prefix-affinity routes on it)
    warmup: bool = False


@dataclass(slots=True)
class RequestOutcome:
    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    warmup: bool = False
    instance: str | None = None  # where it decoded (colocated: where it ran)
    prefill_instance: str | None = None
    rejected: str | None = None  # why it was refused: "queue full" | "too long"
    refused_at: float | None = None  # when (after the request overhead: the server decides on receipt)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    kv_transfer: float = 0.0  # s on the link, queueing included

    @property
    def departure(self) -> float:
        return self.refused_at if self.rejected else self.finish


@dataclass(slots=True)
class StepRecord:
    instance: str
    start: float
    end: float
    request_ids: list[str]
    num_new_tokens: list[int]
    preempted: list[str]
    prefill_cap: int | None = None  # as the engine's step trace has them (engine/step_trace.py)
    drain: int = 0


@dataclass(slots=True)
class SimRun:
    outcomes: list[RequestOutcome]
    end_time: float
    in_system_area: float  # time integral of the requests in the system, counted from the instances' queues
    steps: list[StepRecord]
    busy: dict[str, float]  # seconds each instance spent stepping
    num_preemptions: int
    prefix_hit_share: float | None

    @property
    def mean_in_system(self) -> float:
        """Time-averaged number of requests in the system (L of Little's law), over [0, end_time]."""
        return self.in_system_area / self.end_time if self.end_time > 0 else 0.0


class Instance:
    def __init__(self, name: str, shape: EngineShape, cost: StepCost):
        self.name, self.shape, self.cost = name, shape, cost
        self.bm = BlockManager(shape.num_blocks, shape.block_size, shape.enable_prefix_caching)
        budget = None if shape.decode_stall_ratio is None else PrefillBudget(shape.decode_stall_ratio)
        if budget is not None:
            prime_budget(budget, cost, shape)
        self.scheduler = Scheduler(self.bm, shape.max_num_seqs, shape.max_num_batched_tokens,
                                   shape.max_prefill_tokens_with_decodes, budget)
        self.batch: ScheduledBatch | None = None
        self.busy = 0.0
        self.incoming = 0  # routed here, not yet through the request overhead

    @property
    def queued(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def load(self) -> int:
        """What a least-loaded router sees: requests sent here and not finished."""
        return self.incoming + self.queued

    def num_waiting(self) -> int:
        """As the server counts it for admission: waiting requests beyond the free running slots."""
        s = self.scheduler
        return max(0, len(s.waiting) - max(0, self.shape.max_num_seqs - len(s.running)))

    def fits(self, num_tokens: int) -> bool:
        return self.bm.blocks_needed(num_tokens) <= self.bm.num_blocks

    def inject_kv(self, prompt: list[int], request_id: str) -> None:
        """Receive a prompt's KV from a prefill instance: its full blocks enter this pool's prefix cache, through
        the block manager's own allocate / cache / free path (no pool room: nothing received, it recomputes)."""
        carrier = Sequence(f"kv:{request_id}", prompt, SamplingParams(max_tokens=1), RequestMetrics(0.0))
        if self.bm.allocate(carrier, len(prompt)):
            carrier.num_computed_tokens = len(prompt)
            self.bm.cache_computed_blocks(carrier)
            self.bm.free(carrier)


PRIME_CONTEXTS = (128, 512, 2048)  # keys per decoding sequence in the steps a budget is primed with
PRIME_PREFILLS = (0, 16, 64, 256)  # prefill tokens in them


def prime_budget(budget: PrefillBudget, cost: StepCost, shape: EngineShape) -> None:
    """Start an instance's prefill budget (engine/step_budget.py) as a server in service has it: fitted to steps
    it ran, here steps of the profile's costs over a grid of batch sizes, contexts and prefill chunks, which the
    run's own steps then replace as the engine's forgetting does. A fresh budget bounds nothing until it has seen
    a few steps of each kind, so a cold simulation replays a server's first seconds at every start. Re-simulating
    the draw served at 1 req/s on examples/card-cpu-long.yaml (its saturation; the server had served the rates
    before it): TTFT p50 -3.8% and ITL p50 -4.3% cold, +1.1% and -1.0% primed (docs/benchmarks.md)."""
    sizes = sorted({d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if d < shape.max_num_seqs} | {shape.max_num_seqs})
    for d in sizes:
        for ctx in PRIME_CONTEXTS:
            for p in PRIME_PREFILLS:
                if d + p <= shape.max_num_batched_tokens:
                    step = BatchShape(((0, p, True),) if p else (), d, d * ctx)
                    budget.observe(d, d * ctx, p, cost.time(shape_features(step)))


class Simulation:
    def __init__(self, cost: StepCost, shape: EngineShape | None = None, topology: Topology | None = None,
                 record_steps: bool = False, noise_seed: int = NOISE_SEED):
        self.cost, self.shape, self.topo = cost, shape or EngineShape(), topology or Topology()
        self.shape.validate()
        self.topo.validate()
        self.record_steps = record_steps
        self.noise_seed = noise_seed

    def run(self, requests: list[SimRequest], users: int | None = None) -> SimRun:
        """Open loop (users None): each request arrives at its `arrival`. Closed loop: `users` users each send the
        next request of the list when their last one ends (as `inferlab bench --concurrency`)."""
        return _Run(self, requests, users).go()


class _Run:
    def __init__(self, sim: Simulation, requests: list[SimRequest], users: int | None):
        t = sim.topo
        self.sim, self.cost, self.topo = sim, sim.cost, t
        if t.disaggregated:
            self.front = [Instance(f"prefill{i}", sim.shape, sim.cost) for i in range(t.prefill)]
            self.back = [Instance(f"decode{i}", sim.shape, sim.cost) for i in range(t.decode)]
        else:
            self.front = [Instance(f"replica{i}" if t.replicas > 1 else "engine", sim.shape, sim.cost)
                          for i in range(t.replicas)]
            self.back = []
        self.instances = self.front + self.back
        self.link_free = {i.name: 0.0 for i in self.front}
        self.events: list = []
        self.tie = itertools.count()
        self.rr = {"front": 0, "back": 0}
        self.requests = requests
        self.users = users
        self.next_index = 0
        self.outcomes: dict[str, RequestOutcome] = {}
        self.by_seq: dict[int, tuple[SimRequest, RequestOutcome, str]] = {}  # id(seq) -> request, outcome, role
        self.outside = 0  # requests in the system but in no scheduler: host overhead, KV transfer
        self.area, self.now = 0.0, 0.0
        self.steps: list[StepRecord] = []
        # A profile's step noise (measured / predicted quantiles): one draw per step, from a fixed stream, so a run
        # is repeatable and two loads see the same draws (common random numbers).
        self.noise = np.asarray(sim.cost.step_noise, dtype=np.float64) if sim.cost.step_noise else None
        self.noise_rng = np.random.default_rng(sim.noise_seed)
        # A profile's token delivery (quantiles): each token reaches its client a draw later, never before the one
        # before it; a stream of its own, so the steps draw the same noise with it or without.
        self.delivery = np.asarray(sim.cost.delivery, dtype=np.float64) if sim.cost.delivery else None
        self.delivery_rng = np.random.default_rng((sim.noise_seed, 1))

    # -- the event loop --------------------------------------------------------------------------------------
    def push(self, t: float, kind: str, *data) -> None:
        heapq.heappush(self.events, (t, next(self.tie), kind, data))

    def go(self) -> SimRun:
        if self.users is None:
            for r in self.requests:
                self.push(r.arrival, "arrive", r)
        else:
            for _ in range(min(self.users, len(self.requests))):
                self.send_next(0.0)
        handlers = {"arrive": self.arrive, "enter": self.enter, "step_done": self.step_done, "kv_done": self.kv_done,
                    "delivered": self.delivered}
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            self.area += self.in_system() * (t - self.now)
            self.now = t
            handlers[kind](*data)
            if not self.events or self.events[0][0] > t:
                # Everything due at t has happened (arrivals, ends of steps): idle engines wake and take it all,
                # as the engine thread drains every queued add before it schedules.
                for inst in self.instances:
                    self.kick(inst)
        bms = [i.bm for i in self.instances]
        queries = sum(b.prefix_queries for b in bms)
        return SimRun([self.outcomes[r.request_id] for r in self.requests if r.request_id in self.outcomes],
                      self.now, self.area, self.steps, {i.name: i.busy for i in self.instances},
                      sum(i.scheduler.num_preemptions for i in self.instances),
                      sum(b.prefix_hits for b in bms) / queries if queries else None)

    def in_system(self) -> int:
        return self.outside + sum(i.queued for i in self.instances)

    def send_next(self, t: float) -> None:
        if self.next_index < len(self.requests):
            r = replace(self.requests[self.next_index], arrival=t)  # the caller's list stays as given
            self.next_index += 1
            self.push(t, "arrive", r)

    # -- requests --------------------------------------------------------------------------------------------
    def route(self, pool: str, r: SimRequest) -> Instance:
        insts = self.front if pool == "front" else self.back
        policy = self.topo.router
        if policy == "round-robin":
            self.rr[pool] += 1
            return insts[(self.rr[pool] - 1) % len(insts)]
        if policy == "prefix-affinity":
            key = r.group if r.group is not None else hash(tuple(r.prompt_token_ids[:self.sim.shape.block_size]))
            return insts[key % len(insts)]
        return min(insts, key=lambda i: i.load)  # least-loaded: fewest requests waiting or running; ties to the first

    def arrive(self, r: SimRequest) -> None:
        o = RequestOutcome(r.request_id, r.arrival, len(r.prompt_token_ids), r.output_len, r.warmup)
        self.outcomes[r.request_id] = o
        inst = self.route("front", r)
        inst.incoming += 1
        self.outside += 1
        self.push(self.now + self.cost.request_overhead, "enter", r, o, inst)

    def enter(self, r: SimRequest, o: RequestOutcome, inst: Instance) -> None:
        self.outside -= 1
        inst.incoming -= 1
        q = self.sim.shape.max_queue
        if not inst.fits(len(r.prompt_token_ids) + r.output_len):
            o.rejected = "too long"
        elif q is not None and inst.num_waiting() >= q:
            o.rejected = "queue full"
        if o.rejected:
            o.refused_at = self.now
            self.depart(o)
            return
        prefill_only = self.topo.disaggregated
        seq = Sequence(r.request_id, list(r.prompt_token_ids),
                       SamplingParams(max_tokens=1 if prefill_only else r.output_len, ignore_eos=True),
                       RequestMetrics(r.arrival))
        self.by_seq[id(seq)] = (r, o, "prefill" if prefill_only else "all")
        if prefill_only:
            o.prefill_instance = inst.name
        else:
            o.instance = inst.name
        inst.scheduler.add(seq)

    def depart(self, o: RequestOutcome) -> None:
        if self.users is not None:
            self.send_next(self.now)

    # -- steps -----------------------------------------------------------------------------------------------
    def kick(self, inst: Instance) -> None:
        if inst.batch is not None or not inst.scheduler.has_work():
            return
        batch = inst.scheduler.schedule()
        if not batch:
            raise RuntimeError(f"{inst.name}: the scheduler found no step to run with requests waiting "
                               f"(KV pool of {inst.bm.num_blocks} blocks too small for them?)")
        dt = self.cost.step_time(batch)
        if self.noise is not None:
            dt *= self.noise[self.noise_rng.integers(len(self.noise))]
        inst.scheduler.observe(batch, dt)
        inst.batch = batch
        inst.busy += dt
        if self.sim.record_steps:
            self.steps.append(StepRecord(inst.name, self.now, self.now + dt, [s.request_id for s in batch.seqs],
                                         list(batch.num_new_tokens), [s.request_id for s in batch.preempted],
                                         batch.prefill_cap, batch.drain))
        self.push(self.now + dt, "step_done", inst)

    def step_done(self, inst: Instance) -> None:
        batch, inst.batch = inst.batch, None
        sampled = {s: [SAMPLED_TOKEN] for s, n in zip(batch.seqs, batch.num_new_tokens)
                   if s.num_computed_tokens + n >= s.num_tokens}
        inst.scheduler.update_from_output(batch, sampled)
        for seq, tokens in sampled.items():
            seq.token_ids.extend(tokens)
            r, o, role = self.by_seq[id(seq)]
            read = self.now
            if self.delivery is not None:
                read = max(read + self.delivery[self.delivery_rng.integers(len(self.delivery))],
                           o.token_times[-1] if o.token_times else read)
            o.token_times.append(read)
            if o.first_token is None:
                o.first_token = read
                o.num_cached_tokens = seq.num_cached_tokens
            if seq.num_output_tokens >= seq.params.max_tokens:
                o.num_preemptions += seq.num_preemptions
                inst.scheduler.finish(seq)
                del self.by_seq[id(seq)]
                if role == "prefill" and r.output_len > 1:
                    self.transfer(inst, r, o)
                elif read > self.now:  # on its way to the client: in the system until read
                    self.outside += 1
                    self.push(read, "delivered", o)
                else:
                    o.finish = self.now
                    self.depart(o)

    def delivered(self, o: RequestOutcome) -> None:
        self.outside -= 1
        o.finish = self.now
        self.depart(o)

    # -- disaggregation --------------------------------------------------------------------------------------
    def transfer(self, src: Instance, r: SimRequest, o: RequestOutcome) -> None:
        t = self.topo
        start = max(self.now, self.link_free[src.name])
        done = start + t.link_latency + t.kv_bytes_per_token * len(r.prompt_token_ids) / t.link_bandwidth
        self.link_free[src.name] = done
        o.kv_transfer = done - self.now
        self.outside += 1
        self.push(done, "kv_done", r, o)

    def kv_done(self, r: SimRequest, o: RequestOutcome) -> None:
        self.outside -= 1
        inst = self.route("back", r)
        o.instance = inst.name
        inst.inject_kv(r.prompt_token_ids, r.request_id)
        seq = Sequence(r.request_id, list(r.prompt_token_ids) + [SAMPLED_TOKEN],
                       SamplingParams(max_tokens=r.output_len - 1, ignore_eos=True), RequestMetrics(r.arrival))
        self.by_seq[id(seq)] = (r, o, "decode")
        inst.scheduler.add(seq)
