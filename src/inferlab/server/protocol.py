"""The OpenAI API as vLLM serves it: request, response and stream-chunk models, and the error object. Every JSON the
server sends is one of these models.

Requests accept unknown fields and ignore them (vLLM's behaviour: clients send extras such as `user`), but a known
OpenAI parameter that we do not implement is refused with a 400 naming it when set to anything but its default,
so that nobody silently gets a different sampling than they asked for.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inferlab.common.errors import InvalidRequestError
from inferlab.engine.logprobs import MAX_LOGPROBS
from inferlab.engine.outputs import RequestOutput
from inferlab.engine.sampling_params import INT64_MAX, SEED_MAX, SEED_MIN, SamplingParams
from inferlab.engine.structured_output import Guide
from inferlab.server.tools import ToolPlan

# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error that becomes an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


# ---------------------------------------------------------------- requests

# Bounds on what one request may carry. Stop strings are searched for after every token and stop ids looked up in a
# list, so their number and length bound a request's per-token cost (and with it every other request's step time).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 2048
MAX_CHOICES = 64  # n: each choice is a sequence of its own in the running batch
_Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
_TopP = Annotated[float, Field(gt=0.0, le=1.0)]
_TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # and below the vocabulary size: checked in the server
_Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
_Stop = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


# vLLM's extra fields for structured output (the older guided_* and the newer structured_outputs object's keys).
_GUIDE_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _guide(kind: str, value: Any, param: str) -> Guide:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise invalid(f"{param} must be a JSON schema (an object or its JSON text): {e}", param) from None
        if not isinstance(value, dict):
            raise invalid(f"{param} must be a JSON schema object", param)
        return Guide("json_schema", json.dumps(value), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid(f"{param} must be a non-empty list of non-empty strings", param)
        return Guide("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise invalid(f"{param} must be a non-empty string", param)
    return Guide(kind, value, param)  # type: ignore[arg-type]


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints: OpenAI's and vLLM's sampling extensions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="The served model id; omitted means the one model this server serves.")
    temperature: _Temperature | None = None
    top_p: _TopP | None = None
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="vLLM extension: -1 or 0 disables the "
                              "top-k cut; at most the vocabulary size.")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: _Stop | list[_Stop] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[_TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS, description="vLLM extension.")
    ignore_eos: bool | None = Field(False, description="vLLM extension: generate max_tokens tokens even past "
                                                      "end-of-sequence.")
    include_stop_str_in_output: bool | None = Field(False, description="vLLM extension.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES, description="Choices to sample; they share the prompt's KV "
                                                               "blocks. With a seed, choice i uses seed + i.")
    cache_salt: str | None = Field(None, description="vLLM extension: requests share cached prefixes only with the same salt.")
    # Known OpenAI parameters we refuse unless left at their defaults (see _check_unsupported).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = Field(None, description=(
        "json_object or json_schema: the output is constrained to it (xgrammar token masks). vLLM's guided_json, "
        "guided_regex, guided_choice, guided_grammar and structured_outputs {json|regex|choice|grammar} also work."))

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """json.loads turns an escaped lone surrogate ("\\ud800") into a str that no UTF-8 codec (the tokenizer,
        the response encoder) accepts: refuse it here, naming where it is."""
        if (where := _invalid_unicode_path(data)) is not None:
            raise invalid(f"{where}: invalid Unicode: the string holds a lone surrogate (a \\uD800-\\uDFFF escape "
                          f"without its pair); send valid UTF-8 text", where.split(".")[0].split("[")[0])
        return data

    def _check_unsupported(self, extra: dict[str, Any]) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise invalid(f"{name} is not supported by this server; omit it or set it to 0", name)
        if self.logit_bias:
            raise invalid("logit_bias is not supported by this server", "logit_bias")
        for name, value in extra.items():
            if name in _UNSUPPORTED_IF_SET and value not in _UNSUPPORTED_IF_SET[name]:
                raise invalid(f"{name} is not supported by this server", name)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                seed=self.seed,
                max_tokens=max_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=bool(self.ignore_eos),
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                n=self.n or 1,
                guide=self.guide(),
                **self.logprob_params(),
            )
        except InvalidRequestError as e:
            raise invalid(str(e), e.param) from None

    def guide(self) -> Guide | None:
        """The structured-output constraint, from whichever one field sets it."""
        extra = self.model_extra or {}
        found: list[Guide] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(Guide("json_object", param="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise invalid("response_format of type json_schema needs json_schema.schema", "response_format")
            found.append(_guide("json_schema", rf.json_schema.schema_, "response_format"))
        for key, kind in _GUIDE_FIELDS.items():
            if extra.get(key) is not None:
                found.append(_guide(kind, extra[key], key))
        so = extra.get("structured_outputs")
        if so is not None:
            if not isinstance(so, dict):
                raise invalid("structured_outputs must be an object", "structured_outputs")
            for key, kind in _STRUCTURED_KEYS.items():
                if so.get(key) is not None:
                    found.append(_guide(kind, so[key], "structured_outputs"))
        if len(found) > 1:
            raise invalid(f"only one output constraint may be set, got {', '.join(g.param for g in found)}",
                          found[1].param)
        return found[0] if found else None

    def logprob_params(self) -> dict[str, Any]:
        """The SamplingParams fields of logprobs and echo, which the endpoints spell differently."""
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# Extra fields (not declared above) that we accept only at these "off" values.
_UNSUPPORTED_IF_SET: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "prompt_logprobs": (None, 0),
    "use_beam_search": (None, False),
    "min_tokens": (None, 0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
}


class CompletionRequest(_SamplingFields):
    prompt_field: ClassVar[str] = "prompt"  # the `param` of an error about the prompt
    prompt: str | list[_TokenId] | list[str] | list[list[_TokenId]] = Field(
        ..., description="A string or a list of token ids. A batch of several prompts is not supported.")
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX, description="0 only with echo and logprobs (score the prompt).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "Log-probabilities of each token and of its `logprobs` most likely alternatives, of the model's raw "
        "distribution (before temperature, top-k and top-p, as vLLM's default)."))
    echo: bool | None = Field(False, description="Prepend the prompt to the text (and its tokens to logprobs; "
                                                 "the first prompt token's logprob is null).")

    def logprob_params(self) -> dict[str, Any]:
        echo = bool(self.echo)
        if self.max_tokens == 0 and not (echo and self.logprobs is not None):
            raise invalid("max_tokens=0 needs echo=true and logprobs set: it scores the prompt without generating",
                          "max_tokens")
        return {"logprobs": self.logprobs, "echo": echo,
                "prompt_logprobs": self.logprobs if echo and self.logprobs is not None else None}

    def check(self) -> str | list[int]:
        """Unsupported options -> 400; returns the single prompt."""
        self._check_unsupported(self.model_extra or {})
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise invalid("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return p  # type: ignore[return-value]
        if len(p) != 1:
            raise invalid(f"a batch of {len(p)} prompts is not supported: send one prompt per request", "prompt")
        one = p[0]
        if isinstance(one, list) and not one:
            raise invalid("prompt must not be empty", "prompt")
        return one  # type: ignore[return-value]

    @property
    def max_output_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # vLLM's default, also for an explicit null


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            m["name"] = self.name
        extra = self.model_extra or {}
        for key in ("tool_calls", "tool_call_id"):  # a conversation that already called tools, for the template
            if extra.get(key) is not None:
                m[key] = extra[key]
        return m


class FunctionDef(BaseModel):
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    prompt_field: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: _Count | None = Field(None, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: _Count | None = None
    logprobs: bool | None = Field(False, description="Return the log-probability of each output token (of the "
                                                     "model's raw distribution, as vLLM's default).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With logprobs: how many most "
                                                                             "likely alternatives per token.")

    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan | None:
        """How tools shape this request (server/tools.py); None without tools or with tool_choice none."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise invalid("tool_choice needs tools", "tool_choice")
            return None
        functions = {t.function.name: t.function.parameters for t in self.tools}
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in functions:
                raise invalid(f"tool_choice names the function `{choice.function.name}`, which is not among the "
                              f"tools ({', '.join(functions)})", "tool_choice")
            return ToolPlan("named", functions, choice.function.name)
        mode: Any = choice or "auto"
        return ToolPlan(mode, functions, parallel=self.parallel_tool_calls is not False)

    def guide(self) -> Guide | None:
        own = super().guide()
        plan = self.tool_plan()
        forced = plan.guide if plan is not None else None
        if own is not None and plan is not None and forced is not None:
            raise invalid(f"{own.param} cannot be combined with tool_choice {plan.mode} (it constrains the "
                          f"output to the function's arguments)", own.param)
        return own or forced

    def logprob_params(self) -> dict[str, Any]:
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def check(self) -> list[dict] | dict[str, Any]:
        self._check_unsupported(self.model_extra or {})
        messages = [m.to_template() for m in self.messages]
        if self.tools:  # the engine renders them with the chat template (LLMEngine.tokenize_prompt)
            return {"messages": messages, "tools": [t.model_dump(exclude_none=True) for t in self.tools]}
        return messages

    @property
    def max_output_tokens(self) -> int | None:
        # None: until the context is full (OpenAI's and vLLM's default for chat).
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _invalid_unicode_path(data: Any) -> str | None:
    """The path ("messages[0].content") of the first string (key or value) holding a lone surrogate, else None.
    Iterative: the body may be nested as deep as json.loads allows."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if not x.isascii():
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(x, dict):
            for k, v in x.items():
                name = k.encode("utf-8", "backslashreplace").decode() if isinstance(k, str) else str(k)
                sub = f"{path}.{name}" if path else name
                if isinstance(k, str) and _invalid_unicode_path(k) is not None:
                    return sub
                stack.append((sub, v))
        elif isinstance(x, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(x) if isinstance(v, (str, dict, list)))
    return None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, last: RequestOutput, *others: RequestOutput) -> UsageInfo:
        """The usage of a request, from its finishing delta (and its other choices' with n > 1: their tokens add
        up, the prompt counts once)."""
        out = last.num_output_tokens + sum(o.num_output_tokens for o in others)
        return cls(prompt_tokens=last.num_prompt_tokens, completion_tokens=out,
                   total_tokens=last.num_prompt_tokens + out,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=last.num_cached_tokens))


FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # null for the first prompt token (with echo)
    top_logprobs: list[dict[str, float] | None]  # the token itself and its most likely alternatives
    text_offset: list[int]  # where each token's text starts in the choice's text (across a stream's chunks)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class _Choice(BaseModel):
    index: int = 0
    logprobs: None = None
    finish_reason: FinishReason | None  # None until the last chunk of a stream
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token id that ended it


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None  # type: ignore[assignment]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(CompletionResponse):
    """One event of a streamed completion (OpenAI names it `text_completion` too); with include_usage, a last one
    with no choices carries the usage."""

    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None  # type: ignore[assignment]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    content: str = ""


class RoleDelta(BaseModel):
    """Only the first chunk of a chat stream names the role, as OpenAI's do."""

    role: Literal["assistant"]
    content: str = ""


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str = ""


class DeltaToolCall(BaseModel):
    index: int = 0
    id: str | None = None  # on the first delta of a call, with type and name
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ToolCallsDelta(BaseModel):
    content: str | None = None
    tool_calls: list[DeltaToolCall]


class ChatStreamChoice(_Choice):
    delta: RoleDelta | DeltaMessage | ToolCallsDelta
    logprobs: ChatLogprobs | None = None  # type: ignore[assignment]


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None  # null but in the last chunk (with include_usage), as OpenAI's


def sse(event: BaseModel) -> str:
    """One server-sent event carrying `event` as JSON."""
    return f"data: {event.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"
_TEXT_MARK = "\x00"  # JSON "\u0000": nowhere else in a chunk (ids are hex, a model name is a file name)


def sse_with_text(chunk: Callable[[str], BaseModel]) -> Callable[[str], str]:
    """`text -> sse(chunk(text))`, for the chunk a stream sends per token. pydantic costs tens of microseconds per
    chunk (~150x two string concatenations) and this runs for every token of every stream, so the model is
    serialised once, with a marker for the text, and each token's text is spliced into it."""
    head, tail = sse(chunk(_TEXT_MARK)).split(json.dumps(_TEXT_MARK))
    return lambda text: head + json.dumps(text) + tail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inferlab"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
