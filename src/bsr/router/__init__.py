"""A reference router for a fleet of vLLM instances sharing bsr's store.

It reads the KV events every instance publishes (vLLM's own, medium ``GPU``, and bsr's,
``CPU``/``STORAGE``), keeps what each holds by content (:class:`FleetIndex`), and sends each
request to the instance that serves its prefix cheapest (:class:`PrefixPolicy`; ties by load),
or round-robin for comparison. Run it with ``bsr router`` (``--help``; the same as ``python -m
bsr.router``) or embed
:class:`Router` / :class:`RouterServer`. Needs the ``router`` extra (``pyzmq``, ``msgspec``)
for the event socket; the index and the policies need nothing. docs/vllm.md "A fleet" says how
to put a production router (llm-d, Dynamo, vLLM's router) in its place.
"""

from ._index import MEDIA, FleetIndex, Match, block_digests, request_extra_keys
from ._policy import Choice, Policy, PrefixPolicy, RoundRobinPolicy
from ._server import EventSubscriber, PDSplit, Router, RouterServer, decode_batch

__all__ = [
    "MEDIA",
    "Choice",
    "EventSubscriber",
    "FleetIndex",
    "Match",
    "PDSplit",
    "Policy",
    "PrefixPolicy",
    "RoundRobinPolicy",
    "Router",
    "RouterServer",
    "block_digests",
    "decode_batch",
    "request_extra_keys",
]
