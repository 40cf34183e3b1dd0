"""Constrained decoding (``quanta.engine.constraint``) on the two real tokenizers and models.

Oracles: llguidance's own llama.cpp vocabulary builder over llama-cpp-python's reading of the same GGUF (token
bytes, special tokens, masks); ``jsonschema`` for every generated JSON document; Python's ``re`` for regexes
and for the languages of the Lark and GBNF grammars.
"""

from __future__ import annotations

import gc
import json
import re
import time
import weakref

import jsonschema
import llguidance
import numpy as np
import pytest
from constraint_schemas import SCHEMAS, SchemaCase, generate_constrained, generate_constrained_batch

import quanta
from quanta.engine.constraint import (BatchMasker, Constraint, Grammar, TokenRejected, apply_bitmask,
                                      ll_tokenizer, mask_words, unpack_mask)
from quanta.hub import resolve_model
from quanta.tokenizer.vocab import TokenAttr

MODELS = ("smollm2-135m", "gemma3-270m")  # byte-level BPE (49k tokens), SentencePiece (262k)
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module", params=MODELS)
def llm(request: pytest.FixtureRequest) -> quanta.LLM:
    model = quanta.LLM(request.param, device="cpu")
    yield model
    model.close()


@pytest.fixture(scope="module", params=MODELS)
def tokenizer(request: pytest.FixtureRequest):
    return quanta.load_tokenizer(request.param)


def _accepts(constraint: Constraint, ids: list[int]) -> bool:
    """Whether the grammar takes ``ids`` whole and is then complete."""
    return constraint.valid_prefix(ids) == len(ids) and all(constraint.matcher.consume_token(i) for i in ids) \
        and constraint.eos_allowed


def _reference_tokenizer(model: str) -> tuple[llguidance.LLTokenizer, object]:
    """llguidance's tokenizer from llama.cpp's vocabulary, and the llama.cpp model it calls into (keep it alive)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from llguidance.llamacpp import lltokenizer_from_vocab

    ref = llama_cpp.Llama(model_path=str(resolve_model(model)), vocab_only=True, verbose=False)
    return lltokenizer_from_vocab(llama_cpp.llama_model_get_vocab(ref.model)), ref


# ---- the vocabulary llguidance sees ------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:llama_token_get_attr is deprecated:DeprecationWarning")  # llguidance's call
@pytest.mark.parametrize("model", MODELS)
def test_vocabulary_matches_llguidance_llamacpp_builder(model: str) -> None:
    """Every token's bytes as llguidance's llama.cpp builder reads them; the same special tokens, except the
    user-defined ``<...>`` text tokens (Gemma's HTML tags), which that builder guesses are special and ours,
    like our tokenizer (it always splits them out of text), treat as text; and the same masks along a document."""
    (ref, _owner), tokenizer = _reference_tokenizer(model), quanta.load_tokenizer(model)
    ours = ll_tokenizer(tokenizer)
    n = tokenizer.vocab_size
    assert ours.vocab_size == ref.vocab_size == n
    assert [i for i in range(n) if ours.decode_bytes([i]) != ref.decode_bytes([i])] == []
    differ = {i for i in range(n) if ours.is_special_token(i) != ref.is_special_token(i)}
    attrs, tokens = tokenizer.vocab.attrs, tokenizer.vocab.tokens
    guessed = {i for i in range(n) if attrs[i] == TokenAttr.USER_DEFINED and tokens[i].startswith("<")
               and tokens[i].endswith(">")}
    assert differ == guessed
    assert set(ours.eos_tokens) == set(tokenizer.eog_ids) and set(ref.eos_tokens) <= set(ours.eos_tokens)

    grammar = Grammar.json_schema(SCHEMAS[0].schema)
    mine, theirs = Constraint(grammar, ours), Constraint(grammar, ref)
    keep = np.ones(n, bool)
    keep[list(guessed | set(ours.eos_tokens))] = False
    for token in tokenizer.encode(json.dumps(SCHEMAS[0].valid), add_special=False):
        assert np.array_equal(mine.allowed()[keep], theirs.allowed()[keep])
        mine.advance(token)
        theirs.advance(token)
    assert mine.eos_allowed and theirs.eos_allowed


def test_ll_tokenizer_is_cached_and_pads_to_the_model_vocabulary(tokenizer) -> None:
    n = tokenizer.vocab_size
    padded = ll_tokenizer(tokenizer, n + 37)
    assert padded is ll_tokenizer(tokenizer, n + 37) and padded is not ll_tokenizer(tokenizer)
    assert padded.vocab_size == n + 37
    text = "Hello, wörld!\n  {\"a\": [1, 2]}"
    assert padded.tokenize_str(text) == tokenizer.encode(text, add_special=False)
    with pytest.raises(ValueError, match="smaller"):
        ll_tokenizer(tokenizer, n - 1)
    constraint = Constraint(Grammar.regex(r"[a-z ]{0,20}"), padded)
    assert constraint.bitmask().shape == (mask_words(n + 37),)
    allowed = constraint.allowed()
    assert allowed.shape == (n + 37,) and allowed[:n].sum() > 100 and not allowed[n:].any()
    logits = np.zeros(n + 50, np.float32)  # wider than the mask too
    constraint.apply(logits)
    assert np.array_equal(np.isfinite(logits), np.concatenate([allowed, np.zeros(13, bool)]))


def test_ll_tokenizer_does_not_keep_its_tokenizer_alive() -> None:
    tokenizer = quanta.load_tokenizer("smollm2-135m")
    llt = ll_tokenizer(tokenizer)
    alive = weakref.ref(tokenizer)
    del tokenizer, llt
    gc.collect()
    assert alive() is None


def test_special_tokens_are_never_text(tokenizer) -> None:
    """Control tokens (``<|im_start|>``, ``<start_of_turn>``, ...) stay out of any text rule; a grammar can name
    them; EOS is allowed exactly where the grammar is complete."""
    llt = ll_tokenizer(tokenizer)
    control = np.flatnonzero(tokenizer.vocab.attrs & int(TokenAttr.CONTROL))
    eog = sorted(tokenizer.eog_ids)
    anything = Constraint(Grammar.regex(r"(.|\n)*"), llt)
    allowed = anything.allowed()
    assert not allowed[np.setdiff1d(control, eog)].any() and allowed[eog].all()
    word = Constraint(Grammar.regex("hello"), llt)
    assert not word.allowed()[eog].any()
    for token in tokenizer.encode("hello", add_special=False):
        word.advance(token)
    assert word.is_finished and np.array_equal(np.flatnonzero(word.allowed()), eog)
    unused = tokenizer.vocab.attrs & int(TokenAttr.UNUSED)
    special = min(i for i in control.tolist() if i not in tokenizer.eog_ids and not unused[i])
    named = Constraint(Grammar.lark(f'start: "ok" {tokenizer.vocab.tokens[special]}'), llt)
    for token in tokenizer.encode("ok", add_special=False):
        named.advance(token)
    assert np.flatnonzero(named.allowed()).tolist() == [special]


# ---- the schema corpus ---------------------------------------------------------------------------------------
def test_corpus_has_fifty_schemas_and_its_instances_agree_with_jsonschema() -> None:
    assert len(SCHEMAS) >= 50 and len({c.name for c in SCHEMAS}) == len(SCHEMAS)
    for case in SCHEMAS:
        validator = jsonschema.Draft202012Validator(case.schema, format_checker=FORMATS)
        assert validator.is_valid(case.valid), case.name
        assert not validator.is_valid(case.invalid), case.name


def test_grammar_takes_valid_instances_and_refuses_invalid_ones(tokenizer) -> None:
    llt = ll_tokenizer(tokenizer)
    for case in SCHEMAS:
        grammar = Grammar.json_schema(case.schema)
        valid = tokenizer.encode(json.dumps(case.valid, ensure_ascii=False), add_special=False)
        invalid = tokenizer.encode(json.dumps(case.invalid, ensure_ascii=False), add_special=False)
        assert _accepts(Constraint(grammar, llt), valid), case.name
        assert not _accepts(Constraint(grammar, llt), invalid), case.name


def _prompt(llm: quanta.LLM, subject: str) -> list[int]:
    return llm.tokenize(f"A JSON value for {subject}:\n")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_generated_json_validates(llm: quanta.LLM, temperature: float) -> None:
    """Every schema of the corpus, the real model choosing: 100% of the outputs are finished, parse, and
    validate against their schema."""
    llt = ll_tokenizer(llm.tokenizer, llm.model.n_vocab)
    jobs = [(_prompt(llm, case.name), Constraint(Grammar.json_schema(case.schema), llt)) for case in SCHEMAS]
    failures = []
    for case, (ids, finished) in zip(SCHEMAS, generate_constrained_batch(llm, jobs, temperature=temperature)):
        text = llm.detokenize(ids)
        error = _schema_error(case, text) if finished else "not finished"
        if error:
            failures.append(f"{case.name}: {text!r}: {error}")
    assert failures == []


@pytest.mark.parametrize("asynchronous", [False, True], ids=["in-step", "queued-ahead"])
def test_masked_argmax_on_the_backend_equals_the_host_sampler(llm: quanta.LLM, asynchronous: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Constrained greedy rows are picked by the backend's masked argmax (with steps queued ahead as a device
    backend queues them, each mask made once the step before has advanced its grammar); the host sampler, which
    a logprobs request forces, picks the same tokens. Unconstrained rows share the batch."""
    llt = ll_tokenizer(llm.tokenizer, llm.model.n_vocab)
    masked: list[int] = []
    argmax = llm.backend.argmax_rows
    monkeypatch.setattr(llm.backend, "argmax_rows",
                        lambda logits, masks=None: masked.append(masks is not None) or argmax(logits, masks))
    monkeypatch.setattr(llm.engine, "asynchronous", asynchronous)

    def run(logprobs: int | None) -> list[tuple[list[int], bool]]:
        llm.engine.reset_prefix_cache()
        jobs = [(_prompt(llm, case.name), Constraint(Grammar.json_schema(case.schema), llt)) for case in SCHEMAS[:5]]
        jobs.append((llm.tokenize("Once upon a time"), None))
        return generate_constrained_batch(llm, jobs, max_tokens=24, logprobs=logprobs)

    host = run(logprobs=0)
    assert not any(masked)
    device = run(logprobs=None)
    assert any(masked)
    assert device == host


def _schema_error(case: SchemaCase, text: str) -> str | None:
    try:
        jsonschema.validate(json.loads(text), case.schema, format_checker=FORMATS)
    except (ValueError, jsonschema.ValidationError) as e:
        return str(e).splitlines()[0]
    return None


# ---- regexes and grammars -----------------------------------------------------------------------------------
# (kind, source, an equivalent Python regex, prompt)
GRAMMAR_CASES = (
    ("regex", r"(yes|no|maybe)", r"(yes|no|maybe)", "Answer yes or no: is the sky blue?\n"),
    ("regex", r"[0-9]{3}-[0-9]{4}", r"[0-9]{3}-[0-9]{4}", "Phone number: "),
    ("regex", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}", "A person's name: "),
    ("regex", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
     r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "Today's date: "),
    ("lark", 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/', r"The answer is [1-9][0-9]{0,2}\.",
     "What is 6 times 7? "),
    ("lark", 'start: item (", " item){0,2}\nitem: "apple" | "pear" | "plum"',
     r"(apple|pear|plum)(, (apple|pear|plum)){0,2}", "Fruit list: "),
    ("lark", 'start: expr\nexpr: term (("+" | "-") term){0,2}\nterm: /[0-9]{1,2}/ | "(" /[0-9]{1,2}/ "*" /[0-9]/ ")"',
     r"([0-9]{1,2}|\([0-9]{1,2}\*[0-9]\))([+-]([0-9]{1,2}|\([0-9]{1,2}\*[0-9]\))){0,2}", "Arithmetic: "),
    ("gbnf", 'root ::= "The capital is " city "."\ncity ::= "Paris" | "Rome" | "Berlin"',
     r"The capital is (Paris|Rome|Berlin)\.", "Capital of France? "),
    ("gbnf", 'root ::= digit{2,4} ("." digit)?\ndigit ::= [0-9]', r"[0-9]{2,4}(\.[0-9])?", "A number: "),
    ("gbnf", 'root ::= word (" " word)?\nword ::= [a-z]{2,6}', r"[a-z]{2,6}( [a-z]{2,6})?", "Two words: "),
)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind,source,oracle,prompt", GRAMMAR_CASES, ids=[f"{c[0]}{i}" for i, c in
                                                                         enumerate(GRAMMAR_CASES)])
def test_generated_text_matches_regex_and_grammar(llm: quanta.LLM, kind: str, source: str, oracle: str,
                                                  prompt: str, temperature: float) -> None:
    grammar = getattr(Grammar, kind)(source)
    constraint = Constraint(grammar, ll_tokenizer(llm.tokenizer, llm.model.n_vocab))
    ids, finished = generate_constrained(llm, llm.tokenize(prompt), constraint, temperature=temperature, seed=7)
    text = llm.detokenize(ids)
    assert finished and re.fullmatch(oracle, text), text


# ---- errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,message", [
    (lambda: Grammar.json_schema({"type": "strin"}), "Invalid type"),
    (lambda: Grammar.json_schema('{"type": "object"'), "invalid JSON schema"),
    (lambda: Grammar.json_schema([1, 2]), "must be an object"),
    (lambda: Grammar.json_schema({"$ref": "#/$defs/missing"}), "does not exist"),
    (lambda: Grammar.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
    (lambda: Grammar.json_schema({"type": "string", "format": "no-such-format"}), "Unknown format"),
    (lambda: Grammar.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (lambda: Grammar.regex("[a-"), "unclosed character class"),
    (lambda: Grammar.regex(5), "must be a string"),
    (lambda: Grammar.lark("start: undefined_rule"), "unknown name"),
    (lambda: Grammar.lark('start: "a" /[/'), "invalid Lark grammar"),
    (lambda: Grammar.gbnf("root ::= missing"), "not found"),
    (lambda: Grammar.gbnf('root ::= "a" ('), "invalid GBNF grammar"),
    (lambda: Grammar.from_response_format({"type": "xml"}), "response_format type"),
    (lambda: Grammar.from_response_format({"type": "json_schema"}), "json_schema"),
])
def test_rejected_schemas_and_grammars_raise_value_error(make, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_unknown_special_token_is_a_value_error_once_the_vocabulary_is_known(tokenizer) -> None:
    grammar = Grammar.lark('start: "a" <|no_such_token|>')  # cannot be checked without a vocabulary
    with pytest.raises(ValueError, match="unknown special token"):
        Constraint(grammar, ll_tokenizer(tokenizer))


def test_response_format() -> None:
    assert Grammar.from_response_format(None) is None and Grammar.from_response_format({"type": "text"}) is None
    assert Grammar.from_response_format({"type": "json_object"}) == Grammar.json_object()
    schema = SCHEMAS[0].schema
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    assert Grammar.from_response_format(rf) == Grammar.json_schema(schema) == Grammar.json_schema(json.dumps(schema))


# ---- the per-sequence state ------------------------------------------------------------------------------------
def test_advance_rejects_a_token_outside_the_mask_and_clone_reset_rollback(tokenizer) -> None:
    llt = ll_tokenizer(tokenizer)
    constraint = Constraint(Grammar.json_schema(SCHEMAS[0].schema), llt)
    ids = tokenizer.encode(json.dumps(SCHEMAS[0].valid), add_special=False)
    start = constraint.bitmask()
    for token in ids[:3]:
        constraint.advance(token)
    copy = constraint.clone()
    middle = constraint.bitmask()
    constraint.rollback(2)
    assert constraint.valid_prefix(ids[1:]) == len(ids) - 1
    constraint.reset()
    assert np.array_equal(constraint.bitmask(), start) and np.array_equal(copy.bitmask(), middle)
    for token in ids[3:]:
        copy.advance(token)
    assert copy.eos_allowed and copy.is_finished and not constraint.eos_allowed
    bad = tokenizer.encode("[", add_special=False)[0]
    with pytest.raises(TokenRejected):
        constraint.advance(bad)


def test_batch_masker_equals_one_mask_at_a_time(tokenizer) -> None:
    llt = ll_tokenizer(tokenizer, tokenizer.vocab_size + 5)
    constraints: list[Constraint | None] = []
    for k in range(64):
        case = SCHEMAS[k % len(SCHEMAS)]
        c = Constraint(Grammar.json_schema(case.schema), llt)
        ids = tokenizer.encode(json.dumps(case.valid, ensure_ascii=False), add_special=False)
        for token in ids[:k % max(1, len(ids))]:
            c.advance(token)
        constraints.append(c)
    constraints[5] = None
    masker = BatchMasker(llt.vocab_size, threads=2)
    masks = masker.compute(constraints)
    assert masks.shape == (64, mask_words(llt.vocab_size))
    for row, c in enumerate(constraints):
        expected = np.full(masks.shape[1], -1, np.int32) if c is None else c.bitmask()
        assert np.array_equal(masks[row], expected), row
    logits = np.zeros((64, llt.vocab_size), np.float32)
    apply_bitmask(logits, masks)
    assert np.array_equal(np.isfinite(logits), unpack_mask(masks, llt.vocab_size))
    one = masker.compute([None, constraints[7], None])  # one constrained row: computed on the calling thread
    assert np.array_equal(one[1], constraints[7].bitmask()) and (one[[0, 2]] == -1).all()


# ---- measurement (run as a script) -----------------------------------------------------------------------------
def mask_seconds_per_step(tokenizer, batch: int, steps: int = 30) -> tuple[float, float]:
    """Mean seconds per decode step to compute, then to apply, the masks of ``batch`` sequences, each walking
    a corpus instance token by token (one mask call per step: ``bitmask()`` alone, ``BatchMasker`` for more)."""
    llt = ll_tokenizer(tokenizer)
    walks = []  # [constraint, the instance's ids, position]
    for k in range(batch):
        case = SCHEMAS[k % len(SCHEMAS)]
        ids = tokenizer.encode(json.dumps(case.valid, ensure_ascii=False), add_special=False)
        walks.append([Constraint(Grammar.json_schema(case.schema), llt), ids, 0])
    masker, logits = BatchMasker(llt.vocab_size), np.zeros((batch, llt.vocab_size), np.float32)
    computing = applying = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        masks = walks[0][0].bitmask()[None] if batch == 1 else masker.compute([w[0] for w in walks])
        computing += time.perf_counter() - start
        start = time.perf_counter()
        apply_bitmask(logits, masks)
        applying += time.perf_counter() - start
        for walk in walks:
            constraint, ids, position = walk
            if position < len(ids):
                constraint.advance(ids[position])
                walk[2] += 1
            else:  # walked to its end: start it again
                walk[0], walk[2] = Constraint(constraint.grammar, llt), 0
    return computing / steps, applying / steps


if __name__ == "__main__":  # PYTHONPATH=src:tests/engine python tests/engine/test_constraint.py
    for name in MODELS:
        model = quanta.LLM(name, device="cpu")
        model.generate("Hi", max_tokens=8, temperature=0)
        start = time.perf_counter()
        model.generate("Hi", max_tokens=32, temperature=0, ignore_eos=True)
        step = (time.perf_counter() - start) / 32
        for batch in (1, 64):
            compute, apply = mask_seconds_per_step(model.tokenizer, batch)
            print(f"{name}: batch {batch:2d}: masks {compute * 1e3:.2f} ms + applying them {apply * 1e3:.2f} ms "
                  f"per step; one batch-1 decode step {step * 1e3:.1f} ms")
