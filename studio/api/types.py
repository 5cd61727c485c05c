"""OpenAI's request and response shapes as pydantic models, plus the ``pml`` extension (docs/api.md).

Requests refuse fields OpenAI does not define (a misspelt parameter is a named 400, as OpenAI's); parameters that
would change the answer and are not implemented are declared so that :func:`unsupported` names them in a 400.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="allow")  # Anthropic adds "ttl"; only the presence of the mark matters

    type: StrictStr = "ephemeral"


class ContentPart(BaseModel):
    """One content part; only ``text`` parts are supported (others get a named 400 from the routes)."""

    model_config = ConfigDict(extra="allow")  # image_url, input_audio, file: refused by type, not by field

    type: StrictStr
    text: StrictStr | None = None
    cache_control: CacheControl | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None  # accepted and ignored (it never reaches the model)
    tool_calls: list[Any] | None = None
    tool_call_id: StrictStr | None = None
    function_call: Any = None
    refusal: StrictStr | None = None
    audio: Any = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # accepted and ignored


class PmlOptions(BaseModel):
    """The ``pml`` extension of a request (``extra_body={"pml": {...}}`` in the openai client)."""

    model_config = ConfigDict(extra="forbid")

    schema_: StrictStr | None = Field(None, alias="schema")  # a schema's name, or its PML text (starts with "<")
    prompt: StrictStr | None = None  # a PML prompt written against that schema
    arm: StrictStr | None = None  # the arm that answers (GET /v1/models lists them); the server's default else
    mode: Literal["auto", "marked", "transparent", "plain"] = "auto"  # how messages become modules (no PML given)


class _Sampling(_Request):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    user: StrictStr | None = None
    pml: PmlOptions | None = None
    # vLLM's and SGLang's own; vllm-router writes them into every request it forwards, at their defaults
    no_stop_trim: StrictBool | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    return_hidden_states: StrictBool | None = None


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[StrictStr] | None = None
    prediction: Any = None
    reasoning_effort: StrictStr | None = None
    web_search_options: Any = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    verbosity: StrictStr | None = None
    continue_final_message: StrictBool | None = None
    # how a reasoning model's thinking is shown: no model here thinks apart, so any value reads the same
    separate_reasoning: StrictBool | None = None
    stream_reasoning: StrictBool | None = None
    include_reasoning: StrictBool | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[Any]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


def unsupported(req: _Sampling) -> tuple[str, str] | None:
    """(parameter, why) of the first parameter whose value this server cannot honour, or None."""
    checks = [
        ("n", req.n not in (None, 1), "only n=1 is supported (one choice per request)"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
        ("presence_penalty", req.presence_penalty not in (None, 0), "presence_penalty is not supported (use 0)"),
        ("frequency_penalty", req.frequency_penalty not in (None, 0), "frequency_penalty is not supported (use 0)"),
        ("no_stop_trim", bool(req.no_stop_trim), "no_stop_trim is not supported (the stop string is cut)"),
        ("ignore_eos", bool(req.ignore_eos), "ignore_eos is not supported (an answer ends at the end token)"),
        ("skip_special_tokens", req.skip_special_tokens is False,
         "skip_special_tokens=false is not supported (special tokens are left out of the text)"),
        ("return_hidden_states", bool(req.return_hidden_states), "return_hidden_states is not supported"),
    ]
    if isinstance(req, ChatRequest):
        fmt = (req.response_format or {}).get("type", "text")
        checks += [
            ("logprobs", bool(req.logprobs) or req.top_logprobs not in (None, 0), "logprobs are not supported"),
            ("tools", bool(req.tools) or bool(req.functions), "tools and functions are not supported"),
            ("tool_choice", req.tool_choice not in (None, "none") or req.function_call not in (None, "none"),
             "tool_choice is not supported (no tools)"),
            ("response_format", fmt != "text", f"response_format '{fmt}' is not supported (only text)"),
            ("audio", req.audio is not None or (req.modalities or ["text"]) != ["text"], "only text output is supported"),
            ("prediction", req.prediction is not None, "predicted outputs are not supported"),
            ("web_search_options", req.web_search_options is not None, "web search is not supported"),
            ("continue_final_message", bool(req.continue_final_message),
             "continue_final_message is not supported (the answer starts a new assistant turn)"),
        ]
    else:
        checks += [
            ("logprobs", req.logprobs not in (None, 0), "logprobs are not supported"),
            ("echo", bool(req.echo), "echo is not supported"),
            ("suffix", bool(req.suffix), "suffix (insertion) is not supported"),
            ("best_of", req.best_of not in (None, 1), "only best_of=1 is supported"),
        ]
    return next(((param, why) for param, bad, why in checks if bad), None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # reused and not recomputed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PmlInfo(BaseModel):
    """The ``pml`` object of an answer (docs/api.md lists its fields)."""

    arm: str
    mode: str
    schema_name: str
    modules_reused: int
    modules_encoded: int
    routed_kept: list[str] | None = None
    routed_path: str | None = None  # stored | partial | full | repeat | tree
    repeat: bool = False  # an earlier request compiled to the same prompt was read back: a lookup's TTFT
    recomputed_tokens: int = 0  # never counted in cached_tokens
    routed_out_tokens: int | None = None  # the routed arm's left-out modules (in cached_tokens); null for other arms
    cached_tokens: int
    ttft_ms: float  # encoding included
    arm_ttft_ms: float  # as `pml-studio run` reports it
    decode_ms_per_token: float | None
    queue_ms: float  # from arriving to the engine taking it up (other requests filling before it)
    decode_batch: int = 1  # the most runs one of its decode steps computed (other requests' included)
    decode_shared: float = 0.0  # other requests' runs in its decode steps, on average
    encode_ms: float = 0.0
    run_id: int | None = None
    note: str = ""
    store_note: str = ""  # why modules encoded for this answer were not saved to disk (a full disk): memory only
    uncached_documents: dict[str, int] = {}  # reason ("system", "short", "no_room") -> parts that ran as new text


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    pml: PmlInfo


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    pml: PmlInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    pml: PmlInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pml-studio"
    pml: dict[str, Any] | None = None  # weights, the default arm, the arms a request may ask for


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
