"""Output text with a byte-level tokenizer (issue 37): every other test tokenizer is ASCII, so
a multi-byte character split over tokens was never seen by the stop-string scan, the streamed
text of either HTTP dialect, or ``min_tokens``' boundary.

- ``StopStrings`` (detokenization + stop scan): a character cut between tokens never shows as
  U+FFFD, a multi-byte stop string split over tokens is found where it completes, and a stop
  string counts only after the text of the first ``min_tokens`` tokens (not one token early
  or late);
- a tiny random model whose vocabulary is bytes of "é" and "中" plus ASCII streams, through
  OpenAI's ``/v1/completions`` and SGLang's ``/generate``, text whose chunks join to exactly
  the non-streamed answer (a chunk may not hand out half a character);
- the real SmolLM2 tokenizer (only the tokenizer; skipped when the checkpoint is not built),
  whose BPE splits emoji and CJK into byte tokens, through the same detokenizers.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specengine import SamplingParams
from specengine.core.stop_strings import StopStrings
from specengine.tokenizer import TextTokenizer, load_tokenizer

# The byte-level vocabulary: ASCII letters, space, and the bytes of é (C3 A9) and 中 (E4 B8 AD).
_BYTES = [ord(c) for c in "ab c"] + [0xC3, 0xA9, 0xE4, 0xB8, 0xAD]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a ByteLevel vocabulary is written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer() -> Tokenizer:
    """One token per byte of ``_BYTES`` (id = index), ByteLevel decoding (as GPT-2, Llama 3,
    Qwen and SmolLM2 decode)."""
    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: i for i, b in enumerate(_BYTES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def ids_of(text: str) -> list[int]:
    return [_BYTES.index(b) for b in text.encode()]


def scan(text_ids: list[int], **params: Any) -> StopStrings:
    ss = StopStrings(SamplingParams(max_tokens=64, **params), TextTokenizer(byte_tokenizer()))
    for i in range(1, len(text_ids) + 1):  # one token per step, as a k = 0 run feeds it
        if ss.feed(text_ids[:i]) is not None:
            break
        assert "\ufffd" not in ss.text  # a character is shown only once whole
    return ss


# ---- StopStrings ---------------------------------------------------------------------------
def _incremental_text(tok: TextTokenizer) -> Any:
    """The server's streaming detokenizer (``specengine.server`` needs FastAPI: without it
    these tests skip, as the server's own do)."""
    pytest.importorskip("fastapi")
    from specengine.server.openai_api import IncrementalText

    return IncrementalText(tok, skip_special_tokens=True)


def test_split_characters_decode_whole() -> None:
    text = "aé中b中é c"
    ss = scan(ids_of(text))
    assert ss.match is None and ss.text == text and ss.num_seen == len(text.encode())


@pytest.mark.parametrize("stop", ["中", "é中", "中b"])
def test_multibyte_stop_string_split_over_tokens_is_found_where_it_completes(stop: str
                                                                              ) -> None:
    text = "aé中b c"
    ids = ids_of(text)
    ss = scan(ids, stop=[stop])
    at = text.index(stop)
    end_tokens = len(text[:at + len(stop)].encode())  # the token that completes the string
    assert ss.match == (end_tokens, stop, text[:at])
    with_str = scan(ids, stop=[stop], include_stop_str_in_output=True)
    assert with_str.match == (end_tokens, stop, text[:at + len(stop)])


@pytest.mark.parametrize("min_tokens", [0, 2, 4, 5, 8, 9])
def test_min_tokens_boundary_against_stop_strings(min_tokens: int) -> None:
    """``ab中c中`` with stop "中" (tokens 3..5 and 7..9): a stop string must begin after the
    text of the first ``min_tokens`` tokens. A cut character has no text until its last byte,
    so the first 中 is the text of token 5: it stops for min_tokens <= 4; from 5 on only the
    second (token 9) may stop, and from 9 on nothing."""
    ids = ids_of("ab中c中")
    ss = scan(ids, stop=["中"], min_tokens=min_tokens)
    want = (5, "中", "ab") if min_tokens <= 4 else (9, "中", "ab中c") if min_tokens < 9 else None
    assert ss.match == want


def test_min_tokens_ascii_boundary() -> None:
    ids = ids_of("abcab")
    for m, want in [(0, (2, "b", "a")), (1, (2, "b", "a")), (2, (5, "b", "abca")),
                    (4, (5, "b", "abca")), (5, None)]:
        assert scan(ids, stop=["b"], min_tokens=m).match == want, m


def test_stop_string_completed_by_the_first_output_token() -> None:
    ids = ids_of("abcab")
    assert scan(ids, stop=["a"]).match == (1, "a", "")
    assert scan(ids, stop=["ab"]).match == (2, "ab", "")
    assert scan(ids, stop=["a"], include_stop_str_in_output=True).match == (1, "a", "a")


def test_tokens_fed_at_once_stop_where_one_at_a_time_stops() -> None:
    """A speculative step hands several tokens to one ``feed``: the match (and the text) is
    the one a k = 0 run (one token per feed) finds, across min_tokens and cut characters."""
    cases = [("abcab", ["c"], 1), ("abcab", ["ca"], 1), ("abcab", ["ca"], 2), ("aé中b c", ["b"], 0),
             ("aé中b c", [" c"], 3), ("ab中c中", ["中"], 5), ("abcabc", ["bc"], 0)]
    for text, stop, min_tokens in cases:
        ids = ids_of(text)
        one = scan(ids, stop=stop, min_tokens=min_tokens).match
        assert one is not None, (text, stop, min_tokens)
        at_once = StopStrings(SamplingParams(max_tokens=64, stop=stop, min_tokens=min_tokens),
                              TextTokenizer(byte_tokenizer()))
        assert at_once.feed(ids) == one, (text, stop, min_tokens)
        halves = StopStrings(SamplingParams(max_tokens=64, stop=stop, min_tokens=min_tokens),
                             TextTokenizer(byte_tokenizer()))
        assert (halves.feed(ids[: len(ids) // 2]) or halves.feed(ids)) == one


def test_a_stop_string_spanning_tokens_after_min_tokens() -> None:
    """Fed one token at a time, a stop string that began in an earlier token (after the
    first min_tokens) is found when its last token arrives."""
    ids = ids_of("abcab")
    assert scan(ids, stop=["ca"], min_tokens=1).match == (4, "ca", "ab")
    assert scan(ids, stop=["ca"], min_tokens=2).match == (4, "ca", "ab")
    assert scan(ids, stop=["ca"], min_tokens=3).match is None  # "c" is token 3's text


def metaspace_tokenizer() -> TextTokenizer:
    """SentencePiece-style words: "▁b" is " b" inside a text, "b" at its start (the decoder
    drops a text's leading space), so a token decoded alone loses the space it carries;
    "<s>" is special (decoded to nothing), "xyxy" one token holding a stop string twice."""
    tok = Tokenizer(models.WordLevel(vocab={"▁a": 0, "▁b": 1, "c": 2, "[UNK]": 3, "<s>": 4,
                                            "xyxy": 5}, unk_token="[UNK]"))
    tok.add_special_tokens(["<s>"])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return TextTokenizer(tok)


def test_a_token_holding_the_stop_string_twice_is_cut_at_the_first() -> None:
    tok = metaspace_tokenizer()
    ss = StopStrings(SamplingParams(max_tokens=8, stop=["xy"]), tok)
    assert ss.feed([0, 5, 1]) == (2, "xy", "a")
    ss = StopStrings(SamplingParams(max_tokens=8, stop=["xy"], include_stop_str_in_output=True),
                     tok)
    assert ss.feed([0, 5]) == (2, "xy", "axy")


def test_a_token_without_text_keeps_the_next_words_space() -> None:
    tok = metaspace_tokenizer()
    ids = [0, 4, 1, 4, 4, 2, 1]
    assert tok.decode(ids) == "a bc b"
    ss = StopStrings(SamplingParams(max_tokens=8, stop=["zz"]), tok)
    for i in range(1, len(ids) + 1):
        assert ss.feed(ids[:i]) is None and ss.text == tok.decode(ids[:i]), i


def test_word_start_spaces_survive_the_incremental_decode() -> None:
    tok = metaspace_tokenizer()
    ids = [0, 1, 2, 1, 0]
    assert tok.decode(ids) == "a bc b a"
    ss = StopStrings(SamplingParams(max_tokens=8, stop=["zz"]), tok)
    for i in range(1, len(ids) + 1):
        assert ss.feed(ids[:i]) is None
        assert ss.text == tok.decode(ids[:i])
    ss = StopStrings(SamplingParams(max_tokens=8, stop=["c b"]), tok)
    assert ss.feed(ids) == (4, "c b", "a b")
    inc = _incremental_text(tok)
    assert "".join(inc.push([t]) for t in ids) == "a bc b a"


# ---- the real model's tokenizer (SmolLM2, byte-level BPE) ----------------------------------
SMOL = Path.home() / ".cache" / "specengine" / "smollm2-135m-instruct"
MIXED = "Café ☕ 中文 naïve 🙂🚀 end"


@pytest.fixture(scope="module")
def smol() -> TextTokenizer:
    tok = load_tokenizer(SMOL) if (SMOL / "tokenizer.json").exists() else None
    if tok is None:
        pytest.skip(f"no SmolLM2 tokenizer at {SMOL} (specengine build-model smollm2)")
    return tok


def test_real_tokenizer_streams_and_stops_on_split_characters(smol: TextTokenizer) -> None:
    ids = smol.encode(MIXED, add_special_tokens=False)
    pieces = [smol.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # some character is split over tokens
    inc = _incremental_text(smol)
    deltas = [inc.push([t]) for t in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + inc.finish(smol.decode(ids)) == MIXED
    for stop in ("🚀", "中文", "ï"):
        ss = StopStrings(SamplingParams(max_tokens=64, stop=[stop]), smol)
        for i in range(1, len(ids) + 1):
            if ss.feed(ids[:i]):
                break
        keep, got, text = ss.match
        assert got == stop and text == MIXED[:MIXED.index(stop)]
        assert stop in smol.decode(ids[:keep]) and stop not in smol.decode(ids[:keep - 1])


# ---- both HTTP dialects on a byte-level model --------------------------------------------
@pytest.fixture(scope="module")
def byte_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from checkpoints import make_hf_model, save_checkpoint
    from server_helpers import running_server

    from specengine import AsyncSpecEngine, SpecEngine

    path = save_checkpoint(make_hf_model("qwen3", vocab_size=len(_BYTES), seed=3),
                           tmp_path_factory.mktemp("byte_model"))
    byte_tokenizer().save(str(path / "tokenizer.json"))
    eng = AsyncSpecEngine(SpecEngine(path, device="cpu", dtype="float32", max_model_len=128,
                                     kv_cache_tokens=2048, kernel_backend="torch"))
    try:
        with running_server(eng, default_k=0) as (srv, _):
            yield srv.port
    finally:
        asyncio.run(eng.close())


def _events(port: int, path: str, body: dict[str, Any]) -> list[Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200, raw
        if not body.get("stream"):
            return [json.loads(raw)]
        out = []
        for block in raw.decode().split("\n\n"):
            if block.startswith("data: ") and block != "data: [DONE]":
                out.append(json.loads(block.removeprefix("data: ")))
        return out
    finally:
        conn.close()


def _splits_a_character(ids: list[int]) -> bool:
    return any(a == 4 and b == 5 for a, b in zip(ids, ids[1:]))  # C3 then A9: "é" in 2 tokens


SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 48, "ignore_eos": True}


def test_openai_stream_joins_to_the_answer_on_split_characters(byte_server: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", byte_server, timeout=60)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    body = {"model": model, "prompt": "ab 中", "n": 2, **SAMPLED}
    answer = _events(byte_server, "/v1/completions", body)[0]
    texts = {c["index"]: c["text"] for c in answer["choices"]}
    assert any("é" in t or "中" in t for t in texts.values())  # the case this test is about
    chunks = _events(byte_server, "/v1/completions", {**body, "stream": True})
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
            assert texts[c["index"]].startswith(streamed[c["index"]])  # never half a char
    assert streamed == texts


def test_sglang_stream_joins_to_the_answer_on_split_characters(byte_server: int) -> None:
    sp = {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True, "n": 2,
          "sampling_seed": 7}
    body = {"text": ["ab 中", "é c"], "sampling_params": sp}
    answer = _events(byte_server, "/generate", body)[0]
    assert any(_splits_a_character(a["output_ids"]) for a in answer)
    chunks = _events(byte_server, "/generate", {**body, "stream": True})
    last: dict[int, dict[str, Any]] = {}
    for c in chunks:
        i = c["index"]
        assert answer[i]["text"].startswith(c["text"])  # cumulative text: never half a char
        last[i] = c
    assert sorted(last) == list(range(4))
    for i, a in enumerate(answer):
        assert last[i]["text"] == a["text"] and last[i]["output_ids"] == a["output_ids"]
