"""What ``generate`` accepts as a call, and the exact refusal of each bad part
(``specengine.core.requests``): every prompt form (token ids, a tensor, text, chat messages
rendered with the checkpoint's template), the sampling parameters per prompt, a tree given as
paths, and the message each refusal carries (the API's callers show it to users verbatim).

In-process, no engine: a real 32-block KV cache and the bundled arithmetic tokenizer (or a
copy whose post-processor adds a token, to see that a rendered chat adds none)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import specengine
from specengine.core.kv_cache import KVCache
from specengine.core.requests import (
    RequestBatch,
    chat_prompt_ids,
    is_chat,
    prompt_ids,
    validate_requests,
)
from specengine.sampling import SamplingParams
from specengine.tokenizer import TextTokenizer, load_tokenizer
from specengine.tree import DraftTree

pytest.importorskip("jinja2")

from specengine.chat_template import ChatTemplate  # noqa: E402

VOCAB = 20  # the arithmetic tokenizer's
ASSET = Path(specengine.__file__).parent / "assets" / "arith-target"
# Roles as letters of the vocabulary; string content only; the generation prompt and an extra
# template variable (``extra``) visible in the text.
TEMPLATE = ("{%- for m in messages -%}{{ 'Q' if m['role'] == 'user' else 'P' }}:"
            "{%- if m['content'] is string -%}{{ m['content'] }}{%- endif -%};{%- endfor -%}"
            "{%- if add_generation_prompt -%}A:{%- endif -%}{{ extra | default('') }}")


@pytest.fixture(scope="module")
def cache() -> KVCache:
    return KVCache(32, 16, 1, 1, 2, torch.float32, "cpu")  # room for max_tokens=256


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    """The arithmetic tokenizer with :data:`TEMPLATE` and a post-processor that adds ``<eos>``
    in front of every text it encodes with special tokens."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    base = load_tokenizer(ASSET)
    assert base is not None
    inner = Tokenizer.from_str(base.tokenizer.to_str())
    inner.post_processor = TemplateProcessing(single="<eos> $A", special_tokens=[("<eos>", 1)])
    return dataclasses.replace(base, tokenizer=inner, chat_template=ChatTemplate(TEMPLATE))


def plain(tok: TextTokenizer, text: str) -> list[int]:
    """``text``'s ids without special tokens."""
    return tok.encode(text, add_special_tokens=False)


def validate(batch, cache: KVCache, k: int = 0, sampling=None, tree=None,
             tokenizer: TextTokenizer | None = None) -> RequestBatch:
    return validate_requests(batch, k, sampling, tree, tokenizer=tokenizer, vocab_size=VOCAB,
                             max_model_len=1000, kv_cache=cache, has_drafter=True)


def refused(message: str):
    """The call must raise ``ValueError`` with exactly ``message``."""
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


# ---- chat messages ---------------------------------------------------------------------------

def test_chat_renders_with_the_template_and_adds_no_special_tokens(tok: TextTokenizer) -> None:
    """The rendered conversation (roles, content, the generation prompt) is tokenized as is:
    the tokenizer's post-processor adds nothing (the template writes its own tokens)."""
    assert tok.encode("1+2=")[0] == 1  # the post-processor does add <eos> to plain text
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert chat_prompt_ids(chat, "prompt 0", tok) == plain(tok, "Q:1+2=;P:3;A:")


def test_chat_template_variables_reach_the_template(tok: TextTokenizer) -> None:
    chat = [{"role": "user", "content": "7"}]
    assert chat_prompt_ids(chat, "p", tok, extra="99") == plain(tok, "Q:7;A:99")


def test_chat_generation_prompt_is_not_a_template_variable(tok: TextTokenizer) -> None:
    """A rollout prompt always ends with the generation prompt: a caller's
    ``add_generation_prompt`` (TRL's ``chat_template_kwargs``) is refused by name (it was a
    TypeError from inside the render before)."""
    with refused("p: the chat template variable 'add_generation_prompt' is set by the engine "
                 "(a rollout prompt always ends with the generation prompt): drop it"):
        chat_prompt_ids([{"role": "user", "content": "7"}], "p", tok, add_generation_prompt=False)


def test_chat_content_may_be_none_or_a_list_of_parts(tok: TextTokenizer) -> None:
    chat = [{"role": "user", "content": None}, {"role": "user", "content": [{"type": "text"}]},
            {"role": "user"}]
    assert chat_prompt_ids(chat, "p", tok) == plain(tok, "Q:;Q:;Q:;A:")


def test_chat_is_refused_without_a_tokenizer_or_a_template(tok: TextTokenizer) -> None:
    chat = [{"role": "user", "content": "1"}]
    with refused("prompt 2 is a list of chat messages but the checkpoint has no "
                 "tokenizer.json: pass token ids"):
        chat_prompt_ids(chat, "prompt 2", None)
    with refused("prompt 2 is a list of chat messages but the checkpoint has no chat template "
                 "(tokenizer_config.json 'chat_template' or chat_template.jinja): pass text "
                 "or token ids"):
        chat_prompt_ids(chat, "prompt 2", dataclasses.replace(tok, chat_template=None))


def test_chat_message_needs_a_string_role(tok: TextTokenizer) -> None:
    with refused("p: message 1 needs a string 'role', got {'role': 5}"):
        chat_prompt_ids([{"role": "user"}, {"role": 5}], "p", tok)
    # the message is cut to 300 characters (a message may be huge)
    long = {"content": "9" * 1000}
    with pytest.raises(ValueError) as err:
        chat_prompt_ids([long], "p", tok)
    assert str(err.value) == f"p: message 0 needs a string 'role', got {long!r}"[:300]


def test_chat_content_of_another_type_is_refused_by_its_type(tok: TextTokenizer) -> None:
    with refused("p: message 0's content must be text, a list of parts or None, got int"):
        chat_prompt_ids([{"role": "user", "content": 5}], "p", tok)


def test_a_rendered_chat_outside_the_vocabulary_names_the_prompt(cache: KVCache,
                                                                 tok: TextTokenizer) -> None:
    with pytest.raises(ValueError, match=r"^prompt 1 \(rendered chat\) has a character outside"):
        validate([[1, 2], [{"role": "user", "content": "hello"}]], cache, tokenizer=tok)


def test_is_chat_is_a_non_empty_list_of_mappings() -> None:
    assert is_chat([{"role": "user"}]) and is_chat(({"role": "user"},))
    assert not is_chat([]) and not is_chat([1, 2]) and not is_chat("hi")
    assert not is_chat([{"role": "user"}, [1]])


# ---- prompts ---------------------------------------------------------------------------------

def test_every_prompt_form_gives_its_token_ids(cache: KVCache, tok: TextTokenizer) -> None:
    """Ids, a tuple, a tensor, text and a conversation, side by side in one call."""
    chat = [{"role": "user", "content": "1+2="}]
    batch = validate([[3, 4], (5,), torch.tensor([6, 7, 8]), "1+2=", chat], cache,
                     tokenizer=tok)
    assert batch.prompts == ((3, 4), (5,), (6, 7, 8), tuple(tok.encode("1+2=", what="x")),
                             tuple(plain(tok, "Q:1+2=;A:")))
    assert prompt_ids(torch.tensor([9, 1]), 0, None) == [9, 1]


def test_text_prompt_needs_a_tokenizer() -> None:
    with refused("prompt 3 is a string but the checkpoint has no tokenizer.json: pass token "
                 "ids"):
        prompt_ids("1+2=", 3, None)


def test_a_prompt_of_another_kind_is_refused() -> None:
    with refused("prompt 1 must be a list of int token ids, a string or a list of chat "
                 "messages ({'role': ..., 'content': ...} dicts)"):
        prompt_ids([1.0, 2.0], 1, None)


def test_a_chat_prompt_is_refused_with_its_index(cache: KVCache, tok: TextTokenizer) -> None:
    with refused("prompt 1: message 0 needs a string 'role', got {'content': '1'}"):
        validate([[1], [{"content": "1"}]], cache, tokenizer=tok)
    with refused("prompt 0 is a list of chat messages but the checkpoint has no "
                 "tokenizer.json: pass token ids"):
        validate([[{"role": "user", "content": "1"}]], cache)


# ---- the batch -------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [[], (), "1+2=", torch.tensor([[1, 2]]), 5])
def test_batch_must_be_a_non_empty_list_of_prompts(cache: KVCache, tok: TextTokenizer,
                                                   batch) -> None:
    with refused("batch must be a non-empty list of prompts"):
        validate(batch, cache, tokenizer=tok)


def test_one_conversation_is_not_a_batch(cache: KVCache, tok: TextTokenizer) -> None:
    with refused("batch is one chat conversation (a list of messages): pass a list of "
                 "prompts, e.g. [messages]"):
        validate([{"role": "user", "content": "1"}], cache, tokenizer=tok)


def test_sampling_is_one_for_all_or_one_per_prompt(cache: KVCache) -> None:
    a, b = SamplingParams(max_tokens=3), SamplingParams(max_tokens=4, temperature=0.0)
    assert validate([[1], [2]], cache).params == (SamplingParams(), SamplingParams())
    assert validate([[1], [2]], cache, sampling=a).params == (a, a)
    assert validate([[1], [2]], cache, sampling=[b, a]).params == (b, a)
    assert validate([[1], [2]], cache, sampling=(a, b)).params == (a, b)
    with refused("sampling must be one SamplingParams or one per prompt (2), got 3"):
        validate([[1], [2]], cache, sampling=[a, a, a])
    with refused("sampling must be one SamplingParams or one per prompt (2), got 2"):
        validate([[1], [2]], cache, sampling=[a, {"max_tokens": 3}])


def test_tree_may_be_given_as_paths(cache: KVCache) -> None:
    batch = validate([[1]], cache, tree=[(0,), (1,), (0, 0)])
    assert isinstance(batch.tree, DraftTree) and batch.k == 2 and batch.tree.num_nodes == 4
    with refused("k=1 disagrees with the tree's depth 2; pass k=0 or the depth with a tree"):
        validate([[1]], cache, k=1, tree=[(0,), (0, 0)])


def test_empty_prompt_is_refused(cache: KVCache) -> None:
    with refused("prompt 1 is empty"):
        validate([[1], []], cache)


def test_out_of_vocabulary_ids_are_listed_five_at_most(cache: KVCache) -> None:
    with refused(f"prompt 0 has token ids outside the vocabulary [0, {VOCAB}): "
                 "[20, 21, 22, 23, 24]"):
        validate([[1, 20, 21, 22, 23, 24, 25]], cache)


def test_stop_strings_need_a_tokenizer(cache: KVCache, tok: TextTokenizer) -> None:
    sp = SamplingParams(stop=("=",))
    assert validate([[1]], cache, sampling=sp, tokenizer=tok).params == (sp,)
    with refused("stop strings of prompt 0 need the checkpoint's tokenizer (no tokenizer.json):"
                 " pass stop_token_ids instead"):
        validate([[1]], cache, sampling=sp)


def test_request_batch_needs_one_sampling_params_per_prompt() -> None:
    assert RequestBatch(((1,),), (SamplingParams(),), None, 0).k == 0
    with refused("one SamplingParams per prompt"):
        RequestBatch(((1,), (2,)), (SamplingParams(),), None, 0)
