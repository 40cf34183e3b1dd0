"""Hostile chat templates (a GGUF is untrusted input) fail with ChatTemplateError and leave no trace."""

from __future__ import annotations

import time

import pytest

from quanta.tokenizer import ChatTemplate, ChatTemplateError

MARKER = "/tmp/quanta-template-pwned"

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__()[0].__init__.__globals__['sys'].modules['os'].system('touch MARKER') }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{{ strftime_now.__globals__.datetime }}",
    "{{ messages.__class__.__init__ }}",
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ open('/etc/passwd').read() }}",
    "{{ __import__('os').system('touch MARKER') }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os.system('touch MARKER') }}",
    "{% extends '/etc/passwd' %}",
    "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
    "{% set x = messages[0].update({'content': 'changed'}) %}",
    "{{ messages[0].pop('content') }}",
    "{{ (messages|attr('__class__')).__mro__ }}",
    "{{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "{{ 'os'|format.__globals__ }}",
]

BOMBS = [
    "{{ 'a' * 10 ** 10 }}",
    "{{ 'ab' * 100000 * 100000 }}",
    "{{ [0] * 1000000000 }}",
    "{{ 10 ** 100000 }}",
    "{{ (10 ** 1000) ** 1000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '%999999999d'|format(1) }}",
    "{{ 'x'|indent(1000000000) }}",
    "{{ range(1000000000)|list }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% set s = 'a' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 10000000 %}{{ s|replace('x', s) }}",
    "{% set s = 'x' * 10000000 %}{{ s.replace('x', s) }}",
    "{% set s = 'x' * 10000000 %}{{ ([s] * 100000)|join }}",
    "{% set s = 'x' * 10000000 %}{{ s.join([s, s, s]) }}",
    "{% set s = 'x' * 10000000 %}{{ [s] * 100000 }}",
    "{% set s = 'x' * 10000000 %}{{ {'a': s, 'b': s} ~ s }}",
]


@pytest.fixture()
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield str(path)
    assert not path.exists(), "a template produced a side effect"


def _messages():
    return [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_escapes_fail_cleanly(source, marker):
    messages = _messages()
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source.replace("MARKER", marker)).render(messages)
    assert messages == _messages(), "a template mutated its input"


@pytest.mark.parametrize("source", BOMBS)
def test_resource_bombs_are_bounded(source):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, time_limit=1.0).render(_messages())
    assert time.monotonic() - start < 3.0


def test_error_messages_say_what_happened():
    with pytest.raises(ChatTemplateError, match="unsafe|refused"):
        ChatTemplate("{{ ''.__class__ }}").render([])
    with pytest.raises(ChatTemplateError, match="longer than"):
        ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     time_limit=0.2).render([])
