"""HTTP types: OpenAI's request and response schemas as pydantic models.

These are the wire format only; :mod:`server.convert` turns a request into the engine's own
dataclasses (one explicit conversion that documents which defaults win). Fields that specd cannot
honour are accepted by the schema and refused with a 400 by the conversion, never ignored.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_serializer

INT64 = 2**63


class _Req(BaseModel):
    # unknown fields ignored (as OpenAI's API does); NaN and infinities refused in every number
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Omit(BaseModel):
    """Response keys in ``omit_null`` ("*": all) are left out when None (OpenAI's, never null)."""

    omit_null: ClassVar[tuple[str, ...]] = ("*",)

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        keys = self.omit_null
        return {
            k: v
            for k, v in handler(self).items()
            if v is not None or not ("*" in keys or k in keys)
        }


class StreamOptions(_Req):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (refused)


class SpeculationOptions(_Req):
    """specd extension (send through ``extra_body``): per-request speculation settings."""

    enabled: bool | None = None
    method: Literal["ngram", "suffix", "draft", "eagle3", "model", "self", "layers"] | None = None
    k: int | None = Field(None, ge=0)
    k_max: int | None = Field(None, ge=0)


class JsonSchemaFormat(_Req):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Req):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Req):
    """specd / vLLM extension: the output must match exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema
    regex: str | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)
    choice: list[str] | None = Field(None, min_length=1)


class _Sampling(_Req):
    """The fields both generation routes take: OpenAI's, then vLLM's extensions (every field
    vLLM's OpenAI server accepts is declared, so that server/convert.py honours it or refuses
    it with a 400 naming it; a field neither knows is ignored, as OpenAI ignores it)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; -1 or 0 = off
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in [-100, 100]
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # extension (vLLM's): 1 = off
    ignore_eos: bool = False  # extension (vLLM's): the end-of-sequence token does not stop it
    user: str | None = None
    speculation: SpeculationOptions | None = None
    deterministic: bool | None = (
        None  # extension: batch-invariant forwards (engine/model/invariant.py)
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's sampling parameters
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    add_special_tokens: bool | None = None  # default: true for a prompt, false for a chat
    # vLLM's structured-output fields (one of them, or response_format / structured_outputs)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's serving fields
    priority: int = 0
    request_id: str | None = Field(None, max_length=256)
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None  # vLLM's token ids beside the text (refused)
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo + logprobs: score the prompt
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's maximum
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    prompt_embeds: Any = None  # vLLM's (refused: specd takes token ids or text)


class TextPart(_Req):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's wire format)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Req):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Req):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Req):
    name: str


class NamedToolChoice(_Req):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    best_of: int | None = Field(None, ge=1)
    # vLLM's chat fields
    echo: bool = False  # the last message, when it is the assistant's, leads the answer
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structural_tag: str | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool = True


# -- vLLM's tokenizer routes ---------------------------------------------------------------------
class TokenizeCompletionRequest(_Req):
    """``POST /tokenize`` of a text, as ``/v1/completions`` would tokenize it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Req):
    """``POST /tokenize`` of a conversation, rendered by the model's chat template as
    ``/v1/chat/completions`` renders it (``add_generation_prompt``: the assistant's turn opened)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# -- responses ------------------------------------------------------------------------------
class SpeculationUsage(BaseModel):
    drafted_tokens: int = 0  # the chains' drafts
    accepted_tokens: int = 0  # of them and of the leaves, kept
    target_passes: int = 0
    tree_leaves: int = 0  # draft-tree leaves verified beside the chains (the head's runners-up)
    leaf_accepts: int = 0  # rounds whose accepted path ended at a leaf


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    speculation: SpeculationUsage | None = None  # specd extension, ignored by OpenAI clients


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptTokenLogprob(BaseModel):
    """vLLM's Logprob: one token's log-probability at a prompt position, its rank among all
    tokens there (1: the most probable) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, null for the first (nothing to score it on), else
# token id -> its Logprob: the prompt's own token, then the top N
PromptLogprobs = list[dict[int, PromptTokenLogprob] | None]
PROMPT_LOGPROBS: TypeAdapter[PromptLogprobs] = TypeAdapter(PromptLogprobs)


class CompletionChoice(_Omit):
    omit_null = ("prompt_logprobs",)  # only when asked for (vLLM's prompt_logprobs)

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Omit):
    omit_null = ("usage",)  # a streamed chunk's until the last: the spec has no null usage

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(_Omit):
    omit_null = ("tool_calls",)  # left out when there are none

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(_Omit):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Omit):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id


class ChatCompletionResponse(_Omit):
    omit_null = ("prompt_logprobs",)  # only when asked for (vLLM's prompt_logprobs)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, of the conversation's tokens


class Delta(_Omit):
    """A stream chunk's delta (OpenAI sends ``role`` in the first chunk only, and an empty
    ``{}`` with the finish reason)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
