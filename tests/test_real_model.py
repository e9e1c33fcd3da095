"""A real published model: SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, tied embeddings,
vocabulary 49152, ChatML template), as ``specengine build-model smollm2`` builds it.

* greedy decoding equals transformers' over 8 prompts (4 chat-templated, 4 plain), 64 tokens
  each, logprobs within 1e-4 in fp32;
* the chat template renders (and tokenizes) exactly as transformers' ``apply_chat_template``;
* ``specengine serve --model DIR --draft suffix`` (the README's line) answers a chat
  completion of the ``openai`` client with the engine's own k=0 greedy answer;
* every drafter that can run on this model gives k=0's output at k=3, and drafts are
  accepted where acceptance is predictable (a drafter's own earlier completion, the model
  drafting for itself).

Skipped, with the command to run, when the checkpoint is not built (.ci/run builds it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from specengine import SamplingParams, SpecEngine
from specengine.assets.smollm2 import DIR_NAME, INSTALL_HINT, check_build, default_cache_dir

pytestmark = pytest.mark.real_model
transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
]
PLAIN = ["The quick brown fox", "def fibonacci(n):\n", "1, 2, 3, 4, 5,",
         "Once upon a time, in a small village"]
NUM_NEW = 64
ENGINE_KW = dict(device="cpu", dtype="float32", kernel_backend="torch", max_model_len=512,
                 kv_cache_tokens=4096, max_batch_size=16)
WAIT_S = 120.0


@pytest.fixture(scope="module")
def ckpt() -> Path:
    path = default_cache_dir() / DIR_NAME
    why = check_build(path)
    if why is not None:
        pytest.skip(f"the SmolLM2-135M-Instruct checkpoint is not built ({why}): "
                    f"{INSTALL_HINT}, then specengine build-model smollm2")
    return path


@pytest.fixture(scope="module")
def hf_tok(ckpt: Path):
    return transformers.AutoTokenizer.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> SpecEngine:
    return SpecEngine(ckpt, **ENGINE_KW)


@pytest.fixture(scope="module")
def prompts(hf_tok) -> list[list[int]]:
    """4 chat-templated prompts (transformers' rendering and tokens), then 4 plain ones."""
    chats = [list(hf_tok.apply_chat_template(m, add_generation_prompt=True,
                                             tokenize=True)["input_ids"]) for m in CHATS]
    return chats + [hf_tok(p)["input_ids"] for p in PLAIN]


def test_greedy_matches_transformers(ckpt: Path, engine: SpecEngine, prompts) -> None:
    # Teacher-forced: one transformers pass over each prompt + the engine's 64 tokens; each
    # token must be transformers' argmax after the tokens before it (so its greedy decoding
    # is the same sequence) with the same log-probability. ignore_eos: all 64 are compared
    # (the chat answers end early otherwise).
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = engine.generate(prompts, k=0, sampling=greedy)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    hf.eval()
    for i, (ids, out) in enumerate(zip(prompts, outs)):
        assert out.prompt_token_ids == tuple(ids) and len(out.token_ids) == NUM_NEW
        with torch.no_grad():
            logits = hf(torch.tensor([ids + list(out.token_ids)])).logits[0].float()
        logp = torch.log_softmax(logits[len(ids) - 1:-1], -1)
        ref_tokens = logp.argmax(-1).tolist()
        assert list(out.token_ids) == ref_tokens, f"prompt {i}"
        ref = logp[torch.arange(NUM_NEW), torch.tensor(ref_tokens)].tolist()
        assert out.logprobs == pytest.approx(ref, abs=1e-4), f"prompt {i}"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_text_prompts_tokenize_as_transformers(engine: SpecEngine, prompts) -> None:
    outs = engine.generate(PLAIN, k=0, sampling=SamplingParams(temperature=0.0, max_tokens=1))
    assert [list(o.prompt_token_ids) for o in outs] == prompts[len(CHATS):]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(engine: SpecEngine, hf_tok,
                                               add_generation_prompt: bool) -> None:
    template = engine.tokenizer.chat_template
    assert template is not None
    conversations = [*CHATS, [{"role": "system", "content": "Answer in French."},
                              {"role": "user", "content": "Hello"},
                              {"role": "assistant", "content": "Bonjour !"},
                              {"role": "user", "content": "Ça va ?\nEt toi ?"}]]
    for messages in conversations:
        want = hf_tok.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        got = template.render(messages, add_generation_prompt=add_generation_prompt)
        assert got == want
        want_ids = hf_tok.apply_chat_template(messages, tokenize=True,
                                              add_generation_prompt=add_generation_prompt)
        assert engine.tokenizer.encode(got, add_special_tokens=False) == list(
            want_ids["input_ids"])
    # The template writes a default system turn when the conversation has none.
    assert "named SmolLM" in template.render(CHATS[0])
    assert "named SmolLM" not in template.render(CHATS[1])


def test_serve_answers_an_openai_chat_completion(ckpt: Path, engine: SpecEngine,
                                                 hf_tok) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from net_helpers import free_port

    messages = CHATS[0]
    ids = list(hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                          tokenize=True)["input_ids"])
    want = engine.generate([ids], k=0, sampling=SamplingParams(temperature=0.0,
                                                               max_tokens=32))[0]
    assert want.finish_reason == "stop"  # the answer ends with <|im_end|> within 32 tokens
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specengine.cli", "serve", "--model", str(ckpt), "--port",
         str(port), "--draft", "suffix", "--device", "cpu", "--kernel-backend", "torch",
         "--kv-cache-tokens", "2048", "--max-model-len", "512", "--shutdown-timeout", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    watchdog = threading.Timer(WAIT_S, proc.kill)  # a hung server fails the test, not CI
    watchdog.start()
    log: list[str] = []
    try:
        for raw in proc.stderr:
            log.append(raw.decode())
            if "Uvicorn running on" in log[-1]:
                break
        else:
            raise AssertionError("server exited before listening:\n" + "".join(log))
        assert not any(line.startswith("note:") for line in log), log  # drafting: k=3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=WAIT_S, max_retries=0)
        (model,) = [m.id for m in client.models.list().data]
        assert model == ckpt.name
        got = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                             max_tokens=32)
        (choice,) = got.choices
        assert choice.message.role == "assistant"
        assert choice.message.content == want.text and choice.finish_reason == "stop"
        assert got.usage.prompt_tokens == len(ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read().decode()
        assert proc.wait(WAIT_S) == 0, "".join(log) + rest
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


# ---- every drafter: k=3 gives k=0's output -------------------------------------------------
DRAFTERS = ["ngram", "suffix", "hybrid", "small_lm", "eagle3", "mtp"]
DRAFT_PROMPTS = (0, 3, 4, 6)  # two chat, two plain
DRAFT_PARAMS = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def draft_base(engine: SpecEngine, prompts) -> list:
    chosen = [prompts[i] for i in DRAFT_PROMPTS]
    return chosen, engine.generate(chosen, k=0, sampling=DRAFT_PARAMS)


def _draft_arg(name: str, ckpt: Path, tmp_path: Path) -> object:
    if name in ("ngram", "suffix"):
        return name
    if name == "hybrid":
        return ("ngram", "suffix")
    if name == "small_lm":
        return str(ckpt)  # the model drafts for itself: greedy, it must be accepted
    if name == "eagle3":  # a random head of the right shapes: lossless, however poor
        from eagle_heads import head_tensors, save_head

        # A draft vocabulary of the first 4096 tokens (a range: cheap membership) keeps
        # the head's LM head small.
        cfg, tensors = head_tensors(ckpt, aux_ids=(2, 14, 27), dropped=range(4096, 49152))
        return str(save_head(tmp_path / "eagle3", cfg, tensors))
    raise AssertionError(name)


def _assert_same(outs: list, base: list, label: str) -> None:
    for i, (o, b) in enumerate(zip(outs, base)):
        assert o.token_ids == b.token_ids, f"{label}: prompt {i} differs from k=0"
        assert o.finish_reason == b.finish_reason, f"{label}: prompt {i}"
        assert o.logprobs == pytest.approx(b.logprobs, abs=1e-4), f"{label}: prompt {i}"


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_gives_k0s_output(name: str, ckpt: Path, draft_base,
                                        tmp_path: Path) -> None:
    if name == "mtp":
        pytest.skip("SmolLM2 has no MTP layers (the 'mtp' drafter reads a checkpoint's own)")
    chosen, base = draft_base
    with SpecEngine(ckpt, draft=_draft_arg(name, ckpt, tmp_path), **ENGINE_KW) as eng:
        _assert_same(eng.generate(chosen, k=3, sampling=DRAFT_PARAMS), base, f"{name} k=3")
        st = eng.stats
        assert st.num_draft_tokens > 0, f"{name}: nothing was drafted"
        rate = st.num_accepted_tokens / st.num_draft_tokens
        if name == "small_lm":
            assert rate >= 0.95, f"the model drafting for itself: acceptance {rate:.3f}"
        if name == "ngram":
            assert st.num_accepted_tokens > 0
        if name in ("suffix", "hybrid"):
            # Again: each prompt's earlier completion is indexed, so it is drafted whole.
            _assert_same(eng.generate(chosen, k=3, sampling=DRAFT_PARAMS), base,
                         f"{name} k=3, again")
            # (The suffix drafter lengthens its drafts as a match proves itself, so a repeat
            # drafts 1-2 tokens a step at first: most accepted, not all.)
            again = eng.stats
            assert again.num_accepted_tokens >= 0.5 * again.num_draft_tokens > 0
            assert again.mean_accepted_length >= 1.5
        assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks


def test_eval_draft_head_compares_sampled_and_argmax_drafts(ckpt: Path, tmp_path: Path) -> None:
    """``benchmarks/eval_draft_head.py``: the two prompt sets share no problem; greedy rows
    are identical to k=0 and the same whether the head samples its drafts or not (sampling
    them only changes what sampled requests are proposed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import eval_draft_head as edh

    sets = list(edh.prompt_sets(16).values())
    assert len(sets[0]) == len(sets[1]) == 16 and not {str(p) for p in sets[0]} & {
        str(p) for p in sets[1]}
    head = Path(_draft_arg("eagle3", ckpt, tmp_path))
    runs = {}
    for point_mass in (False, True):
        out = tmp_path / f"{point_mass}.json"
        argv = ["--model", str(ckpt), "--head", str(head), "--num-prompts", "1",
                "--max-tokens", "4", "--threads", "1", "--json", str(out)]
        assert edh.main(argv + (["--point-mass"] if point_mass else [])) == 0
        runs[point_mass] = json.loads(out.read_text())["sets"]
    for name, ev in runs[False].items():
        greedy, other = ev["by_temperature"]["0"], runs[True][name]["by_temperature"]["0"]
        assert [r["identical_to_k0"] for r in greedy.values()] == [1] * 5
        assert greedy == other
        assert ev["by_temperature"]["1"].keys() == greedy.keys()
