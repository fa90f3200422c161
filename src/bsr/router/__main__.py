"""``python -m bsr.router``: the reference router in front of a fleet of vLLM instances.

Example (three instances, each started with ``--kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "a"}'``, its own topic)::

    python -m bsr.router --listen 127.0.0.1:8000 --events tcp://127.0.0.1:5557 \\
        --instance a=http://127.0.0.1:8001 --instance b=http://127.0.0.1:8002 \\
        --instance c=http://127.0.0.1:8003 --block-size 16 --shared-media STORAGE
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from ._index import MEDIA
from ._server import EventSubscriber, PDSplit, Router, RouterServer


def _instance(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=http://host:port")
    return name, url


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host or "127.0.0.1", int(port)


def parser(prog: str = "python -m bsr.router") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Route OpenAI requests to the vLLM instance holding the longest prefix "
        "(from the instances' KV events), or round-robin.",
    )
    p.add_argument("--listen", type=_address, default=("127.0.0.1", 8000), help="HOST:PORT")
    p.add_argument(
        "--events",
        default="tcp://127.0.0.1:5557",
        help="ZMQ endpoint the router binds; each instance's publisher connects there, its "
        "topic its name",
    )
    p.add_argument(
        "--instance",
        type=_instance,
        action="append",
        default=[],
        help="NAME=http://host:port (repeat; NAME is the instance's event topic)",
    )
    pd = p.add_argument_group("prefill/decode split (instead of --instance)")
    pd.add_argument("--prefill", help="http://host:port of the prefill instance (kv_producer)")
    pd.add_argument("--decode", help="http://host:port of the decode instance (kv_consumer)")
    pd.add_argument("--decode-warm", help="http://host:port of the decode instance's warm endpoint")
    pd.add_argument("--chunk-tokens", type=int, help="bsr's chunk_tokens on both instances")
    pd.add_argument(
        "--await-s", type=float, default=5.0, help="the longest wait for the prefill's save"
    )
    p.add_argument("--block-size", type=int, required=True, help="the instances' block size")
    p.add_argument("--policy", choices=("prefix", "round_robin"), default="prefix")
    p.add_argument(
        "--shared-media",
        nargs="*",
        choices=MEDIA,
        default=[],
        help="media every instance reads (the pool: STORAGE for a shared FileTier root, Redis "
        "or Mooncake)",
    )
    p.add_argument("--tokenizer", help="a tokenizer (path or name) to route text prompts")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bsr.router") -> int:
    """Run the router until SIGTERM or SIGINT (``bsr router`` and ``python -m bsr.router``)."""
    p = parser(prog)
    ns = p.parse_args(argv)
    split = None
    if ns.prefill or ns.decode:
        if ns.instance or not (ns.prefill and ns.decode and ns.decode_warm and ns.chunk_tokens):
            p.error(
                "a prefill/decode split takes --prefill, --decode, --decode-warm and "
                "--chunk-tokens, and no --instance"
            )
        split = PDSplit(ns.prefill, ns.decode, ns.decode_warm, ns.chunk_tokens, ns.await_s)
        ns.instance = [("prefill", ns.prefill), ("decode", ns.decode)]
    elif not ns.instance:
        p.error("give the fleet's instances (--instance NAME=URL, repeated) or --prefill/--decode")
    tokenizer: Any = None
    if ns.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = _Tokenizer(AutoTokenizer.from_pretrained(ns.tokenizer))
    try:
        router = Router(
            dict(ns.instance),
            ns.block_size,
            policy=ns.policy,
            shared_media=ns.shared_media,
            tokenizer=tokenizer,
        )
    except ValueError as e:
        print(f"bsr.router: {e}", file=sys.stderr)
        return 2
    events = EventSubscriber(router, ns.events).start()
    server = RouterServer(ns.listen, router, pd=split)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serving = threading.Thread(target=server.serve_forever, name="bsr-router-http", daemon=True)
    serving.start()
    print(f"bsr.router: {server.url}, events at {events.endpoint}", flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()
    events.close()
    return 0


class _Tokenizer:
    """A transformers tokenizer as the router calls it: ``text -> ids`` and chat templates."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool) -> list[int]:
        return list(
            self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        )


if __name__ == "__main__":
    sys.exit(main())
