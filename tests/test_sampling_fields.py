"""Sampling fields RL clients send (issue 25): ``stop`` strings, ``min_tokens``, ``min_p``,
top-N ``logprobs`` — greedy output identical to ``k = 0`` under chains and trees on the
bundled target + EAGLE-3 pair (acceptance near 1, so steps accept several tokens and stops
land inside them), top-N logprobs equal to a transformers forward, bad values refused with
nothing touched. Sampled laws with min-p / min_tokens: ``test_sampling_lossless.py`` and
``test_min_p_sampler.py``."""

from __future__ import annotations

import math

import pytest
import torch
from lossless import TREES

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPTS = heldout_prompts(6)
RUNS = [dict(k=3), dict(tree=TREES["binary2"])]


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", dtype="float32",
                      kernel_backend="torch", max_batch_size=16, kv_cache_tokens=8 * 1024)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 40), **kw)


def assert_identical_to_k0(engine: SpecEngine, params: SamplingParams | list[SamplingParams]
                           ) -> list:
    """Every run of RUNS gives k=0's tokens, text, finish and stop reasons, logprobs and top
    logprobs (float rounding), with drafts accepted; the KV cache ends empty."""
    base = engine.generate(PROMPTS, k=0, sampling=params)
    for kwargs in RUNS:
        outs = engine.generate(PROMPTS, sampling=params, **kwargs)
        assert engine.stats.num_accepted_tokens > 0, kwargs
        for o, b in zip(outs, base):
            assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == \
                (b.token_ids, b.text, b.finish_reason, b.stop_reason), kwargs
            assert max(map(abs, (x - y for x, y in zip(o.logprobs, b.logprobs))),
                       default=0.0) <= 1e-4
            assert len(o.top_logprobs) == len(b.top_logprobs)
            for mine, theirs in zip(o.top_logprobs, b.top_logprobs):
                assert mine.keys() == theirs.keys()
                assert all(abs(mine[t] - theirs[t]) <= 1e-4 for t in mine)
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return base


def step_boundaries(engine: SpecEngine, prompt: str, k: int = 3) -> list[list[int]]:
    """The tokens each step emitted for ``prompt`` (step API, greedy, no stop)."""
    rid = engine.add_request(prompt, greedy(), k=k)
    steps = []
    while engine.has_unfinished():
        steps += [list(o.new_token_ids) for o in engine.step() if o.request_id == rid]
    return [s for s in steps if s]


# ------------------------------------------------------------------ stop strings


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_greedy_identity_mid_step(engine: SpecEngine, include: bool) -> None:
    """Stops of one and several characters (several tokens: across a token boundary) cut
    exactly where k=0 cuts, and some of them are completed by a token inside a step that
    accepted more (the tokens after it dropped)."""
    stops = [";2", "+0=", "A:"]
    base = assert_identical_to_k0(engine, greedy(stop=stops, include_stop_str_in_output=include))
    full = engine.generate(PROMPTS, k=0, sampling=greedy())
    mid_step = 0
    for prompt, b, f in zip(PROMPTS, base, full):
        # one character per token here: the stop is the first string (in list order) that
        # ends at the earliest character end, the tokens kept end there
        end = min(f.text.find(s) + len(s) for s in stops if s in f.text)
        stop = next(s for s in stops if f.text[end - len(s): end] == s)
        assert (b.finish_reason, b.stop_reason) == ("stop", stop)
        assert b.text == f.text[: end if include else end - len(stop)]
        assert b.token_ids == f.token_ids[:end]
        ends, n = [], 0
        for s in step_boundaries(engine, prompt):
            n += len(s)
            ends.append(n)
        mid_step += len(b.token_ids) not in ends
    assert mid_step > 0, "no stop landed inside a speculative step: the test lost its point"


def test_stop_string_across_tokens_and_min_tokens(engine: SpecEngine) -> None:
    """A multi-token stop string; with min_tokens the text of the first min_tokens tokens
    cannot start a stop (vLLM), so the first '=' is skipped."""
    base = assert_identical_to_k0(engine, greedy(stop=["="], min_tokens=5))
    full = engine.generate(PROMPTS, k=0, sampling=greedy())
    for b, f in zip(base, full):
        first = f.text.find("=")
        assert first < 5
        second = f.text.find("=", 5)
        assert b.text == f.text[:second] and len(b.token_ids) == second + 1


def test_stop_strings_async_engine_text(engine: SpecEngine) -> None:
    """The async engine (whose text is decoded off the step loop) answers the cut text."""
    import asyncio

    from specengine import AsyncSpecEngine

    async def run() -> list:
        async with AsyncSpecEngine(engine) as a:
            return list(await asyncio.gather(*[a.generate(p, greedy(stop=["+0"]), k=3)
                                               for p in PROMPTS]))

    outs = asyncio.run(run())
    want = engine.generate(PROMPTS, k=0, sampling=greedy(stop=["+0"]))
    assert [(o.text, o.token_ids, o.stop_reason) for o in outs] == \
        [(w.text, w.token_ids, w.stop_reason) for w in want]


def test_stop_reason_of_stop_token_ids(engine: SpecEngine) -> None:
    """vLLM's stop_reason: the id of stop_token_ids that ended it; None for EOS."""
    semi = engine.tokenizer.encode(";")[0]
    outs = engine.generate(PROMPTS[:2], k=3, sampling=greedy(stop_token_ids=(semi,)))
    assert all(o.finish_reason == "stop" and o.stop_reason == semi for o in outs)
    outs = engine.generate(PROMPTS[:2], k=3, sampling=greedy(max_tokens=60))
    assert all(o.finish_reason == "stop" and o.stop_reason is None for o in outs)


# ------------------------------------------------------------------ min_tokens / min_p


def test_min_tokens_greedy_identity(engine: SpecEngine) -> None:
    """EOS is masked until min_tokens, each verify position under its own mask: with
    min_tokens = (tokens before the plain answer's EOS) nothing changes, and EOS there must
    not be masked by the earlier positions of its step; with more, the answer runs on past
    its EOS. Identical under speculation."""
    plain = engine.generate(PROMPTS, k=0, sampling=greedy(max_tokens=60))
    params = [greedy(max_tokens=60, min_tokens=len(o.token_ids) - 1 + (i % 3) * 2)
              for i, o in enumerate(plain)]
    base = assert_identical_to_k0(engine, params)
    eos = set(engine.core.eos_token_ids)
    for i, (o, p, q) in enumerate(zip(base, params, plain)):
        assert q.token_ids[-1] in eos
        if i % 3 == 0:
            assert o.token_ids == q.token_ids
        else:
            assert len(o.token_ids) > p.min_tokens
        assert not eos & set(o.token_ids[: p.min_tokens])


def test_min_p_greedy_identity_and_sampled_runs(engine: SpecEngine) -> None:
    assert_identical_to_k0(engine, greedy(min_p=0.5))
    sp = SamplingParams(temperature=1.5, min_p=0.2, max_tokens=30, seed=3)
    a = engine.generate(PROMPTS, k=3, sampling=sp)
    assert a == engine.generate(PROMPTS, k=3, sampling=sp)  # seeded: reproducible


# ------------------------------------------------------------------ top-N logprobs


def test_top_logprobs_equal_a_transformers_forward(engine: SpecEngine) -> None:
    """For every generated token: the N most likely ids and their log_softmax, and the
    token's own, at that position of a transformers forward over prompt + output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    params = [greedy(logprobs=5), SamplingParams(temperature=1.0, max_tokens=40, logprobs=2,
                                                 seed=1), greedy(logprobs=0), greedy()]
    outs = engine.generate(PROMPTS[:4], k=3, sampling=params)
    assert engine.stats.num_accepted_tokens > 0
    assert outs[3].top_logprobs == ()
    for o, p in zip(outs[:3], params):
        ids = list(o.prompt_token_ids) + list(o.token_ids)
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        n0 = len(o.prompt_token_ids)
        assert len(o.top_logprobs) == len(o.token_ids)
        for i, (tok, entry) in enumerate(zip(o.token_ids, o.top_logprobs)):
            row = lsm[n0 + i - 1]
            top = row.topk(p.logprobs).indices.tolist()
            assert set(entry) == set(top) | {tok}
            assert all(abs(entry[t] - float(row[t])) <= 1e-4 for t in entry)


# ------------------------------------------------------------------ refused


@pytest.mark.parametrize(("kw", "field"), [
    (dict(stop=[""]), "stop[0]"), (dict(stop=["x" * 1025]), "stop[0]"),
    (dict(stop=["a"] * 33), "stop holds 33"), (dict(stop=[3]), "stop[0]"),
    (dict(stop=b"x"), "stop must be"), (dict(include_stop_str_in_output=1),
                                         "include_stop_str_in_output"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=41), "min_tokens"),
    (dict(min_tokens=True), "min_tokens"), (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=math.nan), "min_p"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"), (dict(repetition_penalty=1.1), "repetition_penalty"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(frequency_penalty=-0.5), "frequency_penalty"),
])
def test_bad_values_refused(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(max_tokens=40, **kw)


def test_defaults_and_single_string_accepted() -> None:
    sp = SamplingParams(stop="A:", min_p=1, min_tokens=40, max_tokens=40, logprobs=20,
                        repetition_penalty=1, presence_penalty=0)
    assert sp.stop == ("A:",) and sp.min_tokens == 40


def test_stop_strings_need_a_tokenizer(tiny_checkpoint, engine: SpecEngine) -> None:
    """Refused at admission (no tokenizer.json), nothing queued or held."""
    plain = SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", max_model_len=64,
                       max_batch_size=4, kv_cache_tokens=1024)
    assert plain.tokenizer is None
    with pytest.raises(ValueError, match="stop strings of prompt 0 need"):
        plain.generate([[1, 2, 3]], sampling=SamplingParams(stop=["x"], max_tokens=4))
    assert not plain.has_unfinished()
    assert plain.kv_cache.num_free_blocks == plain.kv_cache.num_blocks
    assert len(plain.generate([[1, 2, 3]], sampling=SamplingParams(max_tokens=4))[0]
               .token_ids) == 4
