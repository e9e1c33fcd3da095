"""Prompt files for ``specengine train-draft``: read, render and tokenize.

Formats, by extension:

* ``.jsonl``: one JSON object per line with a prompt column (``--prompt-column``, default
  ``prompt``) holding a string or a chat (a list of ``{"role", "content"}`` messages), or a
  ``messages`` chat when the object has no prompt column;
* ``.parquet`` (the RL datasets' usual format, e.g. verl's DAPO files, whose ``prompt``
  column is a chat): the prompt column, strings or chats (needs ``pyarrow``);
* anything else: plain text, one prompt per line (blank lines skipped).

A chat is rendered with the checkpoint's chat template as ``transformers``'
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` renders it
(jinja2 sandbox with ``trim_blocks`` / ``lstrip_blocks``, the tokenizer config's special
tokens as variables) and tokenized without special tokens (the template writes them); plain
text is tokenized as the engine tokenizes text prompts (``specengine.tokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from specengine.tokenizer import TextTokenizer, load_tokenizer

DEFAULT_PROMPT_COLUMN = "prompt"
Prompt = str | list[dict[str, Any]]  # text, or a chat's messages


def read_prompts(path: str | Path, prompt_column: str = DEFAULT_PROMPT_COLUMN) -> list[Prompt]:
    """The prompts of ``path`` (module docstring); ``ValueError`` for a file that is missing,
    unreadable, empty, malformed or without the prompt column."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            prompts = _read_parquet(path, prompt_column)
        else:
            text = path.read_text(encoding="utf-8")
            prompts = (_read_jsonl(path, text, prompt_column) if suffix == ".jsonl"
                       else [line for line in text.splitlines() if line.strip()])
    except OSError as e:
        raise ValueError(f"prompt file {path}: cannot read it ({e})") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path}: not UTF-8 text ({e})") from e
    if not prompts:
        raise ValueError(f"prompt file {path}: no prompts in it (empty file)")
    return prompts


def _check_prompt(value: object, where: str) -> Prompt:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: empty prompt")
        return value
    if isinstance(value, dict):  # a single message
        value = [value]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in value):
        return [dict(m) for m in value]
    raise ValueError(f"{where}: a prompt must be a string or a chat (a non-empty list of "
                     f"{{'role', 'content'}} messages), got {type(value).__name__}")


def _read_jsonl(path: Path, text: str, column: str) -> list[Prompt]:
    out: list[Prompt] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"prompt file {path}, line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if column in row:
            out.append(_check_prompt(row[column], where))
        elif "messages" in row:
            out.append(_check_prompt(row["messages"], where))
        else:
            raise ValueError(f"{where}: no {column!r} field (nor 'messages'); fields: "
                             f"{sorted(row)}; choose one with --prompt-column")
    return out


def _read_parquet(path: Path, column: str) -> list[Prompt]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"prompt file {path}: reading Parquet needs pyarrow "
                         f"(pip install pyarrow): {e}") from None
    # pyarrow's errors for a corrupt file include ArrowInvalid, a ValueError: every one is
    # wrapped to name the file, and the missing column is refused outside the try
    try:
        names = pq.read_schema(path).names
        values = (pq.read_table(path, columns=[column]).column(column).to_pylist()
                  if column in names else None)
    except Exception as e:  # noqa: BLE001 - pyarrow's own errors for a corrupt file
        raise ValueError(f"prompt file {path}: not a readable Parquet file ({e})") from None
    if values is None:
        raise ValueError(f"prompt file {path}: no column {column!r}; columns: {names}; "
                         "choose one with --prompt-column")
    return [_check_prompt(v, f"prompt file {path}, row {i}") for i, v in enumerate(values)]


def chat_template(model: str | Path) -> str | None:
    """The checkpoint's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``, the ``default`` one of a named list)."""
    model = Path(model)
    jinja = model / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = _tokenizer_config(model)
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def _tokenizer_config(model: Path) -> dict[str, Any]:
    file = model / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read it ({e})") from e
    return cfg if isinstance(cfg, dict) else {}


def render_chat(template: str, messages: list[dict[str, Any]],
                special_tokens: dict[str, str]) -> str:
    """``messages`` through ``template`` with the generation prompt, as transformers renders
    it (an immutable jinja2 sandbox, ``trim_blocks`` / ``lstrip_blocks``, loop controls,
    ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII text)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ValueError(f"chat prompts need jinja2 (pip install jinja2): {e}") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                **special_tokens)
    except TemplateError as e:
        raise ValueError(f"the chat template failed on a prompt: {e}") from None


def _special_tokens(model: Path) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` / ... of the tokenizer config as strings (the template's
    variables; an AddedToken dict gives its ``content``)."""
    out = {}
    for key, value in _tokenizer_config(model).items():
        if key.endswith("_token"):
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out


def tokenize_prompts(model: str | Path, prompts: Iterable[Prompt],
                     max_model_len: int | None = None) -> list[list[int]]:
    """Token ids of every prompt (module docstring); ``ValueError`` names the prompt that
    cannot be tokenized, or the missing tokenizer / chat template."""
    model = Path(model)
    prompts = list(prompts)
    tok: TextTokenizer | None = load_tokenizer(model, max_model_len)
    if tok is None:
        raise ValueError(f"{model}: no tokenizer.json, so text prompts cannot be tokenized")
    template = special = None
    if any(not isinstance(p, str) for p in prompts):
        template = chat_template(model)
        if template is None:
            raise ValueError(f"{model}: chat prompts (messages) need a chat template, but the "
                             "checkpoint has none (tokenizer_config.json chat_template or "
                             "chat_template.jinja); give plain-text prompts instead")
        special = _special_tokens(model)
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(tok.encode(p, what=f"prompt {i}"))
            continue
        text = render_chat(template, p, special)  # type: ignore[arg-type]
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise ValueError(f"prompt {i}: its chat renders to no tokens")
        out.append(list(ids))
    return out
