"""Turning a ``generate`` call's arguments into checked requests, before anything is scheduled
(so bad input raises and changes nothing). Text is encoded by :class:`TextTokenizer`
(``specengine.tokenizer``), which refuses characters the tokenizer cannot represent."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from specengine.config import MAX_K
from specengine.core.kv_cache import KVCache
from specengine.sampling import SamplingParams
from specengine.tokenizer import TextTokenizer, load_tokenizer
from specengine.tree import DraftTree, TreeChoice

__all__ = ["RequestBatch", "TextTokenizer", "chat_prompt_ids", "is_chat", "load_tokenizer",
           "prompt_ids", "validate_requests"]


@dataclass(frozen=True)
class RequestBatch:
    """A validated ``generate`` call: token ids and sampling parameters per prompt, the draft
    tree (None for a chain; a :class:`TreeChoice`: a head's greedy and sampled trees) and the
    draft length (a tree's depth when a tree is given; a choice's deeper one)."""

    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]
    tree: DraftTree | TreeChoice | None
    k: int

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.params):
            raise ValueError("one SamplingParams per prompt")

    def draft_of(self, params: SamplingParams) -> tuple[int, DraftTree | None]:
        """``(k, tree)`` of a request with ``params``: a choice's tree of its kind (greedy or
        sampled), verified at that tree's depth; else the call's own."""
        if isinstance(self.tree, TreeChoice):
            tree = self.tree.for_request(params.greedy)
            return tree.max_depth, tree
        return self.k, self.tree


def is_chat(prompt: object) -> bool:
    """Whether ``prompt`` is a chat conversation: a non-empty list of message mappings."""
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and all(isinstance(m, Mapping) for m in prompt))


def chat_prompt_ids(messages: Seq[Mapping[str, Any]], what: str,
                    tokenizer: TextTokenizer | None, **template_kwargs: Any) -> list[int]:
    """Token ids of a conversation rendered with the checkpoint's chat template, as
    transformers' ``apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`` gives them (the template writes the special tokens: none are added).
    ``template_kwargs`` are extra template variables (TRL's ``chat_template_kwargs``).
    Raises ``ValueError`` naming ``what`` and why: no tokenizer or template, a message
    without a string ``role``, an ``add_generation_prompt`` among ``template_kwargs`` (the
    call sets it), or the template's refusal (``ChatTemplateError``)."""
    if tokenizer is None:
        raise ValueError(f"{what} is a list of chat messages but the checkpoint has no "
                         "tokenizer.json: pass token ids")
    template = tokenizer.chat_template
    if template is None:
        raise ValueError(f"{what} is a list of chat messages but the checkpoint has no chat "
                         "template (tokenizer_config.json 'chat_template' or "
                         "chat_template.jinja): pass text or token ids")
    # The render's own argument: passed again it raised a TypeError from the call below.
    if "add_generation_prompt" in template_kwargs:
        raise ValueError(f"{what}: the chat template variable 'add_generation_prompt' is set "
                         "by the engine (a rollout prompt always ends with the generation "
                         "prompt): drop it")
    for j, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{what}: message {j} needs a string 'role', got {m!r}"[:300])
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"{what}: message {j}'s content must be text, a list of parts "
                             f"or None, got {type(content).__name__}")
    text = template.render([dict(m) for m in messages], add_generation_prompt=True,
                           **template_kwargs)
    return tokenizer.encode(text, what=f"{what} (rendered chat)", add_special_tokens=False)


def prompt_ids(prompt: object, index: int, tokenizer: TextTokenizer | None) -> list[int]:
    """Token ids of one prompt: a list of ints, a 1-D tensor, text (needs a tokenizer), or
    chat messages (a list of ``{"role", "content"}`` mappings, rendered with the checkpoint's
    chat template: :func:`chat_prompt_ids`)."""
    if is_chat(prompt):
        return chat_prompt_ids(prompt, f"prompt {index}", tokenizer)  # type: ignore[arg-type]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {index} is a string but the checkpoint has no "
                             "tokenizer.json: pass token ids")
        return tokenizer.encode(prompt, what=f"prompt {index}")
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise ValueError(f"prompt {index} must be a list of int token ids, a string or a list "
                         "of chat messages ({'role': ..., 'content': ...} dicts)")
    return list(prompt)


def validate_requests(
    batch: Seq[object],
    k: int,
    sampling: SamplingParams | Seq[SamplingParams] | None,
    tree: Seq[Seq[int]] | DraftTree | TreeChoice | None,
    *,
    tokenizer: TextTokenizer | None,
    vocab_size: int,
    max_model_len: int,
    kv_cache: KVCache,
    has_drafter: bool,
) -> RequestBatch:
    """Check the whole call: ``k`` in [0, MAX_K], prompts non-empty, in the vocabulary and
    shorter than ``max_model_len``, stop ids in the vocabulary, a prefix-closed tree whose
    depth agrees with ``k`` (a :class:`TreeChoice`: the deeper of its trees'), a drafter when
    ``k > 0``, and every request able to fit in the KV cache even alone. Raises ``ValueError``
    (or ``KVCacheFullError``) naming the bad part."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K:
        raise ValueError(f"k (draft length) must be an int in [0, {MAX_K}], got {k!r}")
    if isinstance(batch, (str, torch.Tensor)) or not isinstance(batch, Seq) or not batch:
        raise ValueError("batch must be a non-empty list of prompts")
    if is_chat(batch):
        raise ValueError("batch is one chat conversation (a list of messages): pass a list of "
                         "prompts, e.g. [messages]")
    prompts = [prompt_ids(p, i, tokenizer) for i, p in enumerate(batch)]
    if sampling is None:
        params = [SamplingParams()] * len(prompts)
    elif isinstance(sampling, SamplingParams):
        params = [sampling] * len(prompts)
    else:
        params = list(sampling)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams)
                                                  for p in params):
            raise ValueError(f"sampling must be one SamplingParams or one per prompt "
                             f"({len(prompts)}), got {len(params)}")
    draft_tree: DraftTree | TreeChoice | None = None
    if isinstance(tree, (DraftTree, TreeChoice)):
        draft_tree = tree  # a choice: each request verifies its kind's tree at its own depth
    elif tree is not None:
        if isinstance(tree, (str, bytes)) or not isinstance(tree, Seq):
            raise ValueError(f"tree must be a list of paths (lists of child ranks, e.g. "
                             f"[[0], [1], [0, 0]]), a DraftTree or, with a draft that ships "
                             f"trees, an int number of drafts; got {tree!r}"[:300])
        try:
            draft_tree = DraftTree(tree)
        except TypeError:
            raise ValueError(f"tree: each path must be a list of int ranks, got {tree!r}"[:300]
                             ) from None
    if draft_tree is not None:
        depth = draft_tree.max_depth
        if k not in (0, depth):
            where = (f"the depth {depth} of the draft's trees of {draft_tree.num_drafts} drafts"
                     if isinstance(draft_tree, TreeChoice) else f"the tree's depth {depth}")
            raise ValueError(f"k={k} disagrees with {where}; pass k=0 or the depth with a tree")
        k = depth
    if k > 0 and not has_drafter:
        raise ValueError(f"k={k} needs a drafter: construct the engine with draft=...")
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary "
                             f"[0, {vocab_size}): {bad[:5]}")
        if len(ids) >= max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len is "
                             f"{max_model_len}, which leaves no room to generate")
        bad_stop = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids of prompt {i} are outside the vocabulary: "
                             f"{bad_stop}")
        if sp.stop and tokenizer is None:
            raise ValueError(f"stop strings of prompt {i} need the checkpoint's tokenizer "
                             "(no tokenizer.json): pass stop_token_ids instead")
        need = min(len(ids) + sp.max_tokens, max_model_len) + k + 1
        if draft_tree is not None:
            need += draft_tree.num_nodes
        kv_cache.check_fits(need)
    return RequestBatch(tuple(tuple(p) for p in prompts), tuple(params), draft_tree, k)
