"""A hand-written OpenAPI 3 description of the completion endpoints, kept in step with service/api/protocol.py."""

from __future__ import annotations

from sluice.service.api.protocol import (
    CHAT_ROLES,
    INT32,
    INT64,
    MAX_CACHE_SALT,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS,
)

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT32 - 1}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}


def _num(lo: float, hi: float, default: float, doc: str) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi, "default": default, "nullable": True, "description": doc}


def _int(lo: int, hi: int, doc: str, default: int | None = None) -> dict:
    s = {"type": "integer", "minimum": lo, "maximum": hi, "nullable": True, "description": doc}
    if default is not None:
        s["default"] = default
    return s


_STRUCTURED = {
    "response_format": {
        "type": "object", "nullable": True, "required": ["type"],
        "description": "text; json_object (any JSON object); json_schema {name, schema, strict}: the reply is "
                       "constrained to the schema (grammar-constrained decoding).",
        "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                       "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                        "schema": {"type": "object"},
                                                                        "strict": {"type": "boolean"}}}}},
    "structured_outputs": {
        "type": "object", "nullable": True, "description": "vLLM's extra: exactly one of json (a schema), regex, "
        "choice (a list of strings), grammar (EBNF, xgrammar's dialect), json_object (true).",
        "properties": {"json": {"type": "object"}, "regex": {"type": "string"}, "grammar": {"type": "string"},
                       "choice": {"type": "array", "items": {"type": "string"}},
                       "json_object": {"type": "boolean"}}},
    "guided_json": {"type": "object", "nullable": True, "description": "Older spelling of structured_outputs.json."},
    "guided_regex": {"type": "string", "nullable": True, "description": "Older spelling of structured_outputs.regex."},
    "guided_choice": {"type": "array", "items": {"type": "string"}, "nullable": True,
                      "description": "Older spelling of structured_outputs.choice."},
    "guided_grammar": {"type": "string", "nullable": True,
                       "description": "Older spelling of structured_outputs.grammar."},
}

_SAMPLING = {
    "model": {"type": "string", "nullable": True, "description": "The served model name (see /v1/models); optional."},
    "temperature": _num(0, 2, 1, "Sampling temperature; 0 is greedy."),
    "top_p": {**_num(0, 1, 1, "Nucleus sampling mass, in (0, 1]."), "exclusiveMinimum": True},
    "top_k": _int(-1, INT32, "Keep the k most likely tokens; 0 or -1 disables.", 0),
    "min_p": _num(0, 1, 0, "Drop tokens below min_p times the top probability."),
    "seed": _int(-INT64, INT64 - 1, "Seed for reproducible sampling; choice i of n uses seed + i."),
    "stop": {"nullable": True, "description": "Stop strings: the output ends before the first one (not included).",
             "oneOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
                       {"type": "array", "maxItems": MAX_STOP,
                        "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}}]},
    "stop_token_ids": {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": _TOKEN_ID, "nullable": True,
                       "description": "Token ids that end the output."},
    "include_stop_str_in_output": {"type": "boolean", "nullable": True, "default": False},
    "ignore_eos": {"type": "boolean", "nullable": True, "default": False, "description": "Keep going past EOS."},
    "min_tokens": _int(0, INT32, "Tokens to generate before EOS or stop token ids may end the output.", 0),
    "n": _int(1, MAX_N, "Independent samples of the prompt (they share its KV cache blocks).", 1),
    "best_of": _int(1, MAX_N, "Must equal n when given."),
    "stream": {"type": "boolean", "nullable": True, "default": False, "description": "Stream Server-Sent Events."},
    "stream_options": {"type": "object", "nullable": True, "description": "Only with stream: true.",
                       "properties": {"include_usage": {"type": "boolean", "nullable": True}}},
    "priority": _int(-INT32, INT32 - 1, "Scheduling priority under --scheduling-policy priority: lower is served "
                     "first; FCFS among equals.", 0),
    "user": {"type": "string", "nullable": True, "description": "End-user id (accepted, not used)."},
    "presence_penalty": _num(-2, 2, 0, "OpenAI: subtracted once from every token already generated."),
    "frequency_penalty": _num(-2, 2, 0, "OpenAI: subtracted per occurrence of a token in the output."),
    "repetition_penalty": {**_num(0, 100, 1, "vLLM/transformers: seen tokens (prompt and output) have positive "
                                  "logits divided, negative ones multiplied by it."), "exclusiveMinimum": True},
    "logit_bias": {"type": "object", "nullable": True, "maxProperties": 1024,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "Token id (as a string) to a bias added to its logit; -100 bans, 100 forces."},
    "allowed_token_ids": {"type": "array", "items": _TOKEN_ID, "minItems": 1, "nullable": True,
                          "description": "Only these token ids may be generated."},
    "bad_words": {"type": "array", "nullable": True, "maxItems": MAX_STOP,
                  "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
                  "description": "Words never generated (their last token is banned after the rest of them)."},
    "skip_special_tokens": {"type": "boolean", "nullable": True, "default": True},
    "cache_salt": {"type": "string", "nullable": True, "minLength": 1, "maxLength": MAX_CACHE_SALT,
                   "description": "Prefix-cache isolation: cached blocks are shared only among requests with the "
                                  "same salt (e.g. one per tenant)."},
    **_STRUCTURED,
}

_COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"], "additionalProperties": True,
    "properties": {
        "prompt": {"description": "A string, a list of strings, a list of token ids or a list of lists of them.",
                   "oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                              "items": {"type": "string", "minLength": 1}},
                             _TOKEN_IDS,
                             {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": _TOKEN_IDS}]},
        "max_tokens": _int(1, INT32, "Most tokens to generate; prompt + max_tokens must fit the context.", 16),
        "logprobs": _int(0, MAX_LOGPROBS, "Return the sampled token's logprob and this many alternatives."),
        "echo": {"type": "boolean", "nullable": True, "default": False,
                 "description": "Start the reply with the prompt's text (not with logprobs)."},
        "suffix": {"type": "string", "nullable": True, "enum": [None], "description": "Not supported."},
        **_SAMPLING,
    },
}

_CONTENT = {"nullable": True, "oneOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}},
]}

_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "The arguments as JSON text."}}}}}
_FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
_TOOLS = {  # service/api/tools.py; README "Tool calling"
    "tools": {"type": "array", "nullable": True, "maxItems": 128, "description": "Functions the model may call.",
              "items": {"type": "object", "required": ["type", "function"], "properties": {
                  "type": {"type": "string", "enum": ["function"]},
                  "function": {"type": "object", "required": ["name"], "properties": {
                      "name": _FUNCTION_NAME, "description": {"type": "string"},
                      "parameters": {"type": "object", "description": "JSON schema of the arguments (an object)."},
                      "strict": {"type": "boolean", "nullable": True}}}}}},
    "tool_choice": {"nullable": True, "description": "none, auto (the default with tools), required (at least one "
                    "call, grammar-enforced) or a named function (exactly that call). Only with tools.",
                    "oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                              {"type": "object", "required": ["type", "function"], "properties": {
                                  "type": {"type": "string", "enum": ["function"]},
                                  "function": {"type": "object", "required": ["name"],
                                               "properties": {"name": _FUNCTION_NAME}}}}]},
    "parallel_tool_calls": {"type": "boolean", "nullable": True, "default": True,
                            "description": "Allow several calls in one reply."},
}

_CHAT_REQUEST = {
    "type": "object", "required": ["messages"], "additionalProperties": True,
    "properties": {
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)}, "content": _CONTENT,
                           "name": {"type": "string", "nullable": True},
                           "tool_calls": {"type": "array", "nullable": True, "items": _TOOL_CALL,
                                          "description": "assistant: the calls it made (content may be null)."},
                           "tool_call_id": {"type": "string", "nullable": True,
                                            "description": "tool: the call this result answers (required)."}},
            "description": "content is required except for assistant messages."}},
        "max_tokens": _int(1, INT32, "Most tokens to generate (default: what the context leaves)."),
        "max_completion_tokens": _int(1, INT32, "Same as max_tokens; takes precedence."),
        "logprobs": {"type": "boolean", "nullable": True, "default": False},
        "top_logprobs": _int(0, MAX_LOGPROBS, "Alternatives per token; needs logprobs: true."),
        "chat_template_kwargs": {"type": "object", "nullable": True, "maxProperties": MAX_TEMPLATE_KWARGS,
                                 "description": "Variables for the chat template, e.g. {\"enable_thinking\": false}; "
                                                "not messages, tools or add_generation_prompt."},
        **_SAMPLING,
        **_TOOLS,
    },
}

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}},
}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "completion_tokens_details": {"type": "object", "properties": {"reasoning_tokens": {
        "type": "integer", "description": "With --reasoning-parser: the tokens of the thinking."}}}}}


def _response(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": [obj]}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": _USAGE}}


_REASONING = {"type": "string", "nullable": True, "description": "With --reasoning-parser: the thinking."}
_FINISH = {"type": "string", "nullable": True, "enum": ["stop", "length", None]}
_COMPLETION_RESPONSE = _response("text_completion", {"type": "object", "properties": {
    "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
    "logprobs": {"type": "object", "nullable": True}}})
_CHAT_RESPONSE = _response("chat.completion", {"type": "object", "properties": {
    "index": {"type": "integer"}, "logprobs": {"type": "object", "nullable": True},
    "finish_reason": {**_FINISH, "enum": ["stop", "length", "tool_calls", None]},
    "message": {"type": "object", "properties": {"role": {"type": "string"},
                                                 "content": {"type": "string", "nullable": True},
                                                 "tool_calls": {"type": "array", "items": _TOOL_CALL},
                                                 "reasoning_content": _REASONING, "reasoning": _REASONING}}}})

_ERRORS = {
    "400": "Invalid parameters, or a prompt longer than the context or the KV cache can ever hold.",
    "401": "Missing or wrong 'Authorization: Bearer <key>' (when the server has an API key).",
    "404": "Unknown model.",
    "413": "Request body over --max-request-body-bytes.",
    "429": "More than --max-queued-requests are waiting; see Retry-After.",
    "503": "The server is loading or shutting down.",
    "500": "Internal error; the server log has the details under the X-Request-Id.",
}


def _operation(summary: str, request: dict, response: dict) -> dict:
    responses = {"200": {
        "description": "The completion; with stream: true, Server-Sent Events of chunks ending in 'data: [DONE]'.",
        "content": {"application/json": {"schema": response}, "text/event-stream": {"schema": {"type": "string"}}}}}
    for status, doc in _ERRORS.items():
        responses[status] = {"description": doc, "content": {"application/json": {"schema": _ERROR}}}
    return {"post": {"summary": summary, "requestBody": {
        "required": True, "content": {"application/json": {"schema": request}}}, "responses": responses,
        "parameters": [{"name": "X-Request-Id", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "Echoed in the response and the server log (generated when absent)."}]}}


def openapi_spec(version: str) -> dict:
    """The document served at /openapi.json."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "Sluice", "version": version,
                 "description": "OpenAI-compatible completions with SSE streaming, served by Sluice."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
        "paths": {
            "/v1/completions": _operation("Text completion", _COMPLETION_REQUEST, _COMPLETION_RESPONSE),
            "/v1/chat/completions": _operation("Chat completion", _CHAT_REQUEST, _CHAT_RESPONSE),
        },
    }
