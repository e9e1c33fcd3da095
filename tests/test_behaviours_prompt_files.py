"""Prompt files of ``specengine train-draft`` (``specengine.train.data``): what each format
yields, the chat rendering's transformers-compatible details, and the refusals' messages
naming the file, line or row at fault.

In-process and cheap: small files in ``tmp_path``, a model directory holding only the
arithmetic target's ``tokenizer.json`` and a ``tokenizer_config.json`` written per test.
"""

from __future__ import annotations

import json
import locale
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from specengine.assets import DEFAULT_TARGET
from specengine.tokenizer import load_tokenizer
from specengine.train.data import chat_template, read_prompts, render_chat, tokenize_prompts

USER = {"role": "user", "content": "12+3="}


def _model(tmp_path: Path, config: dict | None = None, post_bos: bool = False) -> Path:
    """A checkpoint without weights: the arithmetic target's vocabulary (digits, ``+*=;:QAP``,
    ``<pad>``, ``<eos>``), ``config`` as ``tokenizer_config.json``; ``post_bos``: a
    post-processor that puts ``<eos>`` before every text (as a BOS-adding tokenizer does)."""
    model = tmp_path / "model"
    model.mkdir()
    tok = json.loads((Path(DEFAULT_TARGET) / "tokenizer.json").read_text())
    if post_bos:
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<eos>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<eos>": {"id": "<eos>", "ids": [1], "tokens": ["<eos>"]}}}
    (model / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(Path(DEFAULT_TARGET) / "config.json", model)  # pad_token_id: <pad> is no unk
    if config is not None:
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def _ids(model: Path, text: str) -> list[int]:
    """``text``'s ids without any post-processor tokens (what a rendered chat must give)."""
    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    file = tmp_path / "p.jsonl"
    file.write_text("".join(line + "\n" for line in lines))
    return file


def _refused(file: Path, *match: str, column: str = "prompt") -> str:
    with pytest.raises(ValueError) as e:
        read_prompts(file, column)
    msg = str(e.value)
    assert all(m in msg for m in match), msg
    return msg


@pytest.fixture
def ascii_locale() -> Iterator[None]:
    """The process's text encoding is ASCII (the C locale without UTF-8 coercion), as on a
    host whose locale is not UTF-8."""
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, old)


# ---- reading -------------------------------------------------------------------------------


def test_prompt_file_of_plain_text_gives_one_prompt_per_non_blank_line(tmp_path: Path) -> None:
    file = tmp_path / "p.txt"
    file.write_text('Q:1+2=\n\n  \n{"prompt": "x"}\nQ:3*4=\n')
    assert read_prompts(file) == ["Q:1+2=", '{"prompt": "x"}', "Q:3*4="]


def test_prompt_file_jsonl_keeps_rows_after_a_blank_line(tmp_path: Path) -> None:
    file = _jsonl(tmp_path, '{"prompt": "Q:1="}', "", '{"prompt": "Q:2="}')
    assert read_prompts(file) == ["Q:1=", "Q:2="]


def test_prompt_file_single_message_is_a_one_message_chat(tmp_path: Path) -> None:
    file = _jsonl(tmp_path, json.dumps({"prompt": USER}), json.dumps({"messages": [USER]}))
    assert read_prompts(file) == [[USER], [USER]]


def test_prompt_file_text_is_utf8_whatever_the_locale(tmp_path: Path,
                                                      ascii_locale: None) -> None:
    for name, body in (("p.txt", "Q:é=\n"), ("p.jsonl", json.dumps({"prompt": "Q:é="},
                                                                      ensure_ascii=False))):
        file = tmp_path / name
        file.write_text(body + "\n", encoding="utf-8")
        assert read_prompts(file) == ["Q:é="]


@pytest.mark.parametrize("value, kind", [
    (5, "int"), ([], "list"), (None, "NoneType"),
    ([{"content": "x"}], "list"),                  # a message without a role
    ([{"role": "user"}], "list"),                  # ... without content
    ([{"role": 1, "content": "x"}], "list"),       # ... whose role is not a string
    ([USER, "12+3="], "list"),                     # a chat holding a non-message
])
def test_prompt_file_refuses_a_prompt_that_is_neither_text_nor_chat(
        tmp_path: Path, value: object, kind: str) -> None:
    file = _jsonl(tmp_path, '{"prompt": "Q:1="}', json.dumps({"prompt": value}))
    _refused(file, f"prompt file {file}, line 2: a prompt must be a string or a chat",
             f"messages), got {kind}")


def test_prompt_file_refusals_name_the_line(tmp_path: Path) -> None:
    ok = '{"prompt": "Q:1="}'
    file = _jsonl(tmp_path, ok, "", '{"prompt": ""}')
    _refused(file, f"prompt file {file}, line 3: empty prompt")
    file = _jsonl(tmp_path, ok, '{"messages": [{"role": "user"}]}')
    _refused(file, f"prompt file {file}, line 2: a prompt must be")
    file = _jsonl(tmp_path, ok, "{not json")
    _refused(file, f"prompt file {file}, line 2: not JSON (")
    file = _jsonl(tmp_path, ok, '["Q:1="]')
    _refused(file, f"prompt file {file}, line 2: expected a JSON object, got list")


def test_prompt_file_read_error_is_a_value_error_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "p.txt"
    file.write_text("Q:1=\n")

    def unreadable(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", unreadable)
    _refused(file, f"prompt file {file}: cannot read it (", "Permission denied")


def test_prompt_file_parquet_reads_only_the_prompt_column(tmp_path: Path) -> None:
    """An RL dataset's other columns (answers, metadata) are never decoded: one that is
    damaged does not stop the prompts from being read."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    file = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["Q:1+2=", "Q:3*4="], "extra": [7, 8]}), file,
                   compression="none")
    meta = pq.ParquetFile(file).metadata.row_group(0).column(1)
    with open(file, "r+b") as f:  # the extra column's page header, overwritten
        f.seek(meta.data_page_offset)
        f.write(b"\xff" * 8)
    with pytest.raises(Exception):  # noqa: B017, PT011 - pyarrow's own error: really damaged
        pq.read_table(file).column("extra").to_pylist()
    assert read_prompts(file) == ["Q:1+2=", "Q:3*4="]


def test_prompt_file_parquet_refusals_name_the_row_or_the_file(tmp_path: Path) -> None:
    """A corrupt file's message names it (pyarrow's own error, ArrowInvalid, is a ValueError
    and once escaped unwrapped)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    file = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["Q:1=", ""]}), file)
    _refused(file, f"prompt file {file}, row 1: empty prompt")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    _refused(broken, f"prompt file {broken}: not a readable Parquet file (")


def test_prompt_file_parquet_without_the_column_lists_the_columns(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    file = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["Q:1="], "id": [0]}), file)
    msg = _refused(file, column="prompt")
    assert msg == (f"prompt file {file}: no column 'prompt'; columns: ['question', 'id']; "
                   "choose one with --prompt-column")


def test_prompt_file_parquet_without_pyarrow_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "p.parquet"
    file.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails
    _refused(file, f"prompt file {file}: reading Parquet needs pyarrow (pip install pyarrow)")


# ---- the chat template -----------------------------------------------------------------------


def test_prompt_file_chat_template_jinja_file_comes_first(tmp_path: Path) -> None:
    model = _model(tmp_path, {"chat_template": "from the config"})
    (model / "chat_template.jinja").write_text("from the file é", encoding="utf-8")
    assert chat_template(model) == "from the file é"


def test_prompt_file_chat_template_is_utf8_whatever_the_locale(tmp_path: Path,
                                                               ascii_locale: None) -> None:
    model = _model(tmp_path, {"chat_template": "config é"})
    # json.dumps wrote "\u00e9": write the config's non-ASCII text as UTF-8 bytes instead
    cfg = model / "tokenizer_config.json"
    cfg.write_bytes(cfg.read_text(encoding="utf-8").replace("\\u00e9", "é").encode())
    assert chat_template(model) == "config é"
    (model / "chat_template.jinja").write_bytes("file é".encode())
    assert chat_template(model) == "file é"


def test_prompt_file_chat_template_default_of_a_named_list(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, "junk", {"name": "default", "template": "D"}]
    assert chat_template(_model(tmp_path, {"chat_template": named})) == "D"
    shutil.rmtree(tmp_path / "model")
    assert chat_template(_model(tmp_path, {"chat_template": named[:2]})) is None


def test_prompt_file_chat_template_none_when_config_has_no_usable_one(tmp_path: Path) -> None:
    for cfg in ({"chat_template": 5}, {"chat_template": {"default": "D"}}, [1, 2], {}):
        assert chat_template(_model(tmp_path, cfg)) is None, cfg
        shutil.rmtree(tmp_path / "model")
    assert chat_template(_model(tmp_path)) is None  # no tokenizer_config.json at all


def test_prompt_file_malformed_tokenizer_config_is_named(tmp_path: Path) -> None:
    model = _model(tmp_path)
    (model / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match=re.escape(f"{model / 'tokenizer_config.json'}: "
                                                   "cannot read it (")):
        chat_template(model)


# ---- rendering (transformers' environment) -----------------------------------------------------


def _render(template: str, messages: list | None = None, **special: str) -> str:
    return render_chat(template, [USER] if messages is None else messages, special)


def test_prompt_file_render_tojson_as_transformers_defines_it() -> None:
    """transformers' ``tojson``: non-ASCII kept, keys in order, no HTML escaping (jinja2's own
    filter sorts keys and escapes ``<``), and every ``json.dumps`` option passed on."""
    msg = [{"role": "user", "content": "é<b>"}]
    assert _render("{{ messages[0] | tojson }}", msg) == '{"role": "user", "content": "é<b>"}'
    assert _render("{{ messages[0].content | tojson(ensure_ascii=True) }}", msg) == \
        '"\\u00e9<b>"'
    assert _render("{{ messages[0] | tojson(indent=1) }}", msg) == \
        '{\n "role": "user",\n "content": "é<b>"\n}'
    assert _render("{{ messages[0] | tojson(separators=(',', ':')) }}", msg) == \
        '{"role":"user","content":"é<b>"}'
    assert _render("{{ messages[0] | tojson(sort_keys=True) }}", msg) == \
        '{"content": "é<b>", "role": "user"}'


def test_prompt_file_render_trims_and_strips_block_lines() -> None:
    template = "{% for m in messages %}\n  {% if m.role == 'user' %}\nQ:{{ m.content }}\n" \
               "  {% endif %}\n{% endfor %}\nA:"
    assert _render(template) == "Q:12+3=\nA:"


def test_prompt_file_render_has_loop_controls() -> None:
    msgs = [USER, {"role": "assistant", "content": "15"}, USER]
    assert _render("{% for m in messages %}{{ m.content }};{% if loop.index == 2 %}"
                   "{% break %}{% endif %}{% endfor %}", msgs) == "12+3=;15;"
    assert _render("{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}"
                   "{{ m.content }}{% endfor %}", msgs) == "15"


def test_prompt_file_render_raise_exception_message_reaches_the_user() -> None:
    with pytest.raises(ValueError, match=re.escape("the chat template failed on a prompt: "
                                                   "system role not supported")):
        _render("{{ raise_exception('system role not supported') }}")
    with pytest.raises(ValueError, match=re.escape("the chat template failed on a prompt: ")):
        _render("{% if %}")


def test_prompt_file_render_strftime_now() -> None:
    assert _render("{{ strftime_now('%%') }}") == "%"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", _render("{{ strftime_now('%Y-%m-%d') }}"))


def test_prompt_file_render_without_jinja2_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(ValueError, match=re.escape("chat prompts need jinja2 "
                                                   "(pip install jinja2)")):
        _render("x")


# ---- tokenizing -------------------------------------------------------------------------------


def test_prompt_file_chat_gets_no_post_processor_tokens_text_does(tmp_path: Path) -> None:
    """A rendered chat is tokenized without the tokenizer's BOS (the template writes its own
    special tokens); a text prompt as the engine tokenizes it (with them)."""
    model = _model(tmp_path, {"chat_template": "{% for m in messages %}Q:{{ m.content }}"
                                               "{% endfor %}A:"}, post_bos=True)
    tok = load_tokenizer(model)
    assert tok is not None and tok.encode("Q:1=") != _ids(model, "Q:1=")  # it adds a BOS
    got = tokenize_prompts(model, [[USER], "Q:1=", "Q:22="])
    assert got == [_ids(model, "Q:12+3=A:"), tok.encode("Q:1="), tok.encode("Q:22=")]


def test_prompt_file_special_tokens_of_the_config_are_template_variables(
        tmp_path: Path) -> None:
    """``eos_token`` given as a string or as an AddedToken dict (its ``content``)."""
    for eos in ("<eos>", {"content": "<eos>", "special": True, "lstrip": False}):
        model = _model(tmp_path, {"eos_token": eos, "pad_token": {"special": True},
                                  "chat_template": "Q:{{ messages[0].content }}{{ eos_token }}"
                                                   "{{ pad_token }}A:"})
        assert tokenize_prompts(model, [[USER]]) == [_ids(model, "Q:12+3=<eos>A:")]
        shutil.rmtree(model)


def test_prompt_file_text_prompts_need_no_chat_template(tmp_path: Path) -> None:
    model = _model(tmp_path)  # no tokenizer_config.json: no template
    tok = load_tokenizer(model)
    assert tok is not None
    assert tokenize_prompts(model, ["Q:1=", "Q:2="]) == [tok.encode("Q:1="), tok.encode("Q:2=")]
    with pytest.raises(ValueError) as e:
        tokenize_prompts(model, ["Q:1=", [USER]])
    assert str(e.value) == (
        f"{model}: chat prompts (messages) need a chat template, but the checkpoint has none "
        "(tokenizer_config.json chat_template or chat_template.jinja); give plain-text "
        "prompts instead")


def test_prompt_file_tokenize_refusals_name_the_prompt(tmp_path: Path) -> None:
    model = _model(tmp_path, {"chat_template": "{% if false %}x{% endif %}"})
    long = "Q:" + "1+" * 30 + "1="
    with pytest.raises(ValueError, match=rf"^prompt 1 has {len(long)} characters; "
                                         "max_model_len 4 "):
        tokenize_prompts(model, ["Q:1=", long], max_model_len=4)
    with pytest.raises(ValueError, match=r"^prompt 1 has a character outside the tokenizer"):
        tokenize_prompts(model, ["Q:1=", "Q:x="])
    with pytest.raises(ValueError, match=r"^prompt 1: its chat renders to no tokens$"):
        tokenize_prompts(model, ["Q:1=", [USER]])
    no_tok = tmp_path / "empty"
    no_tok.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{no_tok}: no tokenizer.json, so text "
                                                   "prompts cannot be tokenized")):
        tokenize_prompts(no_tok, ["Q:1="])
