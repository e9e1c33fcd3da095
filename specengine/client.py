"""A small synchronous client of the rollout server (``specengine serve``) for learners and
agent loops; standard library only (``urllib``), safe to share between threads (each call
opens its own connection).

    client = SpecEngineClient("http://127.0.0.1:8000")
    out = client.generate("Q:472*6=", {"temperature": 0.0, "max_tokens": 48})
    for step in client.generate_stream([17, 16, 5, 10], {"temperature": 0.0}):
        print(step.new_token_ids)

``generate`` returns a :class:`~specengine.outputs.GenerationOutput` and ``generate_stream``
yields :class:`~specengine.outputs.RequestOutput` s, the engine's own classes, rebuilt from
the server's JSON. A refused call raises :class:`ServerError` with the status code and the
server's message.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

from specengine.outputs import GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams

_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationOutput))
_TUPLE_FIELDS = ("prompt_token_ids", "token_ids", "logprobs", "token_weight_versions")
# SamplingParams fields a server from before them does not know: sent only when set
_NEWER_DEFAULTS: dict[str, Any] = {
    "stop": [], "include_stop_str_in_output": False, "min_tokens": 0, "min_p": 0.0,
    "logprobs": None, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0}


Prompt = list[int] | str | list[dict[str, Any]]


def _is_chat(prompt: object) -> bool:
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and all(isinstance(m, Mapping) for m in prompt))


class ServerError(RuntimeError):
    """The server answered with an error: ``status`` (e.g. 400, 401, 404, 422, 503) and its
    ``message`` (what was wrong and why)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def output_from_json(d: Mapping[str, Any]) -> GenerationOutput:
    """A :class:`GenerationOutput` from the server's JSON (extra keys such as
    ``request_id`` are ignored)."""
    kw = {name: d[name] for name in _OUTPUT_FIELDS if name in d}
    for name in _TUPLE_FIELDS:
        if name in kw:
            kw[name] = tuple(kw[name])
    if "top_logprobs" in kw:  # JSON object keys are strings: token ids again
        kw["top_logprobs"] = tuple({int(t): lp for t, lp in entry.items()}
                                   for entry in kw["top_logprobs"])
    return GenerationOutput(**kw)


def _params_json(params: SamplingParams | Mapping[str, Any] | None) -> dict[str, Any] | None:
    if params is None:
        return None
    if isinstance(params, SamplingParams):
        d = dataclasses.asdict(params)
        d["stop_token_ids"] = list(d["stop_token_ids"])
        if d.get("n") == 1:  # the default; a server from before SamplingParams.n knows no n
            del d["n"]
        d["stop"] = list(d["stop"])
        for name, default in _NEWER_DEFAULTS.items():  # (nor these, issue 25's fields)
            if d.get(name) == default:
                del d[name]
        return d
    return dict(params)


class SpecEngineClient:
    """Client of one server at ``base_url``; ``api_key`` is sent as a bearer token;
    ``timeout`` (seconds) bounds each socket operation (a stream waits at most that long
    for its next step)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompt: Prompt,
                 sampling_params: SamplingParams | Mapping[str, Any] | None = None, *,
                 k: int | None = None, request_id: str | None = None) -> GenerationOutput:
        """Generate one completion: ``prompt`` is token ids, text (when the checkpoint has
        a tokenizer) or chat messages (``[{"role": "user", "content": ...}]``, rendered with
        the checkpoint's chat template on the server); ``sampling_params`` a
        ``SamplingParams`` or a dict of its fields; ``k`` defaults to the server's ``--k``."""
        body = self._generate_body(prompt, sampling_params, k, request_id, stream=False)
        answer = self._call("POST", "/generate", body)
        if "outputs" in answer:  # the server answered a group
            raise ValueError("sampling_params.n > 1 asks for a group: use generate_group")
        return output_from_json(answer)

    def generate_group(self, prompt: Prompt,
                       sampling_params: SamplingParams | Mapping[str, Any], *,
                       k: int | None = None, request_id: str | None = None
                       ) -> list[GenerationOutput]:
        """A GRPO group: ``sampling_params.n`` completions of one prompt, sharing its prefill
        on the server (sample i has request id ``f"{request_id}-{i}"``), in sample order."""
        body = self._generate_body(prompt, sampling_params, k, request_id, stream=False)
        answer = self._call("POST", "/generate", body)
        outs = answer["outputs"] if "outputs" in answer else [answer]
        return [output_from_json(o) for o in outs]

    def generate_stream(self, prompt: Prompt,
                        sampling_params: SamplingParams | Mapping[str, Any] | None = None, *,
                        k: int | None = None, request_id: str | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield the request's :class:`RequestOutput` of every engine step; the last is
        finished and carries the whole output. Closing the iterator early (``break``, then
        the generator is collected, or ``.close()``) disconnects, which aborts the request
        on the server."""
        body = self._generate_body(prompt, sampling_params, k, request_id, stream=True)
        resp = self._open("POST", "/generate", body)
        with resp:
            for event in _sse_events(resp):
                if event == "[DONE]":
                    return
                d = json.loads(event)
                if "error" in d:
                    raise ServerError(int(d.get("status_code", 500)), d["error"])
                out = d.get("output")
                yield RequestOutput(d["request_id"], tuple(d["new_token_ids"]), d["finished"],
                                    None if out is None else output_from_json(out),
                                    bool(d.get("restarted", False)))
        raise ServerError(502, "the stream ended without [DONE]")

    def abort(self, request_id: str) -> GenerationOutput:
        """Abort an unfinished request; returns its output so far (``finish_reason="abort"``;
        its own caller gets the same). 404 when no such request is unfinished."""
        return output_from_json(self._call("POST", "/abort", {"request_id": request_id}))

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, path: str, which: str = "policy", version: int | None = None) -> int:
        """Load a safetensors checkpoint directory (on the server's machine) into the
        engine's ``which`` weights in place; returns the new weight version."""
        body = {"path": str(path), "which": which, "version": version}
        return int(self._call("POST", "/load_weights", body)["weight_version"])

    def init_weight_update_group(self, master_address: str, master_port: int, rank: int,
                                 world_size: int, backend: str = "nccl",
                                 timeout_s: float = 120.0) -> None:
        """Make the engine join a learner's weight-sync group (the learner's
        ``WeightSender`` joins as rank 0 at the same time)."""
        self._call("POST", "/init_weight_update_group", {
            "master_address": master_address, "master_port": master_port, "rank": rank,
            "world_size": world_size, "backend": backend, "timeout_s": float(timeout_s)})

    def update_weights_from_distributed(self, which: str = "policy", src_rank: int = 0,
                                        staging: str = "auto") -> int:
        """Receive one update the learner sends meanwhile; returns the new weight version."""
        body = {"which": which, "src_rank": src_rank, "staging": staging}
        return int(self._call("POST", "/update_weights_from_distributed", body)
                   ["weight_version"])

    def close_weight_update_group(self) -> None:
        self._call("POST", "/close_weight_update_group", None)

    # ---- sleep and wake (colocated training; SpecEngine.sleep / wake_up) -------------------
    def sleep(self, level: int = 1, tags: list[str] | None = None) -> int:
        """Release the idle engine's device memory (``level`` 1 keeps the weights in host
        memory, 2 drops them); returns the bytes released."""
        query = urllib.parse.urlencode([("level", level), *(("tags", t) for t in tags or ())])
        return int(self._call("POST", f"/sleep?{query}", None)["released_bytes"])

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the released memory back (``tags``: ``"weights"`` and/or ``"kv_cache"``)."""
        query = urllib.parse.urlencode([("tags", t) for t in tags or ()])
        self._call("POST", "/wake_up" + (f"?{query}" if query else ""), None)

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping", None)["is_sleeping"])

    # ---- state ---------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``GET /health``: ``status``, ``num_unfinished``, ``weight_version``."""
        return self._call("GET", "/health", None)

    def weight_version(self) -> int:
        """The engine's current weight version (a restarted learner resumes from it, or
        sends ``version=None``: the next one)."""
        return int(self.health()["weight_version"])

    def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``: the checkpoint, the draft, ``max_model_len`` and the
        current ``weight_version``."""
        return self._call("GET", "/get_model_info", None)

    def metrics(self) -> str:
        """The Prometheus text exposition of ``GET /metrics``."""
        with self._open("GET", "/metrics", None) as resp:
            return resp.read().decode()

    def wait_until_ready(self, timeout_s: float = 120.0, interval_s: float = 0.2
                         ) -> dict[str, Any]:
        """Poll ``/health`` until the server answers (a server that is starting refuses
        connections); raises ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.health()
            except (OSError, ServerError) as exc:  # URLError is an OSError
                if isinstance(exc, ServerError) and exc.status == 401:
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.base_url} not ready after {timeout_s:g} s: "
                                       f"{exc}") from exc
            time.sleep(interval_s)

    # ---- transport -----------------------------------------------------------------------
    def _generate_body(self, prompt: Prompt, params: Any, k: int | None,
                       request_id: str | None, stream: bool) -> dict[str, Any]:
        if isinstance(prompt, str):
            body: dict[str, Any] = {"prompt": prompt}
        elif _is_chat(prompt):  # rendered with the checkpoint's chat template on the server
            body = {"messages": [dict(m) for m in prompt]}
        else:
            body = {"prompt_token_ids": list(prompt)}
        if params is not None:
            body["sampling_params"] = _params_json(params)
        if k is not None:
            body["k"] = k
        if request_id is not None:
            body["request_id"] = request_id
        if stream:
            body["stream"] = True
        return body

    def _open(self, method: str, path: str, body: Mapping[str, Any] | None) -> Any:
        headers = {"Accept": "application/json, text/event-stream"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                     method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                raw = exc.read()
            try:
                message = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace") or exc.reason
            raise ServerError(exc.code, str(message)) from None

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None) -> Any:
        with self._open(method, path, body) as resp:
            return json.loads(resp.read())


def _sse_events(resp: Any) -> Iterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined with newlines)."""
    data: list[str] = []
    for raw in resp:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


__all__ = ["ServerError", "SpecEngineClient", "output_from_json"]
