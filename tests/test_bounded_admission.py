"""One bad request never hurts another (issue 22, problem 2): bounded work before admission.

A huge body is refused (413) while it arrives, never buffered whole (``server.limits``); a text
too long for ``max_model_len`` is refused by its character count before it is tokenized
(``TextTokenizer.max_prompt_chars``); and text prompts are tokenized and outputs decoded in
the async engine's text pool, never on the engine thread. Through a live server on the
bundled pair, a 4 MB prompt and a 50 MB body each get their 4xx at once while a small request
sent alongside gets its normal greedy output, and the server's memory stays where it was.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_helpers import (
    GREEDY,
    WAIT_S,
    assert_idle_and_free,
    assert_same,
    bundled_engine,
    in_engine,
    running_server,
)
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.implementations import ByteLevelBPETokenizer

from specengine import AsyncSpecEngine, SpecEngine
from specengine.assets import DEFAULT_TARGET
from specengine.cli import _parser
from specengine.client import SpecEngineClient
from specengine.outputs import GenerationOutput
from specengine.server.app import build_app
from specengine.server.serve import RolloutServer, make_server
from specengine.tokenizer import TextTokenizer, load_tokenizer

SMALL = "Q:472*6="
MB = 1_000_000
MAX_RSS_GROWTH_MB = 200


def rss_mb() -> float:
    """This process's resident memory (the server runs in it, in a thread)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")  # pragma: no cover


@pytest.fixture(scope="module")
def reference() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def expected(reference: SpecEngine) -> GenerationOutput:
    return reference.generate([SMALL], k=3, sampling=GREEDY)[0]


@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    a = AsyncSpecEngine(bundled_engine())
    yield a
    asyncio.run(a.close())


@pytest.fixture(scope="module")
def served(aeng: AsyncSpecEngine) -> Iterator[tuple[RolloutServer, SpecEngineClient]]:
    with running_server(aeng, default_k=3) as pair:  # build_app's default body limit
        yield pair


def send(port: int, body: bytes | Iterator[bytes], chunked: bool = False
         ) -> tuple[int, dict, float]:
    """POST /generate with ``body`` (sent whole with its Content-Length, or chunked without
    one); returns the status, the JSON answer and the seconds until the answer came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/generate", body=body, encode_chunked=chunked,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw), time.perf_counter() - t0
    finally:
        conn.close()


def alongside(client: SpecEngineClient, port: int, body: bytes
              ) -> tuple[int, dict, float, GenerationOutput]:
    """The small request and ``body`` in flight together."""
    with ThreadPoolExecutor(2) as pool:
        small = pool.submit(client.generate, SMALL, GREEDY, k=3)
        status, answer, seconds = send(port, body)
        return status, answer, seconds, small.result(timeout=WAIT_S)


# ---- through a live server -----------------------------------------------------------------
def test_4mb_prompt_refused_at_once_small_request_unharmed(served, aeng, expected) -> None:
    server, client = served
    client.generate(SMALL, GREEDY, k=3)  # warm: first-request costs are not the huge one's
    body = json.dumps({"prompt": "1" * (4 * MB), "sampling_params": {"temperature": 0.0}})
    body_bytes = body.encode()
    del body
    before = rss_mb()
    status, answer, seconds, small = alongside(client, server.port, body_bytes)
    assert status == 400, answer
    # Refused by its length (the limit named), not after tokenizing it.
    assert "prompt 0 has 4000000 characters" in answer["error"]
    assert "at most 1275 characters" in answer["error"]
    assert seconds < 1.0, f"the 4 MB prompt took {seconds:.2f} s to refuse"
    assert_same(small, expected)
    growth = rss_mb() - before
    assert growth < MAX_RSS_GROWTH_MB, f"the server grew by {growth:.0f} MB"
    in_engine(aeng, assert_idle_and_free)


def test_50mb_body_refused_413_before_it_is_read(served, aeng, expected) -> None:
    server, client = served
    # Valid JSON whose size alone is the problem (an extra field would be a cheap 422 once
    # read, so a 413 shows the body was refused before it was read and parsed).
    body = (b'{"prompt": "Q:1+2=", "padding": "' + b"x" * (50 * MB) + b'"}')
    before = rss_mb()
    status, answer, seconds, small = alongside(client, server.port, body)
    assert status == 413, answer
    assert "request body too large" in answer["error"]
    assert f"at most {32 * 1024 * 1024} bytes" in answer["error"]
    assert seconds < 10.0  # sending 50 MB over loopback, the server dropping it
    assert_same(small, expected)
    growth = rss_mb() - before
    assert growth < MAX_RSS_GROWTH_MB, f"the server grew by {growth:.0f} MB"
    assert client.generate(SMALL, GREEDY, k=3).token_ids == expected.token_ids  # still serves
    in_engine(aeng, assert_idle_and_free)


def test_small_limit_chunked_body_refused_while_it_arrives(aeng, expected) -> None:
    limit = 64 * 1024
    with running_server(aeng, default_k=3, max_body_bytes=limit) as (server, client):
        # Under the limit: served as usual.
        assert_same(client.generate(SMALL, GREEDY, k=3), expected)
        # Content-Length over the limit: 413 before a byte of the body is read.
        status, answer, _ = send(server.port, b"{" + b" " * limit + b"}")
        assert status == 413 and f"{limit + 2} bytes" in answer["error"], answer
        # No Content-Length (chunked): counted as it arrives, refused once past the limit.
        def chunks() -> Iterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(64):
                yield b"1" * (64 * 1024)
            yield b'"}'

        status, answer, _ = send(server.port, chunks(), chunked=True)
        assert status == 413, answer
        assert f"more than {limit} bytes" in answer["error"]
        # A body under the limit with a prompt too long: refused by its length.
        status, answer, _ = send(server.port, json.dumps({"prompt": "1" * 40_000}).encode())
        assert status == 400 and "has 40000 characters" in answer["error"], answer
    in_engine(aeng, assert_idle_and_free)


def test_build_app_checks_max_body_bytes(aeng) -> None:
    for bad in (0, -1, 1.5, True, "32"):
        with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1"):
            build_app(aeng, max_body_bytes=bad)


def test_serve_max_body_mb_reaches_the_app(aeng) -> None:
    args = _parser().parse_args(["serve", "--max-body-mb", "0.5"])
    assert args.max_body_mb == 0.5
    server = make_server(aeng, port=0, max_body_bytes=int(args.max_body_mb * 1024 * 1024))
    limiter = server.config.app.user_middleware
    assert any(m.kwargs.get("max_body_bytes") == 512 * 1024 for m in limiter), limiter


# ---- the character-count check -------------------------------------------------------------
def test_text_longer_than_the_character_bound_is_refused_before_tokenizing() -> None:
    tok = load_tokenizer(DEFAULT_TARGET, max_model_len=256)
    assert tok is not None
    # The bundled vocabulary's longest tokens are "<pad>" and "<eos>": 5 characters.
    assert tok.max_chars_per_token == 5
    assert tok.max_prompt_chars() == 255 * 5
    # One past the bound: the message names the character limit (a refusal after tokenizing
    # would count 1276 tokens instead).
    with pytest.raises(ValueError, match=r"prompt 0 has 1276 characters; max_model_len 256 "
                                         r"allows at most 255 prompt tokens, which span at "
                                         r"most 1275 characters"):
        tok.encode("1" * 1276, "prompt 0")
    # Exactly at the bound the text is tokenized: 255 five-character tokens fit.
    assert tok.encode("<eos>" * 255, "prompt 0") == [1] * 255
    assert len(tok.encode("1" * 1275)) == 1275  # tokenized; the engine refuses 1275 tokens
    # Without max_model_len nothing is refused by length.
    assert len(load_tokenizer(DEFAULT_TARGET).encode("1" * 2000)) == 2000


def test_engine_refuses_a_long_text_by_its_length(reference: SpecEngine) -> None:
    with pytest.raises(ValueError, match="prompt 0 has 1276 characters"):
        reference.generate(["1" * 1276], sampling=GREEDY)
    with pytest.raises(ValueError, match="prompt 0 has 1275 tokens"):
        reference.generate(["1" * 1275], sampling=GREEDY)  # under the bound: tokenized
    assert reference.kv_cache.num_free_blocks == reference.kv_cache.num_blocks


def _byte_level() -> Tokenizer:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["héé héé héé ééé ééé", "hello world hello"] * 50,
                            vocab_size=300, min_frequency=2, show_progress=False)
    return bpe._tokenizer


def test_byte_level_bound_is_the_decoded_length() -> None:
    raw = _byte_level()
    tok = TextTokenizer(raw, max_model_len=8)
    vocab = raw.get_vocab()
    decoded = max(len(raw.decode([i])) for i in vocab.values())
    assert max(len(t) for t in vocab) > decoded  # "Ã©" is one character of text: bytes differ
    assert tok.max_chars_per_token == decoded
    for text in ("héé héé", "ééé ééé héé", "hello world"):  # the bound holds
        assert len(text) <= len(raw.encode(text).ids) * decoded


def _whitespace_split() -> Tokenizer:
    t = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return t


def _nfc() -> Tokenizer:
    t = Tokenizer(models.WordLevel({"é": 0, "e": 1, "<u>": 2}, unk_token="<u>"))
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    t.decoder = decoders.Fuse()
    return t


def test_no_character_bound_where_a_token_may_stand_for_more() -> None:
    # Whitespace split off (dropped): "a" + a million spaces + "b" is two tokens.
    ws = TextTokenizer(_whitespace_split(), pad_ids=frozenset({2}), max_model_len=8)
    assert ws.max_chars_per_token is None
    assert ws.encode("a" + " " * 100 + "b") == [0, 1]
    # A real unknown token stands for a whole word.
    unk = TextTokenizer(_whitespace_split(), unk_id=2, max_model_len=8)
    assert unk.max_chars_per_token is None
    # NFC composes "e" + U+0301 into one "é": up to 4 code points per character.
    nfc = TextTokenizer(_nfc(), pad_ids=frozenset({2}), max_model_len=8)
    assert nfc.max_chars_per_token == 3 * 4  # "<u>" is 3 characters
    assert nfc.encode("e\u0301" * 7) == [0] * 7
    stripped = _nfc()
    stripped.normalizer = normalizers.Strip()  # deletes characters
    assert TextTokenizer(stripped, max_model_len=8).max_chars_per_token is None


# ---- the async engine ----------------------------------------------------------------------
CALLS: list[tuple[str, threading.Thread]] = []


class RecordingTokenizer(TextTokenizer):
    """Records in CALLS the threads that encode and decode."""

    def encode(self, text: str, what: str = "text") -> list[int]:
        CALLS.append(("encode", threading.current_thread()))
        return super().encode(text, what)

    def decode(self, ids: Sequence[int]) -> str:
        CALLS.append(("decode", threading.current_thread()))
        return super().decode(ids)


def test_async_engine_tokenizes_and_decodes_off_the_engine_thread(expected) -> None:
    engine = bundled_engine()
    tok = engine.tokenizer
    recording = RecordingTokenizer(tok.tokenizer, tok.unk_id, tok.pad_ids, tok.max_model_len)
    engine.tokenizer = engine.core.tokenizer = recording
    CALLS.clear()

    async def run() -> threading.Thread:
        async with AsyncSpecEngine(engine) as aeng:
            out = await aeng.generate(SMALL, GREEDY, k=3)
            assert_same(out, expected)
            assert out.text == expected.text and out.text
            # With the engine thread held, prompts that cannot fit are still refused: by the
            # caller's own checks, and their slots are free at once.
            held, release = threading.Event(), threading.Event()
            blocker = asyncio.ensure_future(aeng.run_in_engine(
                lambda e: (held.set(), release.wait(WAIT_S))))
            assert await asyncio.to_thread(held.wait, WAIT_S)
            try:
                for prompt, why in [("1" * 1276, "has 1276 characters"),  # before tokenizing
                                    ("1" * 1275, "has 1275 tokens"),  # tokenized here
                                    (["x"] * 300, "has 300 tokens")]:  # length before types
                    with pytest.raises(ValueError, match=f"prompt 0 {why}; max_model_len"):
                        await asyncio.wait_for(aeng.generate(prompt, GREEDY), WAIT_S)
                assert aeng.num_unfinished == 0
            finally:
                release.set()
                await blocker
            return aeng.thread

    engine_thread = asyncio.run(run())
    calls = list(CALLS)
    kinds = [kind for kind, _ in calls]
    assert "encode" in kinds and "decode" in kinds
    assert all(thread is not engine_thread for _, thread in calls), calls
    assert all(thread.name.startswith("specengine-text") for _, thread in calls), calls
    # Closed, the engine decodes its own outputs again.
    assert engine.generate([SMALL], k=3, sampling=GREEDY)[0].text == expected.text
