"""Chat templates: the real SmolLM2 template from its GGUF and a recorded Qwen2.5-style tools template,
rendered in the sandbox as transformers renders them."""

from __future__ import annotations

import asyncio
import time

import pytest

from localserve.errors import InvalidRequestError
from localserve.store.gguf_facts import read_gguf_facts
from localserve.api.templates import CHATML_TEMPLATE, RENDER_TIME_LIMIT_S, ChatTemplate
from localserve.api.validation import parse_messages

# Qwen2.5-Instruct's tokenizer_config.json chat_template (the tools part as published), recorded.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city (°C)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> ChatTemplate:
    facts = read_gguf_facts(smollm2_gguf)
    assert facts.chat_template
    return ChatTemplate.for_model(facts.chat_template, None, None)


def test_smollm2_template_renders_chatml_with_default_system(smollm2):
    text = smollm2.render([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = smollm2.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    own_system = smollm2.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert own_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert not smollm2.supports_tools


def test_template_without_tools_support_gets_tools_in_system_prompt(smollm2):
    text = smollm2.render([{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert "°C" in text  # tojson keeps non-ASCII as the model was trained on it


def test_qwen25_tools_template(smollm2):
    template = ChatTemplate.for_model(QWEN25_TEMPLATE, None, "<|im_end|>")
    assert template.supports_tools
    messages = parse_messages([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
    ])
    text = template.render(messages, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city (°C)"' in text
    # The arguments string became an object, so the template's `tojson` prints JSON, not a quoted string.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 3}\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = template.render([{"role": "user", "content": "Hi"}])
    assert "# Tools" not in plain


def test_raise_exception_becomes_invalid_request():
    source = ("{% for m in messages %}{% if m['role'] == 'user' and loop.index0 % 2 == 1 %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{{ m['content'] }}{% endfor %}")
    template = ChatTemplate.for_model(source, "<s>", "</s>")
    with pytest.raises(InvalidRequestError) as e:
        template.render([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}])
    assert "roles must alternate" in e.value.message and e.value.param == "messages"


def test_sandbox_blocks_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequestError):
        ChatTemplate.for_model(evil, None, None).render([{"role": "user", "content": "x"}])
    mutate = "{% set x = messages.append({'role': 'user'}) %}{{ messages | length }}"
    with pytest.raises(InvalidRequestError):
        ChatTemplate.for_model(mutate, None, None).render([{"role": "user", "content": "x"}])


def test_globals_hf_templates_use():
    source = ("{{ bos_token }}{{ strftime_now('%Y') | length }}|{{ {'a': 'é<'} | tojson }}|"
              "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}")
    text = ChatTemplate.for_model(source, "<s>", "</s>").render(
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    assert text == '<s>4|{"a": "é<"}|one'


def test_fallback_chatml_and_broken_template():
    fallback = ChatTemplate.for_model(None, None, None)
    assert fallback.is_fallback and fallback.source == CHATML_TEMPLATE
    assert fallback.render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert fallback.stops == ["<|im_end|>", "<|im_start|>"]  # a model without a template writes them as text
    assert ChatTemplate.for_model(CHATML_TEMPLATE, None, None).stops == []  # its own: the model's end tokens end it
    with pytest.raises(InvalidRequestError) as e:
        ChatTemplate.for_model("{% for x in %}", None, None).render([{"role": "user", "content": "x"}])
    assert "cannot be compiled" in e.value.message


def test_messages_are_normalised():
    messages = parse_messages([
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi"},
    ])
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for bad, param in [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            parse_messages(bad)
        assert e.value.param == param


# --- render limits: hostile templates from a pulled GGUF -------------------------------------------
HOSTILE = {
    "huge range": "{% for i in range(10**9) %}x{% endfor %}",
    "nested loops printing": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "nested loops silent": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loops over a string": "{% for i in 'x' * 100000 %}{% for j in 'x' * 100000 %}{% endfor %}{% endfor %}",
    "string times 10**9": "{{ 'x' * 10**9 }}",
    "huge power": "{{ 10 ** 100000000 }}",
    "ljust": "{{ 'x'.ljust(10**9) }}",
    "center filter": "{{ 'x' | center(10**9) }}",
    "format width": "{{ '{:>1000000000}'.format('x') }}",
    "percent width": "{{ '%1000000000s' % 'x' }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "joined list": "{{ (['x' * 1000000] * 100) | join }}",
    "endless recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("name", HOSTILE)
async def test_hostile_template_is_a_400_naming_the_model(name):
    template = ChatTemplate.for_model(HOSTILE[name], None, None, model="evil:q4")
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError) as e:
        await template.render_async([{"role": "user", "content": "x"}])
    assert time.monotonic() - t0 < RENDER_TIME_LIMIT_S + 5  # liveness: the render stopped itself
    assert e.value.http_status == 400 and e.value.param == "messages"
    assert e.value.message.startswith("the chat template of evil:q4 ")
    assert "Traceback" not in e.value.message and "jinja" not in e.value.message.lower()


async def test_render_runs_off_the_event_loop():
    template = ChatTemplate.for_model(HOSTILE["nested loops silent"], None, None)
    render = asyncio.ensure_future(template.render_async([{"role": "user", "content": "x"}]))
    ticks = 0
    while not render.done():
        await asyncio.sleep(0.01)
        ticks += 1
    with pytest.raises(InvalidRequestError):
        render.result()
    assert ticks >= 20  # the loop kept running during the (>= 2 s) render, not blocked by it


async def test_real_templates_render_the_same_through_the_limits(smollm2):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Weather?"}]
    assert await smollm2.render_async(messages) == smollm2.render(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    # What loops over checked iterators must still offer: loop.length/last, filters on ranges, `~`.
    source = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m.role[0] }}{% if loop.last %}!{% endif %}"
              "{% endfor %}{{ range(3) | list }}{{ 'a' ~ 'b' }}{{ '%s-%d' % ('x', 2) }}{{ '{}'.format(7) }}")
    assert await ChatTemplate.for_model(source, None, None).render_async(messages) == "1/3u2/3a3/3u![0, 1, 2]abx-27"
    big = "y" * (1 << 20)  # a megabyte message is no reason to refuse
    assert big in await smollm2.render_async([{"role": "user", "content": big}])
