"""`quanta run [-m MODEL] [PROMPT | -]`: generate text from a prompt, streamed to stdout as it is decoded.

Models with a chat template (and Gemma) get the prompt as a user turn of their template unless ``--raw``.
The model, device and sampling options are shared with `quanta chat`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_PROMPT_HELP = "the prompt; '-' reads it from stdin (also when omitted and stdin is not a terminal)"


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="a GGUF path or known model name (default smollm2-135m)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu or cuda (default auto: cuda where an NVIDIA GPU and torch with CUDA are found)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available cores)")
    p.add_argument("--n-ctx", type=int, default=None, help="context length (default: the model's, at most 4096)")
    p.add_argument("--exact", action="store_true", help="fp32 activations (reference mode; slower)")
    p.add_argument("--cpu-isa", choices=("avx2", "avx_vnni", "avx512_vnni"), default=None,
                   help="force the CPU's int8 kernels onto one instruction set (default: the fastest it has)")
    p.add_argument("--kv-type", choices=("auto", "f32", "f16", "q8"), default="auto",
                   help="how the KV cache stores keys and values: auto (f32 in --exact, f16 otherwise), f32, "
                        "f16, or q8 (int8: about a quarter of f32's memory)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N GPUs of this host, one process each (default 1)")
    p.add_argument("--speculative", choices=["ngram"], default=None,
                   help="lossless speculative decoding: 'ngram' drafts from the text so far (pays on repetitive "
                        "output: copying, editing, summarising)")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The batched engine's settings (quanta.engine.EngineConfig), for verbs that serve many requests."""
    p.add_argument("--max-seqs", type=int, default=None,
                   help="sequences decoded together in one step (default: 8 on the CPU, 256 on CUDA)")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="tokens per forward: longer prompts prefill in chunks (default: 512 CPU, 2048 CUDA)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV-pool size in blocks of 16 tokens")
    p.add_argument("--kv-memory", type=float, default=None,
                   help="KV-pool size in GiB (default: room for --max-seqs full contexts, at most 90%% of the "
                        "device's free memory)")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the KV of shared prompt prefixes")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``quanta.LLM`` keyword arguments from :func:`add_engine_options`' flags."""
    kv_memory = getattr(args, "kv_memory", None)
    if kv_memory is not None and not kv_memory > 0:
        raise ValueError(f"--kv-memory must be a positive number of GiB, got {kv_memory}")
    return dict(max_seqs=getattr(args, "max_seqs", None), max_batched_tokens=getattr(args, "max_batched_tokens", None),
                kv_blocks=getattr(args, "kv_blocks", None),
                kv_memory=int(kv_memory * 2**30) if kv_memory is not None else None,
                prefix_caching=not getattr(args, "no_prefix_cache", False),
                speculative=getattr(args, "speculative", None), kv_dtype=getattr(args, "kv_type", "auto"))


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling; 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p x the top one (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise repeated tokens; 1 = off")
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text)")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--stats", action="store_true", help="print TTFT, prefill and decode speed to stderr")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help=DEFAULT_PROMPT_HELP)
    add_model_options(p)
    add_sampling_options(p)
    p.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    p.add_argument("--stop", action="append", default=None, help="stop at this string (repeatable)")
    add_constraint_options(p)


def add_constraint_options(p: argparse.ArgumentParser, what: str = "the output") -> None:
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help=f"{what} is JSON valid against this schema file")
    shape.add_argument("--regex", metavar="R", help=f"{what} matches this regular expression (whole)")
    shape.add_argument("--grammar", metavar="FILE", help=f"{what} follows this grammar file (GBNF or Lark)")


def load_llm(args: argparse.Namespace) -> Any:
    from quanta.api import LLM

    return LLM(args.model, device=args.device, n_ctx=args.n_ctx, threads=args.threads, exact=args.exact,
               cpu_isa=args.cpu_isa, cuda=args.cuda, tensor_parallel=args.tensor_parallel, home=args.home,
               progress=True, **engine_kwargs(args))


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)


def uses_chat_template(llm: Any) -> bool:
    return bool(llm.tokenizer.has_chat_template) or llm.config.arch.startswith("gemma")


def print_stats(stats: Any) -> None:
    print(f"\n[prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} cached), generated "
          f"{stats.completion_tokens}; TTFT {stats.ttft_s * 1000:.0f} ms, prefill {stats.prefill_tok_s:.1f} tok/s, "
          f"decode {stats.decode_tok_s:.1f} tok/s]", file=sys.stderr)


def stream_to_stdout(pieces: Any) -> None:
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()


def output_constraint(args: argparse.Namespace) -> dict[str, Any]:
    """The generate keyword of ``--json-schema`` / ``--regex`` / ``--grammar`` (files read and the schema parsed
    here, so a bad one fails before the model loads; the grammar itself is checked by the engine)."""
    import json
    from pathlib import Path

    if args.regex is not None:
        return {"regex": args.regex}
    for flag, path in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
        if path is None:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {path}: cannot read it ({e})") from None
        if flag == "--grammar":
            return {"grammar": text}
        try:
            return {"json_schema": json.loads(text)}
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {path} is not JSON: {e}") from None
    return {}


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if args.prompt is None:
        raise ValueError("give a prompt (or '-' to read it from stdin); `quanta chat` talks interactively")
    return args.prompt


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    if args.raw and args.system:
        raise ValueError("--system needs the chat template; drop --raw")
    constraint = output_constraint(args)
    llm = load_llm(args)
    kwargs = sampling_kwargs(args)
    kwargs.update(stop=args.stop, **constraint)
    if args.raw or not uses_chat_template(llm):
        pieces = llm.stream(prompt, **kwargs)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        pieces = llm.stream_chat(messages + [{"role": "user", "content": prompt}], **kwargs)
    stream_to_stdout(pieces)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats and llm.last_result is not None:
        print_stats(llm.last_result.stats)
    return 0
