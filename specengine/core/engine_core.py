"""The step loop behind ``SpecEngine`` (docs/design.md §1): requests, the scheduler, one step.

``step()`` = schedule → run (a prefill batch, or decode / verify steps of the running
sequences) → postprocess (append, finish, release, outputs). Requests join (``add``) and leave
(``abort``, or finishing) between steps: continuous batching. The model, KV cache, drafter and
static path are built by ``SpecEngine`` and handed in; the core never touches weights.

Per-request draft length: each request keeps its own ``k`` (and tree). A decode step groups
the running sequences by (k, tree) and runs one ``speculative_step`` per group, so every
sequence advances exactly as it would in a ``generate`` call with its own k (sampled tokens
depend on k, docs/design.md §1). With one k for all, which is the RL case, a step is one
group: the same single verify pass as before.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specengine.config import EngineConfig
from specengine.core.auto_k import SYNC, AutoK
from specengine.core.graphs import GraphRunner
from specengine.core.isolation import Isolation
from specengine.core.kv_cache import KVCache
from specengine.core.model_runner import ModelRunner
from specengine.core.prefix_cache import SeqGroup
from specengine.core.run_stats import RunStats, StepTimes
from specengine.core.sampler import Sampler, SamplingTensors
from specengine.core.scheduler import ScheduledBatch, Scheduler
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import SeqStatus, Sequence
from specengine.core.step import append_step, speculative_step
from specengine.core.stop_strings import StopStrings
from specengine.core.token_logprobs import record_top_logprobs
from specengine.core.transfer import to_host
from specengine.core.verify import raw_top, top_logprobs
from specengine.drafters.base import Drafter
from specengine.model.expert_load import enable_expert_load
from specengine.outputs import GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams
from specengine.tokenizer import TextTokenizer
from specengine.tree import DraftTree

logger = logging.getLogger(__name__)

#: finished request ids remembered so ``abort`` of one says "finished", not "unknown"
MAX_REMEMBERED_FINISHED = 1 << 16

# (seqs, k, tree, times, weight version): one verify step of one (k, tree) group


@dataclass
class RequestState:
    request_id: str
    seq: Sequence
    k: int
    tree: DraftTree | None
    num_reported: int = 0  # output tokens already returned by step()
    restarted: bool = False  # started again from its prompt since its last report
    sample_index: int = 0  # which of its prompt's SamplingParams.n samples (prefix_cache)
    auto: bool = False  # k="auto": each step runs the k AutoK picks in 0..k (k is k_max)
    error: str | None = None  # why it failed alone in a step (core.isolation)

    @property
    def lookahead(self) -> int:
        """Draft tokens a verify step feeds after the newest token."""
        return self.tree.num_nodes - 1 if self.tree is not None else self.k


class EngineCore:
    """Request bookkeeping (request_id → Sequence, its k / tree) and the step.

    :meth:`decode_step` runs one verify step of one (k, tree) group (``core.step``); the
    host-overhead benchmark wraps it on the instance.
    ``weight_version()`` is stamped on every output and, taken before each step, on every
    token the step made. Weights may change between steps (``core.inflight``)."""

    def __init__(self, config: EngineConfig, kv_cache: KVCache, runner: ModelRunner,
                 sampler: Sampler, graphs: GraphRunner, drafter: Drafter | None,
                 tokenizer: TextTokenizer | None, eos_token_ids: tuple[int, ...],
                 weight_version: Callable[[], int]) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.runner = runner
        self.sampler = sampler
        self.graphs = graphs
        self.drafter = drafter
        self.tokenizer = tokenizer
        # Off under AsyncSpecEngine: its callers' threads decode, not the step loop.
        self.detokenize = True
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(config.device)
        self._weight_version = weight_version
        # Running sequences' tokens and counters: a step appends all rows at once.
        self.arena = SeqArena(config.max_batch_size, config.max_model_len)
        self.scheduler = Scheduler(
            kv_cache, config.max_batch_size, config.max_num_batched_tokens,
            on_preempt=drafter.release if drafter is not None else None,
            arena=self.arena, lookahead_of=lambda seq: self._by_seq[seq.seq_id].lookahead,
        )
        self._groups_of: tuple[tuple[Sequence, ...] | None, list] = (None, [])
        self._isolation = Isolation(self)  # a failing step fails only its culprit
        self.auto_k = AutoK()  # k="auto": the cost model (fitted by its warm-up), acceptance
        self._rng = random.Random(config.seed)
        self._next_seq_id = 0
        self.requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()  # request_id -> finish_reason
        # Finished between steps (``finish_between_steps``), released, reported by next step.
        self._ended: list[RequestState] = []
        self._run: RunStats | None = None  # the current busy span
        self.last_run = RunStats(end=time.perf_counter())
        # MoE targets: experts touched per pass kind, counted on the device (stats read it)
        self.expert_load = enable_expert_load(runner.model, self.device)

    # ---- requests ----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, prompt: tuple[int, ...], params: SamplingParams, k: int,
            tree: DraftTree | None, request_id: str | None = None, auto: bool = False,
            sample: tuple[SeqGroup, int] | None = None) -> str:
        """Queue a validated request (``requests.validate_requests`` checked prompt, params, k
        and tree); it joins at the next step. ``sample``: (group, sample index) of one of a
        prompt's n samples (``prefix_cache.expand_samples``). Returns its id."""
        if request_id is None:
            request_id = f"req-{self._next_seq_id}"
            while request_id in self.requests:  # a caller chose this name: pick another
                request_id += "'"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already used by an unfinished "
                             "request")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seq = Sequence(self._next_seq_id, list(prompt), params, seed, self.eos_token_ids)
        if params.stop:  # (validate_requests checked that there is a tokenizer)
            seq.stop_strings = StopStrings(params, self.tokenizer)  # type: ignore[arg-type]
        self._next_seq_id += 1
        req = RequestState(request_id, seq, k, tree, auto=auto,
                       sample_index=sample[1] if sample else 0)
        self.requests[request_id] = req
        self._by_seq[seq.seq_id] = req
        self._finished.pop(request_id, None)  # a reused id is live again
        self.scheduler.add(seq, sample[0] if sample else None)
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now: its KV blocks and drafter state are freed at once; returns its
        final output (``finish_reason="abort"``, with the tokens made so far)."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None:
            if isinstance(request_id, str) and request_id in self._finished:
                raise ValueError(f"request {request_id!r} already finished (finish_reason "
                                 f"{self._finished[request_id]!r}): nothing to abort")
            raise ValueError(f"unknown request id {request_id!r} (not added, or already "
                             "finished and reported)")
        if req in self._ended:  # finished between steps, not reported yet: report it now
            self._ended.remove(req)
        else:
            self.release(req.seq)
            req.seq.status, req.seq.finish_reason = SeqStatus.FINISHED, "abort"
        out = self._report(req, released=True)
        self._end_run_if_idle()
        return out

    def finish_between_steps(self, request_id: str, reason: str) -> None:
        """End an unfinished request now (KV blocks and drafter state freed at once) with
        ``reason``; the next :meth:`step` reports it (used after a weight update)."""
        req = self.requests[request_id]
        if req in self._ended:
            return
        self.release(req.seq)
        req.seq.status, req.seq.finish_reason = SeqStatus.FINISHED, reason
        self._ended.append(req)

    def release(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._cache_blocks(seq)
            self.scheduler.finish(seq)  # frees its blocks, leaves the running list
        else:  # waiting (never admitted, or preempted): it holds no blocks
            self.scheduler.waiting.remove(seq)
            self.kv_cache.free(seq)
        if self.drafter is not None:
            self.drafter.release(seq)

    def _cache_blocks(self, seq: Sequence) -> None:
        """Before a finished or aborted running ``seq`` frees its blocks: name its full
        blocks of valid KV, generated tokens included, in the prefix cache
        (``KVCache.cache_finished``), so a conversation's next turn prefills only the new
        turn. The target's KV is valid up to the position before the newest token. When a
        feature drafter's entries live in these blocks (the static path), they are valid
        there too only if it caught up on every pass of the sequence: a fixed k > 0 (a k = 0
        step, or an auto one, may skip its catch-up). A drafter's own cache names its blocks
        in its ``release``."""
        kv = self.kv_cache
        if kv.prefix is None:
            return
        if kv.names_need_draft:
            req = self._by_seq.get(seq.seq_id)
            if req is None or req.k <= 0 or req.auto:
                return
        kv.cache_finished(seq, len(seq) - 1)

    def abort_all(self) -> None:
        """Drop every request and free its blocks (after an error, or on shutdown)."""
        for seq in self.scheduler.abort_all():
            if self.drafter is not None:
                self.drafter.release(seq)
        self.requests.clear()
        self._by_seq.clear()
        self._ended.clear()
        self._isolation.lone_failures = 0
        self._end_run_if_idle()

    # ---- the step ----------------------------------------------------------------------------
    def step(self, report_unfinished: bool = True) -> list[RequestOutput]:
        """One engine step: a prefill batch (new or preempted requests first) or one verify
        step of every running sequence. Returns an output for each request that advanced
        (with ``report_unfinished=False``, as ``generate`` runs it: for each request that
        finished, so a step builds no per-sequence output while nothing ends).
        When running the batch raises an ``Exception``, the run is undone and its sequences
        are retried apart (``core.isolation``): one that fails alone finishes with
        ``finish_reason="error"``, the others go on as if it had never been there. An
        engine-wide fault (sequences in a row failing alone), or an error anywhere else in the
        step, aborts every request (blocks freed) and is raised."""
        if not self.requests:
            return []
        if self._run is None:
            self._run = RunStats(expert_load=self.expert_load)
            if self.expert_load is not None:  # a new span counts from zero (a device op)
                self.expert_load.reset()
        run = self._run
        outputs = [self._report(req, released=True) for req in self._ended]
        self._ended.clear()
        if not self.scheduler.has_unfinished():  # all that was left ended between steps
            self._end_run_if_idle()
            return outputs
        version = self._weight_version()  # weights change only between steps
        try:
            scheduled = self.scheduler.schedule(self.lookahead)  # 1. schedule
            seqs, isolated = self._run_isolated(scheduled, run, version)  # 2. run
            outputs += self._postprocess(seqs, scheduled.is_prefill or isolated,  # 3. report
                                         report_unfinished)
        except BaseException:
            self.abort_all()
            raise
        run.end = time.perf_counter()
        self._end_run_if_idle()
        return outputs

    def _run_isolated(self, scheduled: ScheduledBatch, run: RunStats, version: int
                      ) -> tuple[tuple[Sequence, ...], bool]:
        """Run the batch; when that raises, find the failing request (``core.isolation``).
        Returns the sequences that ran and whether isolation redid the run."""
        self._isolation.checkpoint()
        try:
            self.run_batch(scheduled, run, version)
        except Exception as exc:  # one request's data, or the engine's fault: find which
            return self._isolation.isolate(scheduled, exc, run, version), True
        return scheduled.seqs, False

    def _postprocess(self, seqs: tuple[Sequence, ...], scan: bool, report_unfinished: bool
                     ) -> list[RequestOutput]:
        """An output per request that advanced, or (``report_unfinished=False``) per request
        that finished in this step."""
        if not report_unfinished:
            seqs = tuple(self._ended_in_step(seqs, scan))
        return [self._report(self._by_seq[s.seq_id], released=False) for s in seqs]

    def run_batch(self, scheduled: ScheduledBatch, run: RunStats, version: int) -> None:
        """Run a scheduled batch: its prefill, or one verify step per (k, tree) group."""
        seqs = scheduled.seqs
        if scheduled.is_prefill:
            t0 = time.perf_counter()
            self._prefill(seqs, self._prefill_observes(seqs), version)
            run.prefill_s += time.perf_counter() - t0
            run.add_prefill(self.runner.last_prefill)
            run.num_forwards += 1
            return
        for (k, tree), group in self._groups(seqs):
            if self._by_seq[group[0].seq_id].auto:  # this step's k from the cost model
                run.count_auto_k(self.auto_k.run(
                    len(group), k, run.times,
                    lambda k, g=group: self.decode_step(g, k, None, run.times, version)))
            else:
                if k == 0 and tree is None and self.drafter is not None \
                        and self.drafter.catch_up_at_k0:
                    k = SYNC  # no drafts, the drafter catches up (Drafter.catch_up_at_k0)
                self.decode_step(group, k, tree, run.times, version)
            run.num_forwards += 1
        self._isolation.lone_failures = 0  # a verify step went through: the engine works

    def decode_step(self, seqs: tuple[Sequence, ...], k: int, tree: DraftTree | None,
                    times: StepTimes, version: int) -> None:
        """One draft → verify → keep step of the running ``seqs`` (``core.step``; the unit
        the host-overhead benchmark times)."""
        speculative_step(seqs, k, tree, self.drafter, self.graphs, self.kv_cache,
                         self.config.max_model_len, times, self.arena, version)

    def _ended_in_step(self, seqs: tuple[Sequence, ...], scan: bool) -> list[Sequence]:
        """The sequences of this step that finished: ``scan`` visits them all (a prefill, or
        a step whose runs isolation redid). A decode step reads the arena's count of ended
        sequences (every one ended before this step was released in its own step), and with
        one group its flags through the batch state's rows (its rows are exactly ``seqs``), so
        no sequence is visited unless it ended."""
        if not scan and self.arena.num_done == 0:  # the common step: nothing ended
            return []
        state = self.graphs.verifier.state
        if scan or len(state.seqs) != len(seqs) or len(self._groups(seqs)) != 1:
            return [s for s in seqs if s.status is SeqStatus.FINISHED]
        ended = np.flatnonzero(self.arena.done[state.row_slots[: len(seqs)]])
        return [state.seqs[r] for r in ended.tolist()]

    @property
    def stats(self) -> RunStats:
        """The current busy span, else the last one."""
        return self._run if self._run is not None else self.last_run

    def lookahead(self, seq: Sequence) -> int:
        """Draft slots ``seq``'s next verify step needs (its k or tree, within the context)."""
        room = max(0, self.config.max_model_len - len(seq))
        return min(self._by_seq[seq.seq_id].lookahead, room)

    def fail(self, seq: Sequence, error: str) -> str:
        """Finish ``seq`` (holding no blocks: ``core.isolation`` evicted it) with
        ``finish_reason="error"`` and ``error``; reported by this step. Returns its id."""
        req = self._by_seq[seq.seq_id]
        req.error = error
        seq.finish("error")
        return req.request_id

    def _groups(self, seqs: tuple[Sequence, ...]
                ) -> list[tuple[tuple[int, DraftTree | None], tuple[Sequence, ...]]]:
        """Running sequences by (k, tree), in first-seen order (the same batch object as last
        step, which the scheduler returns while nothing changed, has the same groups)."""
        if self._groups_of[0] is seqs:
            return self._groups_of[1]
        groups: dict[tuple, tuple[tuple[int, DraftTree | None], list[Sequence]]] = {}
        for seq in seqs:
            req = self._by_seq[seq.seq_id]
            # Trees compare by their (sorted) paths: equal trees of separate requests share a step.
            key = (req.k, None if req.tree is None else req.tree.paths, req.auto)
            groups.setdefault(key, ((req.k, req.tree), []))[1].append(seq)
        if len(groups) == 1:  # the RL case: one k for all, the batch is the group
            (kt, _), = groups.values()
            out = [(kt, seqs)]
        else:
            out = [(kt, tuple(group)) for kt, group in groups.values()]
        self._groups_of = (seqs, out)
        return out

    def _prefill_observes(self, seqs: tuple[Sequence, ...]) -> bool:
        """Whether the drafter catches up on this prefill: some request will draft (a k="auto"
        one while the auto rule keeps the drafter in sync, ``core.auto_k``)."""
        if self.drafter is not None and self.drafter.catch_up_at_k0:
            return True
        reqs = [self._by_seq[s.seq_id] for s in seqs]
        auto = [r.k for r in reqs if r.auto and r.k > 0]
        return any(r.k > 0 and not r.auto for r in reqs) or (
            bool(auto) and self.auto_k.on_prefill(max(auto)))

    def _prefill(self, seqs: tuple[Sequence, ...], observe: bool, version: int) -> None:
        """Prompt pass + first token; the drafter catches up only when some request will
        draft (a k=0 baseline on an engine with a drafter costs exactly a plain engine's)."""
        if self.expert_load is not None:
            self.expert_load.prefill = True
        try:
            logits, target_out = self.runner.prefill(seqs, observe)  # [B, V]
        finally:
            if self.expert_load is not None:
                self.expert_load.prefill = False
        wants_top = any(s.params.logprobs is not None for s in seqs)
        raw = raw_top(logits[:, None, :]) if wants_top else None  # before masks: raw logits
        with torch.inference_mode():
            for b, seq in enumerate(seqs):  # min_tokens: no stop id as the next token yet
                if seq.num_generated < seq.params.min_tokens and seq.stop_token_ids:
                    logits[b, sorted(seq.stop_token_ids)] = float("-inf")
        empty = torch.zeros(len(seqs), 0, dtype=torch.int64, device=self.device)
        zeros = torch.zeros(len(seqs), dtype=torch.int32, device=self.device)
        out = self.sampler(logits[:, None, :], empty, zeros, None, None,
                           SamplingTensors.from_seqs(seqs, self.device))
        packed = to_host(out.pack())  # one host sync
        # The fed rows: a reused prefix is not fed, and the drafter's KV of it is reused too
        # (drafters.draft_prefix); a borrower's rows are its sibling's.
        rows = target_out.fed_rows
        none = np.zeros(len(seqs), dtype=np.int64)  # no drafts: one emitted token per row
        slots = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))
        if raw is not None:
            top = to_host(top_logprobs(logits[:, None, :], raw, out.output_ids, out.row_ids))
            old_lens = self.arena.lens[slots].copy()
        append_step(self.arena, seqs, packed, len(seqs), slots, none, none, None, version)
        if raw is not None:
            record_top_logprobs(self.arena, seqs, slots, len(seqs), old_lens, top)
        if observe and self.drafter is not None:
            self.drafter.observe(seqs, target_out, rows)

    # ---- postprocess -------------------------------------------------------------------------
    def _report(self, req: RequestState, released: bool) -> RequestOutput:
        """This step's new tokens of ``req``; a finished request is released (blocks, drafter
        state) and forgotten, and its output made."""
        seq = req.seq
        new = tuple(seq.token_slice(seq.num_prompt_tokens + req.num_reported))
        req.num_reported = seq.num_generated
        restarted, req.restarted = req.restarted, False  # core.inflight restarts
        if seq.status is not SeqStatus.FINISHED:
            return RequestOutput(req.request_id, new, False, restarted=restarted)
        if not released:
            self._cache_blocks(seq)
            self.scheduler.finish(seq)
        if self.drafter is not None:
            self.drafter.release(seq)
        del self.requests[req.request_id]
        del self._by_seq[seq.seq_id]
        reason = seq.finish_reason or "length"
        self._finished[req.request_id] = reason
        if len(self._finished) > MAX_REMEMBERED_FINISHED:
            self._finished.popitem(last=False)
        if self._run is not None:
            self._run.add_finished(seq)
        return RequestOutput(req.request_id, new, True,
                             self._output(seq, reason, req.sample_index, req.error), restarted)

    def _output(self, seq: Sequence, reason: str, sample_index: int = 0,
                error: str | None = None) -> GenerationOutput:
        text, stop_reason = None, None
        match = seq.stop_strings.match if seq.stop_strings is not None else None
        if match is not None and reason == "stop":  # decoded on the step loop: cut at the stop
            text, stop_reason = match[2], match[1]
        elif self.tokenizer is not None and self.detokenize:
            text = self.tokenizer.decode(seq.output_token_ids)
        if reason == "stop" and stop_reason is None and seq.num_generated:
            last = seq.last_token  # vLLM: EOS gives None, a stop_token_ids id gives the id
            if (seq.params.ignore_eos or last not in self.eos_token_ids) and \
                    last in seq.params.stop_token_ids:
                stop_reason = last
        return GenerationOutput(
            prompt_token_ids=tuple(seq.token_ids[: seq.num_prompt_tokens]),
            token_ids=tuple(seq.output_token_ids),
            logprobs=tuple(seq.logprobs),
            finish_reason=reason,
            num_steps=seq.num_steps,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
            weight_version=self._weight_version(),
            text=text,
            token_weight_versions=tuple(seq.token_weight_versions),
            sample_index=sample_index,
            error=error,
            stop_reason=stop_reason,
            top_logprobs=(tuple(seq.top_logprobs[: seq.num_generated])
                          if seq.params.logprobs is not None else ()),
            num_cached_tokens=seq.num_prefix_cached_tokens,
        )

    def _end_run_if_idle(self) -> None:
        """Once nothing is left: the span's stats are final, the persistent batch's rows are
        dropped (they hold nothing of use)."""
        if self.requests:
            return
        self.graphs.verifier.state.clear()
        if self._run is not None:
            self._run.end = self._run.end or time.perf_counter()
            self._run.freeze_expert_load()  # a device copy: the next span resets the counters
            self.last_run, self._run = self._run, None


__all__ = ["EngineCore"]
