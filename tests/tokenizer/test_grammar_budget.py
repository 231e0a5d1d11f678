"""Issue 25 item 7: a grammar compile one request imposes on all. The tokenizer stage compiles
each structured-outputs spec once, in a child process killed past the budget
(``tokenizer/grammar_server.py``), and the worker loads what it compiled instead of compiling
on the step path.

On real processes: the grammar service's children (a refusal for the budget names the field
and the budget, is kept, and leaves the service serving; a spec asked for by many threads at
once compiles once), and `pipeline run` (one rank and two): a schema of the issue's kind is
answered with the budget's error while a plain request sent after it gets its tokens first,
and the instance keeps serving grammars."""
from __future__ import annotations

import json
import threading

import pytest
from e2e_helpers import run_pipe

from pipeline.config import DEFAULT_MODEL
from pipeline.sampling_params.structured import StructuredOutputsParams
from pipeline.structured_outputs import COMPILE_BUDGET_S, GrammarError, Grammars
from pipeline.tokenizer.grammar_server import GrammarService

MODEL = DEFAULT_MODEL
# The issue's: 3.6 to 14 s here (xgrammar's compile time of it varies that much run to run),
# so the service below runs with a budget of 0.5 s...
SLOW = '{"type":"string","pattern":"(([a-z]{1,12}){1,12}){1,12}"}'
# ...and the pipeline, whose budget is COMPILE_BUDGET_S (5 s), gets it one level deeper (over
# a minute here).
SLOWER = '{"type":"string","pattern":"((([a-z]{1,12}){1,12}){1,12}){1,12}"}'
EOS = [1]


@pytest.fixture(scope="module")
def service():
    svc = GrammarService(MODEL, 2048, EOS, budget_s=0.5)
    yield svc
    svc.close()


def test_a_compile_past_the_budget_is_refused_naming_the_field_and_kept(service):
    with pytest.raises(GrammarError, match=r"^structured_outputs\.json: did not compile within 0.5 s"):
        service.compile(StructuredOutputsParams(json=SLOW))
    n = service.compiles
    with pytest.raises(GrammarError, match="did not compile within 0.5 s"):  # from the cache
        service.compile(StructuredOutputsParams(json=SLOW))
    assert service.compiles == n
    # The killed process is replaced: the service keeps compiling.
    assert service.compile(StructuredOutputsParams(regex="[a-c]{2}x"))


def test_a_spec_compiles_once_however_many_ask(service):
    so = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    before = service.compiles
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda: out.append(service.compile(StructuredOutputsParams(json=so))))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert service.compiles == before + 1 and len(set(out)) == 1 and len(out) == 6
    # Key order is part of the spec (the output follows it): another order is another grammar.
    flipped = {"required": ["k"], "properties": so["properties"], "type": "object"}
    service.compile(StructuredOutputsParams(json=flipped))
    assert service.compiles == before + 2


def test_what_the_service_compiled_constrains_as_a_local_compile(service):
    """The bytes the worker receives load into the grammar a compile there would give: the
    same tokens are allowed along an accepted answer."""
    import xgrammar as xgr
    so = StructuredOutputsParams(regex=r"[a-z]{2,4}@(com|org)")
    g = Grammars(MODEL, 2048, EOS)
    loaded, local = g.matcher(g.load(service.compile(so), so)), g.matcher(g.compile(so))
    steps = 0
    while not local.is_terminated():
        masks = []
        for m in (loaded, local):
            bm = xgr.allocate_token_bitmask(1, 2048)
            m.fill_next_token_bitmask(bm)
            masks.append(bm)
        assert (masks[0] == masks[1]).all()
        words = masks[0][0].tolist()
        allowed = [t for t in range(2048) if words[t // 32] >> (t % 32) & 1]
        t = allowed[steps % len(allowed)]  # walk a different branch each step
        assert loaded.accept_token(t) and local.accept_token(t)
        steps += 1
    assert loaded.is_terminated() and steps >= 2


@pytest.mark.parametrize("tp", ["1", "2"])
def test_a_slow_grammar_delays_nobody_and_is_refused_for_the_budget(tp):
    plain = {"prompt": "The for statement", "max_tokens": 4, "temperature": 0}
    lines = [json.dumps({"id": "slow", "prompt": "x", "max_tokens": 8, "structured_outputs": {"json": SLOWER}}),
             json.dumps({"id": "plain", **plain}),
             json.dumps({"id": "after", "prompt": "Answer:", "max_tokens": 8, "temperature": 0,
                         "structured_outputs": {"choice": ["yes", "no"]}})]
    rc, answers, err = run_pipe(MODEL, lines, "--tensor-parallel-size", tp, "--worker-threads", "1")
    assert rc == 1, err[-2000:]  # pipe mode: 1 when a line failed
    order = [a["id"] for a in answers]
    assert order.index("plain") < order.index("slow"), order  # its tokens did not wait
    by_id = {a["id"]: a for a in answers}
    assert by_id["plain"]["error"] is None and len(by_id["plain"]["token_ids"]) == 4
    e = by_id["slow"]["error"]
    assert e["code"] == "invalid_request", e
    assert e["message"].startswith(f"structured_outputs.json: did not compile within {COMPILE_BUDGET_S:g} s"), e
    assert by_id["after"]["error"] is None and by_id["after"]["text"] in ("yes", "no")


def test_a_compile_process_gone_with_the_thread_that_started_it_is_replaced():
    """A compile process dies with the thread that started it (PR_SET_PDEATHSIG): a compile
    from another thread afterwards still gets its answer, however the death and the next
    compile interleave (a fresh process either way)."""
    svc = GrammarService(MODEL, 2048, EOS, budget_s=60)
    try:
        for i in range(3):
            so = StructuredOutputsParams(regex=f"[a-z]{{1,{i + 2}}}")
            t = threading.Thread(target=lambda so=so: svc.compile(so))
            t.start()
            t.join()  # its processes are SIGKILLed now, or about to be
            again = StructuredOutputsParams(regex=f"x[0-9]{{1,{i + 2}}}")  # not in the cache
            assert isinstance(svc.compile(again), bytes)
    finally:
        svc.close()
