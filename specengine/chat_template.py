"""A checkpoint's chat template, rendered as transformers' ``apply_chat_template`` renders it.

The template is the Jinja source in ``tokenizer_config.json``'s ``"chat_template"`` (a
string, or a list of ``{"name", "template"}`` of which ``"default"`` is used), overridden by
a ``chat_template.jinja`` file beside it (transformers writes the template there since 4.43
and reads that file first). It is rendered in jinja2's immutable sandbox (templates ship with
checkpoints, so they are untrusted code) with the environment transformers uses:
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that does not escape HTML (``json.dumps``), and the globals ``raise_exception`` (a template's
way to refuse a conversation), ``strftime_now`` and ``namespace``. The variables are the
messages, ``add_generation_prompt``, ``tools`` / ``documents`` when given, any extra
keyword arguments, and the tokenizer's special tokens by name (``bos_token``,
``eos_token``, ...), as ``special_tokens_map`` passes them. The rendered text is tokenized
without adding special tokens: the template writes them.

jinja2 is needed only to render (the server extra installs it); loading a checkpoint reads
the template's text alone.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "ChatTemplateError", "load_chat_template"]

# The special-token attributes transformers passes to every template (special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``) or failed on it."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may name."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    # the compiled template (a cache: built on first render, under the lock)
    _compiled: list[Any] = field(default_factory=list, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"a chat template must be non-empty text, got {self.source!r}")

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The conversation as text. ``kwargs`` are extra template variables (a caller's
        ``chat_template_kwargs``; they override the special tokens, as in transformers).
        Raises :class:`ChatTemplateError` with the template's message when it refuses the
        conversation or fails on it."""
        import jinja2

        template = self._template()
        # transformers drops None-valued keys (an API's content=None, tool_calls=None):
        # templates test for a key's presence, and would otherwise render "None".
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None})
                for m in messages]
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(messages=chat, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on the messages: "
                                    f"{type(exc).__name__}: {exc}") from None

    def _template(self) -> Any:
        with self._lock:
            if not self._compiled:
                self._compiled.append(_compile(self.source))
            return self._compiled[0]


# Names a message's reasoning comes under; templates read "reasoning_content" (gpt-oss's
# read "thinking"): transformers fills both from whichever is given.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's
        tokens with it (for its training masks); rendered, it is its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which a prompt must not get.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the checkpoint's chat template is not valid Jinja: {exc}") from None


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def load_chat_template(path: str | Path) -> ChatTemplate | None:
    """The chat template of the checkpoint directory ``path`` (None when it has none).
    Raises ``ValueError`` for a ``tokenizer_config.json`` that is not a JSON object or a
    template that is not text."""
    path = Path(path)
    cfg_file = path / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if cfg_file.is_file():
        config = json.loads(cfg_file.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{cfg_file} must hold a JSON object")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text()
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{cfg_file}: chat_template must be text, got {type(source).__name__}")
    special = {}
    map_file = path / "special_tokens_map.json"
    extra = json.loads(map_file.read_text()) if map_file.is_file() else {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name)) or _token_text(extra.get(name))
        if text is not None:
            special[name] = text
    return ChatTemplate(source, special)
