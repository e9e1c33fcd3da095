"""The HTTP rollout server (docs/design.md "Server"): ``app`` (the FastAPI app over an
``AsyncSpecEngine``), ``schemas`` (request bodies), ``errors`` (error responses, auth),
``metrics`` (Prometheus), ``openai_api`` / ``openai_schemas`` (the OpenAI-compatible ``/v1/``
endpoints) and ``serve`` (uvicorn with a clean shutdown; ``specengine serve``). The client is
``specengine.client`` (or the ``openai`` package, against ``/v1``).

Needs the ``server`` extra (fastapi, uvicorn, prometheus_client; jinja2 for chat templates);
this module itself imports none of them, so the CLI can name its defaults without them.
"""

from __future__ import annotations

API_KEY_ENV = "SPECENGINE_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

__all__ = ["API_KEY_ENV", "DEFAULT_HOST", "DEFAULT_PORT"]
