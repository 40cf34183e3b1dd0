"""Chat templates: GGUF templates and the built-in ones rendered like HF transformers renders them."""

from __future__ import annotations

import pytest

from quanta.errors import QuantaError
from quanta.tokenizer import ChatTemplate, ChatTemplateError
from quanta.tokenizer.chat_template import CHATML_TEMPLATE

render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template

# Gemma 3's template as published with google/gemma-3-*-it (text parts only): the reference for our built-in.
OFFICIAL_GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  What is 2+2?  "}],
    [{"role": "system", "content": "Système: réponds en français 🇫🇷"}, {"role": "user", "content": "Bonjour"},
     {"role": "assistant", "content": "Salut !"}, {"role": "user", "content": "Ça va ?\n\nDis-moi."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}],
]


def _reference(template: str, messages, add_generation_prompt: bool, bos: str, eos: str) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=add_generation_prompt,
                                        bos_token=bos, eos_token=eos)
    return rendered[0]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_template_renders_like_transformers(tokenizers, messages, add_generation_prompt):
    tok = tokenizers["smollm2"]
    assert tok.has_chat_template
    expected = _reference(tok.chat_template, messages, add_generation_prompt, "<|im_start|>", "<|im_end|>")
    assert tok.apply_chat_template(messages, add_generation_prompt) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_builtin_matches_the_official_template(tokenizers, messages, add_generation_prompt):
    tok = tokenizers["gemma3"]
    assert not tok.has_chat_template
    expected = _reference(OFFICIAL_GEMMA3, messages, add_generation_prompt, "<bos>", "<eos>")
    assert tok.apply_chat_template(messages, add_generation_prompt) == expected


def test_chatml_fallback(tokenizers):
    tok = tokenizers["synth-qwen2"]
    assert not tok.has_chat_template
    messages = CONVERSATIONS[2]
    assert tok.apply_chat_template(messages) == _reference(CHATML_TEMPLATE, messages, True, "", "")
    ids = tok.encode_chat(messages)
    assert ids.count(tok.vocab.token_to_id["<|im_start|>"]) == len(messages) + 1


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_encode_chat_parses_specials_and_adds_one_bos(name, tokenizers, reference):
    tok, ref = tokenizers[name], reference(name)
    messages = CONVERSATIONS[2]
    text = tok.apply_chat_template(messages)
    ids = tok.encode_chat(messages)
    expected = ref.tokenize(text, add_special=not text.startswith(tok.token_text("bos")), parse_special=True)
    assert ids == expected
    if tok.add_bos:
        assert ids[0] == tok.bos_id and ids[1] != tok.bos_id


def test_tools_and_helpers_are_available():
    template = ChatTemplate("{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}{{ eos_token }}")
    out = template.render([], tools=[{"name": "f", "description": "ünï"}], bos_token="<s>", eos_token="</s>")
    assert out == '[{"name": "f", "description": "ünï"}]|4|<s></s>'


def test_raise_exception_and_bad_syntax_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[5]['content'] + 1 }}").render([])
    assert issubclass(ChatTemplateError, QuantaError)


# Written here to use every construct the sandbox bounds (generators joined, namespaces, macros, set blocks,
# formatting, tojson with indent, literals, the generation tag), as tool-calling templates do.
FEATURES_TEMPLATE = """{%- macro render_tool(tool) -%}
{{ '%-8s|%5.1f' % (tool.function.name, 2.5) }} {{ '{:>6}'.format(tool.type) }}
{{ tool.function.parameters | tojson(indent=2) | indent(4) }}
{%- endmacro -%}
{%- set ns = namespace(system='', seen=[], count=0) -%}
{%- for m in messages if m.role == 'system' %}{% set ns.system = ns.system ~ m.content %}{% endfor -%}
{%- if tools %}{% set listing %}{% for t in tools %}{{ render_tool(t) }}{{ '\n' if not loop.last }}{% endfor %}{% endset %}
{{- '<tools>\n' + listing + '\n</tools>\n' }}{% endif -%}
{{- ns.system | center(20) if ns.system }}
{%- for m in messages | rejectattr('role', 'equalto', 'system') %}
{%- set ns.seen = ns.seen + [m.role] %}{% set ns.count = ns.count + m.content | length %}
{%- if m.role == 'assistant' %}<a>{% generation %}{{ m.content | trim }}{% endgeneration %}</a>
{%- else %}<{{ m.role[:1] }}>{{ m.content | wordwrap(12) }}</{{ m.role[:1] }}>{% endif %}
{%- endfor %}
{{- '\n' ~ (ns.seen | unique | map('upper') | join(',')) ~ ' ' ~ ns.count ~ ' ' ~ {'n': ns.seen | length} | tojson }}
{{- ' ' ~ (range(3) | map('string') | list) ~ ' ' ~ ([1, 2] * 2) | sum ~ ' ' ~ 'ab' * 3 ~ ' ' ~ 2 ** 10 }}
{%- if add_generation_prompt %}<a>{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_bounded_constructs_render_like_transformers(messages, tools):
    rendered, _ = render_jinja_template([messages], chat_template=FEATURES_TEMPLATE, tools=tools,
                                        add_generation_prompt=True)
    assert ChatTemplate(FEATURES_TEMPLATE).render(messages, tools=tools) == rendered[0]
