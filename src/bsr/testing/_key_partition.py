"""A key-partition conformance suite: a KV store must never serve one input's KV to another.

Run it against your own deployment (a vLLM server with BsrConnector, or any connector that says
it keys by what vLLM's prefix cache keys by): for each kind of input that changes the KV of the
same token ids (a tenant's ``cache_salt``, a LoRA adapter, an image, prompt embeddings) it takes
two values A and B and checks, on a prompt of its own:

1. ``B`` computed with ``store: false`` (the reference of B: nothing restored, nothing stored);
2. ``A`` computed and stored (the reference of A); the suite waits until the save landed;
3. ``B`` again: **no** cached prompt token (a hit would be A's KV), the tokens of B's reference;
4. ``A`` again: **every** full chunk of the prompt cached (restored from the store), the tokens
   of A's reference; this proves A's KV is visible to lookups now;
5. ``B`` once more (``late``): still no cached token and B's tokens. Step 3 alone misses a
   deployment whose saves become visible a request (or a moment) late: step 4 proved A's KV
   visible, so a wrong key shows here;
6. optionally (``changes_output``) the control: A's and B's references differ, so the prompt
   depends on the value and a wrong hit would show in the tokens too.

A case with ``change`` checks a value that changes *in place*: an adapter whose weights are
rewritten under the same name, path, size and times, or reloaded. Its steps: A computed and
stored, A again (every full chunk cached: visible), then ``change()`` (rewrite the files and
reload the adapter in place, or restart the server over the same store with the new weights),
then B (usually the same request as A) computed with ``load: false, store: false`` (its
reference under the new weights), and B again, which must get no cached token and the tokens of
that reference. A harness that rewrites the files *before* the case (while the server still
computes with the weights it loaded) and reloads in ``change`` checks that the KV computed
with the loaded weights is never keyed by the files on disk.

How it works: the suite drives a :class:`KeyClient`, which sends one greedy completion of a
prompt under a :class:`Variant` and returns a :class:`Completion` (tokens and cached prompt
tokens). Two clients come with it: :class:`OpenAIKeyClient` (a running OpenAI-compatible server,
stdlib HTTP, bsr's ``/metrics`` to see saves land) and :class:`LLMKeyClient` (an in-process
``vllm.LLM``). Both send ``kv_transfer_params={"bsr": {"store": false}}`` for the references.
Serve with vLLM's own prefix cache off (``--no-enable-prefix-caching``): otherwise step 4's hit
may be vLLM's, not the store's (the suite still catches every cross-value hit of step 3).
"""

from __future__ import annotations

import base64
import io
import json
import random
import re
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Variant:
    """One value of one input kind, as the fields of a request.

    ``fields`` holds what the client puts into the request: ``cache_salt`` (a string),
    ``model`` (an OpenAI server's model or adapter name), ``lora`` (``(name, int_id, path)`` for
    :class:`LLMKeyClient`), ``prompt_embeds`` (a ``[n, hidden]`` torch tensor: the prompt is then
    these embeddings, the tokens are not sent), ``multi_modal_data`` / ``messages`` (passed
    through as they are).
    """

    name: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Completion:
    """One greedy completion: its tokens and how many prompt tokens were served cached."""

    tokens: tuple[int, ...]
    cached_tokens: int


class KeyClient(Protocol):
    """What the suite needs from a deployment."""

    def complete(
        self, prompt: Sequence[int], variant: Variant, *, store: bool, load: bool = True
    ) -> Completion:
        """A greedy completion of ``prompt`` under ``variant`` (``store``: may the connector
        save it; ``load``: may it restore a stored prefix, False only for a case with
        ``change``)."""
        ...

    def saves(self) -> float:
        """How many saves the connector has finished so far (a counter)."""
        ...


@dataclass(frozen=True)
class PartitionCase:
    """One input kind and two of its values.

    Attributes:
        kind: a name for the report (``"cache_salt"``, ``"lora"``, ``"image"``, ...).
        a, b: two values whose KV must never be shared.
        changes_output: whether A and B must give different tokens on the suite's prompt (true
            for an adapter or an image; a salt changes nothing of the computation).
        prompt_tokens: the prompt's length (the suite draws its tokens).
        change: for a value that changes in place (see the module docstring): called once A's
            KV is stored and restored; B is then the request after the change (the client's
            ``complete`` must take ``load=False`` for its reference).
    """

    kind: str
    a: Variant
    b: Variant
    changes_output: bool = True
    prompt_tokens: int = 200
    change: Callable[[], object] | None = None


@dataclass
class CaseReport:
    """What one case found; ``problems`` is empty when the store kept the values apart."""

    case: PartitionCase
    prompt: tuple[int, ...]
    reference_a: Completion
    reference_b: Completion
    cross: Completion
    hit: Completion
    expected_hit: int
    problems: list[str] = field(default_factory=list)
    late: Completion | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def check_key_partition(
    client: KeyClient,
    cases: Sequence[PartitionCase],
    *,
    chunk_tokens: int,
    vocab: tuple[int, int] = (3, 500),
    seed: int | None = None,
    save_timeout_s: float = 120.0,
) -> list[CaseReport]:
    """Run every case (see the module docstring); returns one report per case.

    Args:
        client: the deployment.
        cases: the input kinds and values to check.
        chunk_tokens: the store's chunk size: a hit restores ``(n - 1) // chunk * chunk`` tokens
            of an ``n``-token prompt (the last token is always computed).
        vocab: token ids to draw prompts from (``[lo, hi)``: leave out special tokens).
        seed: draws the prompts (None: fresh ones each run, so an earlier run's stored prefixes
            never answer).
        save_timeout_s: how long to wait for a save to land.
    """
    reports = []
    for case, prompt in zip(cases, draw_prompts(cases, seed, vocab)):
        n = _prompt_len(prompt, case)
        expected = (n - 1) // chunk_tokens * chunk_tokens
        if case.change is not None:
            reports.append(_changed_case(client, case, prompt, expected, save_timeout_s))
            continue
        ref_b = client.complete(prompt, case.b, store=False)
        before = client.saves()
        ref_a = client.complete(prompt, case.a, store=True)
        _wait_for_save(client, before, save_timeout_s, f"{case.kind}: {case.a.name}'s save")
        cross = client.complete(prompt, case.b, store=False)
        hit = client.complete(prompt, case.a, store=False)
        late = client.complete(prompt, case.b, store=False)
        rep = CaseReport(case, tuple(prompt), ref_a, ref_b, cross, hit, expected, late=late)
        if ref_b.cached_tokens or ref_a.cached_tokens:
            rep.problems.append(
                f"a fresh prompt was served cached tokens ({ref_b.cached_tokens} under "
                f"{case.b.name}, {ref_a.cached_tokens} under {case.a.name}) before anything of "
                "it was stored"
            )
        _check_cross(rep, cross, "after")
        _check_hit(rep)
        _check_cross(rep, late, "once A's KV was served (a save visible late)")
        _check_control(rep)
        reports.append(rep)
    return reports


def _changed_case(
    client: KeyClient, case: PartitionCase, prompt: Sequence[int], expected: int, timeout: float
) -> CaseReport:
    """A value changed in place (``case.change``): A stored and restored, the change, then B."""
    assert case.change is not None
    before = client.saves()
    ref_a = client.complete(prompt, case.a, store=True)
    _wait_for_save(client, before, timeout, f"{case.kind}: {case.a.name}'s save")
    hit = client.complete(prompt, case.a, store=False)
    case.change()
    ref_b = client.complete(prompt, case.b, store=False, load=False)
    cross = client.complete(prompt, case.b, store=False)
    rep = CaseReport(case, tuple(prompt), ref_a, ref_b, cross, hit, expected)
    if ref_a.cached_tokens:
        rep.problems.append(
            f"a fresh prompt was served {ref_a.cached_tokens} cached tokens under {case.a.name} "
            "before anything of it was stored"
        )
    if ref_b.cached_tokens:
        rep.problems.append(
            f"{case.b.name} with load: false was served {ref_b.cached_tokens} cached tokens: "
            "the deployment does not honour load: false, so this case cannot check it"
        )
    _check_hit(rep)
    _check_cross(rep, cross, "changed in place after")
    _check_control(rep)
    return rep


def _check_cross(rep: CaseReport, cross: Completion, when: str) -> None:
    """B after A's save: no cached token, B's reference tokens."""
    a, b, kind = rep.case.a.name, rep.case.b.name, rep.case.kind
    if cross.cached_tokens:
        rep.problems.append(
            f"{b} ({when} {a}'s save) was served {cross.cached_tokens} cached tokens of a "
            f"prompt only {a} stored: one {kind}'s KV served to another"
        )
    if cross.tokens != rep.reference_b.tokens:
        rep.problems.append(
            f"{b}'s tokens ({when} {a}'s save) differ from its own reference: "
            f"{list(cross.tokens)} != {list(rep.reference_b.tokens)}"
        )


def _check_hit(rep: CaseReport) -> None:
    """A again: every full chunk restored, A's reference tokens."""
    a, hit = rep.case.a.name, rep.hit
    if hit.cached_tokens != rep.expected_hit:
        rep.problems.append(
            f"{a} again was served {hit.cached_tokens} cached tokens, expected every full chunk "
            f"({rep.expected_hit}): a store keyed by {rep.case.kind} must still hit"
        )
    if hit.tokens != rep.reference_a.tokens:
        rep.problems.append(
            f"{a}'s tokens from its restored prefix differ from its reference: "
            f"{list(hit.tokens)} != {list(rep.reference_a.tokens)}"
        )


def _check_control(rep: CaseReport) -> None:
    case = rep.case
    if case.changes_output and rep.reference_a.tokens == rep.reference_b.tokens:
        rep.problems.append(
            f"control: {case.a.name} and {case.b.name} give the same tokens, so this prompt "
            "cannot show a wrong hit by its output; choose values that change the output"
        )


def report_dict(report: CaseReport) -> dict[str, Any]:
    """A report as plain JSON values (for a log or another process)."""
    runs = {
        "reference_a": report.reference_a,
        "reference_b": report.reference_b,
        "cross": report.cross,
        "hit": report.hit,
    }
    if report.late is not None:
        runs["late"] = report.late
    return {
        "kind": report.case.kind,
        "a": report.case.a.name,
        "b": report.case.b.name,
        "prompt": list(report.prompt),
        "expected_hit": report.expected_hit,
        "problems": list(report.problems),
        **{k: {"tokens": list(c.tokens), "cached": c.cached_tokens} for k, c in runs.items()},
    }


def draw_prompts(
    cases: Sequence[PartitionCase], seed: int | None, vocab: tuple[int, int] = (3, 500)
) -> list[list[int]]:
    """The prompts :func:`check_key_partition` sends for ``cases`` with ``seed`` (one each)."""
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(case.prompt_tokens)] for case in cases]


def assert_key_partition(reports: Sequence[CaseReport]) -> None:
    """Raise AssertionError listing every problem of every report."""
    problems = [f"[{r.case.kind}] {p}" for r in reports for p in r.problems]
    if problems:
        raise AssertionError("key partition broken:\n" + "\n".join(problems))


def _prompt_len(prompt: Sequence[int], case: PartitionCase) -> int:
    embeds = case.a.fields.get("prompt_embeds")
    return len(prompt) if embeds is None else int(embeds.shape[0])


def _wait_for_save(client: KeyClient, before: float, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while client.saves() <= before:
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not land within {timeout_s} s")
        time.sleep(0.1)


def _params(store: bool, load: bool = True) -> dict[str, Any]:
    return {"bsr": {"store": store} if load else {"store": store, "load": False}}


class OpenAIKeyClient:
    """A running OpenAI-compatible vLLM server (``/v1/completions``, ``/metrics``).

    The server needs ``--enable-prompt-tokens-details`` (cached tokens in the usage) and, for
    prompt embeddings, ``--enable-prompt-embeds``. ``model``: the served model name (a variant's
    ``model`` field names an adapter instead).
    """

    def __init__(self, base_url: str, model: str, *, max_tokens: int = 8, timeout_s: float = 120):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s

    def complete(
        self, prompt: Sequence[int], variant: Variant, *, store: bool, load: bool = True
    ) -> Completion:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": _params(store, load),
        }
        for k, v in variant.fields.items():
            if k == "prompt_embeds":
                body["prompt_embeds"] = encode_prompt_embeds(v)
                body["prompt"] = None
            else:
                body[k] = v
        out = self.post("/v1/completions", body)
        choice = out["choices"][0]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return Completion(
            tuple(choice.get("token_ids") or ()), int(details.get("cached_tokens") or 0)
        )

    def saves(self) -> float:
        return self.metric("vllm:bsr_saves_total")

    def post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return dict(json.loads(resp.read()))

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus metric's samples on ``/metrics`` whose labels include
        ``labels`` (0 if absent)."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=self.timeout_s) as resp:
            text = resp.read().decode()
        return metric_value(text, name, **labels)


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus text exposition that carry ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        found = dict(_LABEL.findall(rest))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def encode_prompt_embeds(tensor: Any) -> str:
    """``prompt_embeds`` as vLLM's OpenAI server takes them: base64 of ``torch.save``."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


class LLMKeyClient:
    """An in-process ``vllm.LLM``.

    ``saves``: a counter that grows when a save lands (e.g. the number of object files of a
    FileTier root); default: bsr's ``vllm:bsr_saves`` metric of the LLM (needs
    ``disable_log_stats=False``; vLLM reports it with a later engine step).
    """

    def __init__(
        self, llm: Any, *, max_tokens: int = 8, saves: Callable[[], float] | None = None
    ) -> None:
        self.llm = llm
        self.max_tokens = max_tokens
        self._saves = saves

    def complete(
        self, prompt: Sequence[int], variant: Variant, *, store: bool, load: bool = True
    ) -> Completion:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = SamplingParams(
            max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
            extra_args={"kv_transfer_params": _params(store, load)},
        )  # fmt: skip
        fields = dict(variant.fields)
        lora = fields.pop("lora", None)
        request: dict[str, Any] = {"prompt_token_ids": list(prompt)}
        if "prompt_embeds" in fields:
            request = {"prompt_embeds": fields.pop("prompt_embeds")}
        request.update(fields)
        out = self.llm.generate(
            [request], params, lora_request=None if lora is None else LoRARequest(*lora),
            use_tqdm=False,
        )[0]  # fmt: skip
        return Completion(tuple(out.outputs[0].token_ids), int(out.num_cached_tokens or 0))

    def saves(self) -> float:
        if self._saves is not None:
            return float(self._saves())
        return sum(
            float(getattr(m, "value", 0.0))
            for m in self.llm.get_metrics()
            if m.name == "vllm:bsr_saves"
        )
