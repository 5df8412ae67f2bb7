"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them (issue 49): templates in the style
of each family we serve, with tools and without, and the features real templates lean on (``{% break %}``,
``strftime_now``, ``namespace``, ``tojson`` options, ``raise_exception``, None-valued message keys, named special
tokens). The templates are written here; each uses what the family's published template uses."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.text.tokenization import PromptTokenizer

pytestmark = pytest.mark.fast

LLAMA3 = """{{- bos_token }}{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|im_start|>system\\nToday Date: " + date_string + "\\n" }}
{%- if tools is not none %}{{- "You may call these functions:\\n" }}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}{%- endif %}
{{- system_message }}{{- "<|im_end|>" }}
{%- for message in messages %}
{%- if 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}
{{- '<|im_start|>assistant\\n{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}<|im_end|>' }}
{%- elif message.role == "tool" %}{{- "<|im_start|>ipython\\n" + message.content | tojson + "<|im_end|>" }}
{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

QWEN3 = """{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- break %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}{%- set reasoning = message.reasoning_content | default('') %}
{{- '<|im_start|>assistant\\n' }}{%- if loop.index0 > ns.last_query_index and reasoning %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content | default('') }}
{%- for tool_call in message.tool_calls | default([]) %}{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""

DEEPSEEK = """{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true) %}
{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}
{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<|im_start|>User:' + message['content']}}
{%- elif message['role'] == 'assistant' and message['content'] is not defined %}{%- set ns.is_tool = false -%}
{%- for tool in message['tool_calls'] %}{{'<|im_start|>call:' + tool['function']['name'] + '\\n' + tool['function']['arguments'] | tojson(sort_keys=true, separators=(',', ':')) + '<|im_end|>'}}{%- endfor %}
{%- elif message['role'] == 'assistant' %}{{'<|im_start|>Assistant:' + message['content'] + '<|im_end|>'}}
{%- elif message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{{'<|im_start|>output:' + message['content'] + '<|im_end|>'}}{%- endif %}
{%- endfor -%}
{% if add_generation_prompt and not ns.is_tool %}{{'<|im_start|>Assistant:'}}{% endif %}"""

GEMMA3 = """{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}
{%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
{{ '<|im_start|>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
{%- if message['content'] is string -%}{{ message['content'] | trim }}
{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}
{{ '<|im_end|>\\n' }}{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>model\\n' }}{%- endif -%}"""

MISTRAL = """{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}{%- for message in messages %}
{%- if message["role"] == "user" %}{%- if tools is not none and (message == user_messages[-1]) %}{{- "[AVAILABLE_TOOLS] " + (tools | tojson) + "[/AVAILABLE_TOOLS]" }}{%- endif %}
{{- "[INST] " + message["content"] + "[/INST]" }}
{%- elif message["role"] == "assistant" and message.tool_calls is defined %}{{- "[TOOL_CALLS] " + (message.tool_calls | map(attribute="function") | list | tojson) + eos_token }}
{%- elif message["role"] == "assistant" %}{{- " " + message["content"] + eos_token }}
{%- elif message["role"] == "system" %}{{- "[SYSTEM_PROMPT]" + message["content"] + "[/SYSTEM_PROMPT]" }}
{%- elif message["role"] == "tool" %}{{- '[TOOL_RESULTS] ' + dict(content=message.content, id=message.tool_call_id | default("")) | tojson + '[/TOOL_RESULTS]' }}
{%- else %}{{- raise_exception("Only user, assistant and tool roles are supported, got " + message["role"] + ".") }}{%- endif %}
{%- endfor %}"""

TEMPLATES = {"llama": LLAMA3, "qwen3": QWEN3, "deepseek": DEEPSEEK, "gemma3": GEMMA3, "mistral": MISTRAL}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}]
PLAIN = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]
WITH_TOOLS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
              {"role": "user", "content": "And tomorrow?"}]


def _folder(tiny_tokenizer_dir: Path, tmp_path: Path, template: str) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_every_family_style_renders_as_transformers_does(family: str, tiny_tokenizer_dir: Path,
                                                         tmp_path: Path) -> None:
    folder = _folder(tiny_tokenizer_dir, tmp_path, TEMPLATES[family])
    ours, ref = PromptTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    cases: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
        (chat, None, {}) for chat in PLAIN]
    if family != "gemma3":  # its template has no tool roles
        cases.append((WITH_TOOLS, TOOLS, {}))
    if family == "qwen3":
        cases.append((PLAIN[1], None, {"enable_thinking": False}))
    for chat, tools, kwargs in cases:
        want = ref.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours.render_chat(chat, tools=tools, **kwargs) == want
        assert ours.encode_chat(chat, tools=tools, **kwargs) == ref.encode(want, add_special_tokens=False)


def test_a_template_refusal_is_a_value_error_naming_it(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    ours = PromptTokenizer(_folder(tiny_tokenizer_dir, tmp_path, GEMMA3))
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_template_that_does_not_parse_fails_at_load(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chat template: TemplateSyntaxError"):
        PromptTokenizer(_folder(tiny_tokenizer_dir, tmp_path, "{% for m in messages %}{{ m.content }}"))
