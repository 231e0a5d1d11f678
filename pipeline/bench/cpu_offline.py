"""`pipeline bench cpu`, offline part: one engine's `LLM.generate` on one checkpoint, run as a
child process so that each engine (this one, or vLLM's CPU backend from its own virtualenv)
loads alone, with its own threads and memory, and the parent compares them.

Run as a script (``python cpu_offline.py JSON_ARGS``): it imports nothing from this package
at module level, so vLLM's interpreter can run the file as it is. Prints one JSON line:
load seconds, the peak RSS of this process and the RSS of its tree at the end, and per batch
size: the time of a 1-token generate (prefill and one step), of the full generate (each the
best of ``repeats``), and the decode rate from their difference.

Both engines get the same token-id prompts (drawn by the parent), prefix caching off (every
timed generate reuses prompts an earlier one prefilled: with it on, the prefills are cache
hits and the figures say nothing of prefill; it made batch-32 prompts "prefill" at 11.7k
tok/s, above the AMX peak), greedy sampling,
``ignore_eos`` so every request makes exactly ``output_len`` tokens, no detokenisation cost
beyond each engine's default, and one warm-up generate before anything is timed.
Owns nothing beyond the run.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any


def _engine(a: dict[str, Any]) -> tuple[Any, Any]:
    """(llm, SamplingParams class) of the engine ``a["engine"]``, loaded."""
    if a["engine"] == "vllm":
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VSP
        kw: dict[str, Any] = {"dtype": a["dtype"], "max_model_len": a["max_model_len"],
                              "max_num_seqs": a["max_num_seqs"], "skip_tokenizer_init": True,
                              "seed": 0, "enable_prefix_caching": False}
        return VLLM(model=a["model"], **kw), VSP
    from pipeline import LLM, SamplingParams
    kw = {"dtype": a["dtype"], "max_model_len": a["max_model_len"], "max_num_seqs": a["max_num_seqs"],
          "worker_threads": a["threads"], "enable_prefix_caching": False}
    if a.get("quantization", "none") != "none":
        kw["quantization"] = a["quantization"]
    return LLM(a["model"], skip_tokenizer_init=True, **kw), SamplingParams


def _timed(llm: Any, sp_cls: Any, prompts: list[list[int]], max_tokens: int, vllm: bool) -> float:
    kw = {"detokenize": False} if vllm else {}
    sp = sp_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    batch = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != max_tokens * len(prompts):
        raise RuntimeError(f"{made} tokens generated, expected {max_tokens * len(prompts)}")
    return dt


def run(a: dict[str, Any]) -> dict[str, Any]:
    vllm = a["engine"] == "vllm"
    t0 = time.perf_counter()
    llm, sp_cls = _engine(a)
    load_s = time.perf_counter() - t0
    prompts: list[list[int]] = a["prompts"]
    _timed(llm, sp_cls, prompts[:1], 4, vllm)  # warm-up: first-call costs on both sides
    out: dict[str, Any] = {"engine": a["engine"], "load_s": load_s, "batches": {}}
    for b in a["batches"]:
        # Best of --repeats: the other load of a shared machine only ever adds time.
        first = min(_timed(llm, sp_cls, prompts[:b], 1, vllm) for _ in range(a["repeats"]))
        total = min(_timed(llm, sp_cls, prompts[:b], a["output_len"], vllm) for _ in range(a["repeats"]))
        decode = total - first
        # A full generate timed no longer than a 1-token one: another process took the
        # machine during the latter, and the difference says nothing (it read 9.5e10 tok/s).
        rate = b * (a["output_len"] - 1) / decode if decode > 0 else float("nan")
        out["batches"][str(b)] = {"total_s": total, "prefill_s": first,
                                  "output_tok_per_s": b * a["output_len"] / total,
                                  "decode_tok_per_s": rate}
    out["max_rss_mib"] = _hwm_mib()
    out["rss_mib"] = _tree_rss_mib()
    return out


def _hwm_mib() -> float:
    """This process's peak RSS (VmHWM: reset at exec, unlike ru_maxrss, which a child
    inherits from the parent that forked it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _tree_rss_mib() -> float:
    """RSS now of this process and its children (vLLM's engine core runs in a child)."""
    import psutil
    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2**20


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file again
    result = run(json.loads(sys.argv[1]))
    # The last line of stdout is the result (engines may print their own lines before it).
    sys.stdout.write("\n" + json.dumps(result) + "\n")
