"""Hostile chat templates that try to exhaust time, memory or the compiler fail fast with ChatTemplateError.

Each payload runs in its own forked process with an address-space and CPU limit (``template_probe.py``), so a
payload that escapes the limits shows up as a failure here instead of taking the test run down with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TIME_LIMIT = 0.5  # the render budget given to each payload
MAX_SECONDS = 4.0  # the budget plus slack for a loaded machine
MAX_RSS_MIB = 96  # what a payload may add to the process's peak resident memory

BIG = "{% set s = 'x' * 4000000 %}"
NS = "{% set ns = namespace(s='ab', l=[0], d={'a': 1}, t=(1,), x=3) %}"

TIME = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% if i == j %}{% endif %}{% endfor %}{% endfor %}",
    "{% for a in range(10) %}" * 10 + "{% endfor %}" * 10,
    "{% set s = 'a' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}",
    BIG + "{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}",
    NS + "{% for i in range(60) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    NS + "{% for i in range(60) %}{% set ns.x = ns.x ** 2 %}{% endfor %}",
    NS + "{% for i in range(60) %}{% set ns.x = ns.x * ns.x * ns.x %}{% endfor %}",
    NS + "{% for i in range(100000) %}{% for j in range(1000) %}{% set ns.x = ns.x + 1 %}{% endfor %}{% endfor %}",
    "{{ 9 ** (9 ** 9) }}",
    "{{ (10 ** 1000) ** 1000 }}",
    "{{ 2 ** 70000 }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% macro f(n) %}{{ g(n) }}{% endmacro %}{% macro g(n) %}{{ f(n) }}{% endmacro %}{{ f(0) }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% macro f(n) %}{% if n > 0 %}{% for i in range(3) %}{{ f(n - 1) }}{% endfor %}{% endif %}{% endmacro %}"
    "{{ f(40) }}",
    "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    "{% for x in range(10) recursive %}{{ loop(range(10)) }}{% endfor %}",
    "{% for x in range(100000) recursive %}{% if x < 3 %}{{ loop(range(100000)) }}{% endif %}{% endfor %}",
    BIG + "{% for i in range(100000) %}{% if s == s ~ '' %}{% endif %}{% endfor %}",
    BIG + "{% for i in range(100000) %}{% set t = s.replace('x', 'y') %}{% endfor %}",
    BIG + "{% for i in range(100000) %}{{ s.count('x') }}{% endfor %}",
    BIG + "{% for i in range(100000) %}{% set t = s|upper %}{% endfor %}",
    BIG + "{% for i in range(100000) %}{% set t = s|tojson %}{% endfor %}",
    "{% for i in range(100000) %}{% set t = range(100000)|list|sort|join(',') %}{% endfor %}",
    "{{ range(100000)|map('string')|map('list')|sum(start=[]) }}",
    "{{ range(1000)|map('string')|map('list')|sum(start=[])|length }}" * 100,
    "{% set l = range(100000)|list %}{% for i in range(100000) %}{% set t = l|unique|list %}{% endfor %}",
    "{{ ('<' * 60000)|striptags }}" * 100,
    "{{ ('a ' * 30000)|wordwrap(1) }}" * 100,
    "{{ ('a.b ' * 16000)|urlize }}" * 100,
    "{{ ('a ' * 30000)|title }}" * 100,
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ loop.cycle('a', 'b') }}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '%d' % j }}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '{}'.format(j) }}{% endfor %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = [i, j] %}{% endfor %}{% endfor %}",
]

MEMORY = [
    "{{ '%999999999d' % 1 }}",
    "{{ '%*d' % (999999999, 1) }}",
    "{{ '%.999999999f' % 1.0 }}",
    "{{ '%(a)999999999s' % {'a': 1} }}",
    "{{ ('%99999s' * 100) % ((1,) * 100) }}",
    BIG + "{{ '%s%s%s%s%s' % (s, s, s, s, s) }}",
    "{{ '%999999999d'|format(1) }}",
    BIG + "{{ ('%s' * 5)|format(s, s, s, s, s) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '{:{w}}'.format(1, w=999999999) }}",
    "{{ '{0:{0}}'.format(999999999) }}",
    "{{ '{:.999999999f}'.format(1.5) }}",
    "{{ '{:>999999999}'.format_map({}) }}",
    "{{ ('{0:99999}' * 100).format(1) }}",
    BIG + "{{ ('{0}' * 100).format(s) }}",
    BIG + "{{ '{0!r}{0!r}'.format([s]) }}",
    "{{ 'x'|center(999999999) }}",
    "{{ 'x'.center(999999999) }}",
    "{{ 'x'.ljust(999999999) }}",
    "{{ 'x'.rjust(999999999) }}",
    "{{ 'x'.zfill(999999999) }}",
    "{{ ('\\t' * 100000).expandtabs(100000) }}",
    "{{ (1).to_bytes(999999999, 'big') }}",
    "{{ 'a' * 10 ** 10 }}",
    "{{ 'ab' * 100000 * 100000 }}",
    "{{ [0] * 1000000000 }}",
    "{{ [[0] * 100000] * 100000 }}",
    "{{ (('a',) * 100000) * 100000 }}",
    BIG + "{{ [s] * 100000 }}",
    NS + "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.s = ns.s * 2 %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.l = ns.l * 2 %}{% endfor %}",
    NS + "{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l|tojson }}",
    NS + "{% for i in range(64) %}{% set ns.t = (ns.t, ns.t) %}{% endfor %}{{ ns.t }}",
    NS + "{% for i in range(64) %}{% set ns.d = {'a': ns.d, 'b': ns.d} %}{% endfor %}{{ ns.d|string }}",
    NS + "{% for i in range(64) %}{% set ns.d = dict(a=ns.d, b=ns.d) %}{% endfor %}{{ ns.d }}",
    NS + "{% for i in range(64) %}{% set ns.l = [ns, ns] %}{% endfor %}{{ ns }}",
    NS + "{% set ns.me = ns %}{{ [ns] }}",
    "{{ [1]|tojson(indent=999999999) }}",
    "{{ [[[[1]]]]|tojson(indent='x' * 100000) }}",
    BIG + "{{ range(1000)|list|tojson(separators=(s, s)) }}",
    "{{ ('a ' * 1000000)|wordwrap(1) }}",
    "{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100000) }}",
    "{{ 'x'|indent(999999999) }}",
    "{{ ('\\n' * 100000)|indent(100000, true, true) }}",
    "{{ ('\\n' * 100000)|indent('x' * 100000, true, true) }}",
    BIG + "{{ s.join(range(100000)|map('string')) }}",
    BIG + "{{ range(100000)|map('string')|join(s) }}",
    "{{ range(100000)|map('center', 100000)|join }}",
    "{{ range(100000)|map('center', 100000)|list }}",
    "{{ range(100000)|map('center', 100000)|sort }}",
    "{{ dict(range(100000)|map('center', 100000)|batch(2)) }}",
    "{% for x in range(100000)|map('center', 100000) %}{{ x }}{% endfor %}",
    BIG + "{{ s|replace('', s) }}",
    BIG + "{{ s.replace('x', s) }}",
    BIG + "{{ s|replace('x', 'yy') }}",
    BIG + "{{ s.translate(s.maketrans({'x': 'y' * 100000})) }}",
    BIG + "{{ s|list }}",
    "{{ range(1000000000)|list }}",
    "{{ range(100000)|list * 1000 }}",
    BIG + "{{ dict.fromkeys(range(100000), s) }}",
    "{{ [1]|batch(999999999, 'x')|list }}",
    "{{ [1]|slice(999999999, 'x')|list }}",
    BIG + "{{ [1]|batch(100000, s)|list }}",
    "{% for i in range(100000) %}{{ 'x' * 200 }}{% endfor %}",
    NS + "{% for i in range(40) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}",
    "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}" + NS +
    "{% for i in range(40) %}{% set ns.s = d(ns.s) %}{% endfor %}",
    "{% macro m() %}{% for i in range(100000) %}{% for j in range(100) %}xxxxxxxxxx{% endfor %}{% endfor %}"
    "{% endmacro %}{{ m() }}",
    BIG + "{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endmacro %}{% set x = m() %}",
    BIG + "{% set x %}{% for i in range(100000) %}{{ s ~ i }}{% endfor %}{% endset %}",
    BIG + "{% filter upper %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endfilter %}",
    "{% macro w() %}{{ caller() }}{{ caller() }}{% endmacro %}" + NS +
    "{% for i in range(40) %}{% call w() %}{{ ns.s }}{% endcall %}{% endfor %}" +
    "{% for i in range(40) %}{% set ns.s %}{% call w() %}{{ ns.s }}{% endcall %}{% endset %}{% endfor %}",
    "{{ strftime_now('%999999999Y') }}",
    "{{ strftime_now('%c' * 1000000) }}",
    "{{ messages * 100000000 }}",
    BIG + "{{ s|escape }}{{ (s ~ '&')|replace('x', '&')|e }}",
    BIG + "{% for i in range(100000) %}{% set x = [s ~ i] %}{% endfor %}",
    BIG + "{% for i in range(100000) %}{% set x = {'k': s ~ i} %}{% set y = dict(k=s ~ i) %}{% endfor %}",
    BIG + "{% for i in range(100000) %}{% set x = namespace(k=s ~ i) %}{% set y = (s ~ i,) %}{% endfor %}",
    BIG + "{{ [s] ~ [s] }}",
    BIG + "{{ (s, s, s, s, s) }}",
    BIG + "{{ {'a': s, 'b': s} }}",
]

NESTING = [
    "{% if true %}" * 300 + "x" + "{% endif %}" * 300,
    "{% if true %}" * 1000 + "x" + "{% endif %}" * 1000,
    "{% if true %}" * 60 + "x" + "{% endif %}" * 60,
    "{% for i in [1] %}" * 30 + "x" + "{% endfor %}" * 30,
    "{% for i in [1] %}" * 21 + "x" + "{% endfor %}" * 21,
    "{% for i in [1] %}" * 13 + "x" + "{% endfor %}" * 13,
    "{% with %}" * 200 + "x" + "{% endwith %}" * 200,
    "{% filter upper %}" * 200 + "x" + "{% endfilter %}" * 200,
    "{% set x %}" * 200 + "x" + "{% endset %}" * 200,
    "".join(f"{{% macro m{i}() %}}" for i in range(200)) + "x" + "{% endmacro %}" * 200,
    "".join(f"{{% block b{i} %}}" for i in range(200)) + "x" + "{% endblock %}" * 200,
    "{% macro w() %}{{ caller() }}{% endmacro %}" + "{% call w() %}" * 200 + "x" + "{% endcall %}" * 200,
    "{{ " + "(" * 1000 + "1" + ")" * 1000 + " }}",
    "{{ " + "(" * 150 + "1" + ")" * 150 + " }}",
    "{{ " + "[" * 300 + "]" * 300 + " }}",
    "{{ " + "{'a': " * 300 + "1" + "}" * 300 + " }}",
    "{{ " + " + ".join(["'a'"] * 2000) + " }}",
    "{{ " + " ~ ".join(["'a'"] * 20000) + " }}",
    "{{ 'a'" + "|upper" * 1000 + " }}",
    "{{ x" + ".y" * 1000 + " }}",
    "{{ x" + "[0]" * 1000 + " }}",
    "{{ " + "1 if true else (" * 300 + "1" + ")" * 300 + " }}",
    "{{ " + "f(" * 300 + ")" * 300 + " }}",
    "{{ " + "not " * 2000 + "true }}",
    "{{ " + "-" * 2000 + "1 }}",
    "{{ 1" + " and 1" * 2000 + " }}",
    "{% for i in [1] %}{% if true %}" * 13 + "x" + "{% endif %}{% endfor %}" * 13,
    "{{ " + "[1, " * 300 + "1" + "]" * 300 + "|tojson }}",
    "{% if " + "(" * 500 + "true" + ")" * 500 + " %}x{% endif %}",
    "{% for i in " + "(" * 500 + "[1]" + ")" * 500 + " %}x{% endfor %}",
    "{% set x = " + "[" * 500 + "]" * 500 + " %}",
    "x" * 300000,
    "{{ a }}" * 20000,
    "{{ a.b.c + d[0] ~ e|upper }}" * 2300,
    "{{a}}" * 13000,
    "{{ 'x'|center(100000) }}" * 1000,  # Jinja folds filters of constants while compiling
    "{{ ('x'|center(100000)) ~ ('x'|center(100000)) }}" * 300,
    "{% set x = 'x'|center(100000)|replace(' ', 'yy') %}{{ x }}" * 100,
]

MALFORMED = [
    "{% for m in messages %}",
    "{{ ",
    "{% endif %}",
    "{{ 1 +* 2 }}",
    "{% set 1 = 2 %}",
    "{% break %}",
    "{% macro %}{% endmacro %}",
    "{{ x|nosuchfilter }}",
    "{% if x is nosuchtest %}{% endif %}",
    "{% include 'a' %}",
    "{% import 'a' as a %}",
    "{% extends 'a' %}",
    "{% from 'a' import b %}",
    "{{ 1 / 0 }}",
    "{{ 1 // 0 }}",
    "{{ 1 % 0 }}",
    "{{ 'a' + 1 }}",
    "{{ [] + {} }}",
    "{{ none.x.y }}",
    "{{ nosuchfunction() }}",
    "{{ messages() }}",
    "{{ 'a' - 'b' }}",
    "{{ 10.0 ** 10000 }}",
    "{{ ('9' * 5000)|int + '' }}",
    "{{ '%d' % (10 ** 5000) }}",
    "{{ range(1, 2, 0)|list }}",
    "{{ 'x'|indent(none) }}",
    "{{ raise_exception('x' * 4000000) }}",
    "{{ {}.nope() }}",
    "{{ {'a': 1}|dictsort(by='nope') }}",
    "{{ x }}{% set x = 1 %}{{ messages[0].content.nope.nope }}",
    "{% for a, b in [1] %}{% endfor %}",
]

CLASSES = {"time": TIME, "memory": MEMORY, "nesting": NESTING, "malformed": MALFORMED}
PAYLOADS = [(name, i, source) for name, sources in CLASSES.items() for i, source in enumerate(sources)]


@pytest.fixture(scope="module")
def probed() -> dict[tuple[str, int], dict]:
    """Every payload's outcome, from one probe process that forks once per payload."""
    script = Path(__file__).with_name("template_probe.py")
    sources = [source for _, _, source in PAYLOADS]
    out = subprocess.run([sys.executable, str(script), str(TIME_LIMIT)], input=json.dumps(sources),
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    results = [json.loads(line) for line in out.splitlines()]
    assert len(results) == len(PAYLOADS)
    return {(name, i): r for (name, i, _), r in zip(PAYLOADS, results)}


@pytest.mark.parametrize("kind,index", [(name, i) for name, i, _ in PAYLOADS])
def test_hostile_template_fails_fast_and_small(probed, kind, index):
    result = probed[kind, index]
    assert result["clean"], result  # a ChatTemplateError
    assert result["seconds"] < MAX_SECONDS, result
    assert result["rss_mib"] < MAX_RSS_MIB, result
