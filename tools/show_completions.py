"""Print `pipeline run` answers (JSON lines on stdin) as readable prompt + completion blocks.

Usage: pipeline run --ordered < PROMPTS | python tools/show_completions.py PROMPTS
Used by `make run`. The prompt file is read only to show each prompt before its completion;
its lines are plain prompts or JSON objects, as pipe mode takes them.
"""
from __future__ import annotations

import json
import sys


def load_prompts(path: str) -> dict[str, str]:
    prompts: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = line
            if isinstance(obj, dict):
                prompts[str(obj.get("id", index))] = str(obj.get("prompt", ""))
            else:
                prompts[str(index)] = line
    return prompts


def main() -> int:
    prompts = load_prompts(sys.argv[1]) if len(sys.argv) > 1 else {}
    failed = 0
    for line in sys.stdin:
        ans = json.loads(line)
        rid = str(ans.get("id"))
        print(f"--- {rid} " + "-" * max(0, 60 - len(rid)))
        if ans.get("error"):
            failed += 1
            print(f"error: {ans['error'].get('code')}: {ans['error'].get('message')}\n")
            continue
        print(f"\033[1m{prompts.get(rid, '')}\033[0m{ans.get('text', '')}"
              if sys.stdout.isatty() else f"[{prompts.get(rid, '')}]{ans.get('text', '')}")
        usage, t = ans.get("usage") or {}, ans.get("timings") or {}
        print(f"    ({usage.get('completion_tokens')} tokens, finish_reason={ans.get('finish_reason')}, "
              f"ttft {1000 * (t.get('ttft') or 0):.1f} ms, e2e {1000 * (t.get('e2e') or 0):.0f} ms)\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
