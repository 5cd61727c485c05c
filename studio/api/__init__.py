"""The OpenAI-compatible API in front of the engine (vLLM's ``entrypoints/openai``, llama-cpp-python's ``server``).

- ``types.py``: request and response shapes (pydantic), ``errors.py``: OpenAI's error bodies;
- ``modes.py`` + ``positions.py``: a request's messages → one PML schema + prompt (explicit, marked, transparent,
  plain), documents at fixed positions; ``schemas.py``: the schemas an explicit request may name;
- ``service.py``: requests on the engine thread, a bounded queue; ``usage.py``: honest usage;
- ``routes.py``: the FastAPI app and :class:`~.routes.ApiRoute`, which serves it beside the studio;
  ``metrics.py``: Prometheus; ``serve.py``: ``pml-studio api``, the API without the studio's page.

Importing this package imports nothing else (the guard reads ``errors`` alone); docs/api.md is the user's page.
"""
