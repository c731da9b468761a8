"""Tool calling on /v1/chat/completions: the request side.

`tools`, `tool_choice` and `parallel_tool_calls` are validated into a ToolSpec; `plan_tools` then decides, per
model, how the tools reach the prompt and what constrains the reply:

- *native*: the chat template knows tools (its text mentions `tools`): the tools and the history's calls go to
  `apply_chat_template(tools=...)`, and a free (`auto`) reply is parsed from the model's own format
  (service/api/tool_parsers.py: hermes, llama3_json, mistral, json; `--tool-call-parser`).
- *prompted*: the template knows nothing of tools: they are described in the system prompt, history calls and
  results are rendered as text, and the reply is constrained to one JSON value: a call `{"name", "arguments"}`,
  an array of calls (with parallel_tool_calls), or a text answer `{"content": "..."}` that is unwrapped.

Either way `required` and a named function are grammars: the reply is the call's JSON, its name one of the
allowed functions and its arguments valid against that function's `parameters`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sluice.scheduling.sampling_params import StructuredOutput
from sluice.service.api.errors import RequestError
from sluice.service.api.structured import MAX_SPEC_BYTES, check_schema_shape

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # calls in one forced or prompted reply: keeps a constrained array finite
PARSERS = ("auto", "hermes", "llama3_json", "mistral", "json")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}
DRAFTS = frozenset(f"http://json-schema.org/{d}/schema" for d in ("draft-04", "draft-06", "draft-07")) | frozenset(
    f"http://json-schema.org/draft/{d}/schema" for d in ("2019-09", "2020-12"))


@dataclass(slots=True)
class ToolSpec:
    """A request's validated tools: the function objects, the choice and whether calls may come in parallel."""

    functions: list[dict]  # {"name", "description", "parameters"}
    choice: str = "auto"  # none | auto | required | named
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The model may (or must) call a tool."""
        return bool(self.functions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


# ---- request parsing --------------------------------------------------------------------------------

def parse_tools(body: dict) -> ToolSpec | None:
    """`tools`, `tool_choice`, `parallel_tool_calls`; RequestError naming the parameter when malformed."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise RequestError("the legacy 'functions' / 'function_call' are not supported; use 'tools' and "
                           "'tool_choice'", "functions" if body.get("functions") is not None else "function_call")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice is not None and choice != "none":
            raise RequestError("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    functions = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise RequestError(f"two tools are named '{dup}'", f"tools[{names.index(dup, names.index(dup) + 1)}]"
                           ".function.name")
    spec = ToolSpec(functions, parallel=True if parallel is None else parallel)
    if choice is None or choice in ("none", "auto", "required"):
        spec.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in names:
            raise RequestError(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                               f"(declared: {', '.join(names)})", "tool_choice.function.name")
        spec.choice, spec.named = "named", name
    else:
        raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return spec


def _function(tool, where: str) -> dict:
    if not isinstance(tool, dict):
        raise RequestError(f"{where} must be an object", where)
    if tool.get("type", "function") != "function":
        raise RequestError(f"{where}.type must be 'function'", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{where}.function must be an object with a 'name'", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise RequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.'",
                           f"{where}.function.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise RequestError(f"{where}.function.description must be a string", f"{where}.function.description")
    if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
        raise RequestError(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
    params = fn.get("parameters")
    param = f"{where}.function.parameters"
    params = _EMPTY_PARAMS if params is None else params
    if not isinstance(params, dict) or params.get("type", "object") not in ("object", ["object"]):
        raise RequestError(f"{param} must be a JSON schema of an object", param)
    _check_schema(params, param)
    out = {"name": name, "parameters": params}
    if desc:
        out["description"] = desc
    return out


def _check_schema(schema: dict, param: str) -> None:
    check_schema_shape(schema, param, keywords=False)  # before json and jsonschema recurse into it
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError):
        raise RequestError(f"{param} is not JSON", param) from None
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise RequestError(f"{param} is larger than {MAX_SPEC_BYTES} bytes", param)
    # The meta-schema check in Rust: the pure-Python jsonschema took 2 s of GIL for 128 tools of 100 properties,
    # and every stream's step waited on the GIL meanwhile; this takes milliseconds. xgrammar catches the rest.
    draft = schema.get("$schema")
    if draft is not None and (not isinstance(draft, str) or draft.rstrip("#").replace("https:", "http:") not in DRAFTS):
        # An unknown $schema is a URL the validator would fetch: never, from a request.
        raise RequestError(f"{param}.$schema must be one of the JSON-schema drafts: {', '.join(sorted(DRAFTS))}",
                           param)
    try:
        import jsonschema_rs
    except ImportError:  # a bare image without it: xgrammar's compile is then the only check
        return
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as e:
        reason = str(e).split("\n", 1)[0]
        raise RequestError(f"{param} is not a valid JSON schema: {reason}", param) from None
    except (jsonschema_rs.ReferencingError, ValueError) as e:  # an unknown $schema draft, say
        raise RequestError(f"{param} is not a usable JSON schema: {str(e).splitlines()[0]}", param) from None


# ---- the plan: template path, parser, constraint ------------------------------------------------------

@dataclass(slots=True)
class ToolPlan:
    """How one chat request's tools reach the prompt and how its reply is read."""

    spec: ToolSpec | None
    native: bool  # the chat template renders tools and tool calls itself
    parser: str  # what reads the reply: "constrained" (it is the JSON the grammar allowed) or a parser name

    @property
    def active(self) -> bool:
        return self.spec is not None and self.spec.active


def template_text(tokenizer) -> str:
    tpl = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(tpl.values()) if isinstance(tpl, dict) else str(tpl)


def detect_parser(template: str) -> str:
    """The output format a tool-aware chat template implies."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "json"


def plan_tools(req, tokenizer, parser_flag: str = "auto") -> ToolPlan:
    """Decide the path for a chat request and set its reply constraint (and special-token handling) on
    `req.params`; `req` is the GenerateRequest."""
    spec = req.tools
    template = template_text(tokenizer)
    native = "tools" in template
    if spec is None or not spec.active:
        return ToolPlan(spec, native, "none")
    if spec.forced or not native:
        answered = () if spec.forced else just_answered(req.messages)
        schema = reply_schema(spec, native, answered)
        req.params.structured_output = StructuredOutput("json", json.dumps(schema), "tools")
        return ToolPlan(spec, native, "constrained")
    parser = parser_flag if parser_flag != "auto" else detect_parser(template)
    if parser in ("mistral", "llama3_json"):  # their markers are special tokens: keep them in the text
        req.params.skip_special_tokens = False
    return ToolPlan(spec, native, parser)


def _call_schema(fn: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def just_answered(messages: list[dict]) -> set[str]:
    """Functions whose results end the conversation (the tool messages after the last assistant turn)."""
    ids = set()
    for m in reversed(messages):
        if m["role"] != "tool":
            calls = m.get("tool_calls") or [] if m["role"] == "assistant" else []
            return {c["function"]["name"] for c in calls if c["id"] in ids}
        ids.add(m.get("tool_call_id"))
    return set()


def reply_schema(spec: ToolSpec, native: bool, answered=()) -> dict:
    """The JSON schema a forced or prompted reply is held to. A prompted `auto` reply right after tool results
    may not call the functions that were just answered (models without tool training repeat the call forever);
    a client that wants that call again forces it with tool_choice."""
    allowed = [f for f in spec.functions if spec.choice != "named" or f["name"] == spec.named]
    if spec.choice == "auto":
        allowed = [f for f in allowed if f["name"] not in answered]
    calls = [_call_schema(f) for f in allowed]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    many = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if calls else None
    if spec.choice == "named" or (spec.choice == "required" and not spec.parallel):
        return one
    if spec.choice == "required":
        return many
    answer = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
              "additionalProperties": False}
    return {"anyOf": [*calls, *([many] if spec.parallel and calls else []), answer]} if calls else answer


# ---- rendering the conversation -------------------------------------------------------------------------

def template_args(plan: ToolPlan, messages: list[dict]) -> tuple[list[dict], dict]:
    """The messages and extra keyword arguments for `tokenizer.apply_chat_template`."""
    if plan.native:
        kwargs = {"tools": [{"type": "function", "function": f} for f in plan.spec.functions]} if plan.active else {}
        return [_native_message(m) for m in messages], kwargs
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not plan.active and not has_history:
        return messages, {}
    out = _text_messages(messages) if has_history else [dict(m) for m in messages]
    if plan.active:
        prompt = system_prompt(plan.spec)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + prompt).strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _native_message(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        try:  # templates render arguments with `| tojson`: they want the object, not its text
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = c["function"]["arguments"]
        calls.append({"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                      "arguments": args}})
    return {**m, "tool_calls": calls}


def call_json(name: str, arguments: str) -> str:
    """A call as the prompted path's model writes it."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def _text_messages(messages: list[dict]) -> list[dict]:
    """History calls as the JSON the model would have written, tool results as user turns."""
    names, out = {}, []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [call_json(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"])
            text = calls[0] if len(calls) == 1 else "[" + ", ".join(calls) + "]"
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id") or "?"
            who = f"{names[call_id]} ({call_id})" if call_id in names else call_id
            text = f"Tool result of {who}: {m['content']}"
            if out and out[-1].get("_tool"):  # parallel results: one user turn, templates want alternation
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_call_id"})
    return [{k: v for k, v in m.items() if k != "_tool"} for m in out]


def system_prompt(spec: ToolSpec) -> str:
    """The tools described for a model whose template knows nothing of them."""
    lines = ["You have access to these tools (each with the JSON schema of its arguments):"]
    lines += [json.dumps(f, ensure_ascii=False) for f in spec.functions]
    call = '{"name": "<tool name>", "arguments": {<the arguments>}}'
    if spec.choice == "named":
        lines.append(f'\nCall the tool "{spec.named}". Reply with the call as one JSON object: {call}')
    elif spec.choice == "required":
        lines.append(f"\nCall a tool. Reply with the call as one JSON object: {call}")
        if spec.parallel:
            lines.append("To call several tools at once, reply with a JSON array of such objects.")
    else:
        lines.append("\nReply with JSON only, in one of these forms:")
        lines.append(f"- to call a tool: {call}")
        if spec.parallel:
            lines.append("- to call several tools at once: a JSON array of such objects")
        lines.append('- to answer the user directly: {"content": "<your answer>"}')
        lines.append("Call a tool when you need its result. Once you have the tool results, answer with "
                     '{"content": ...}.')
    return "\n".join(lines)
