"""What a stage process is: its spec, its rings, its process entry and its log.

- spec: `StageSpec` (what the gateway tells a stage at start), `ModelInfo` (what the worker
  learnt at load time, with the KV cache layout)
- rings: the ring table, one declaration per ring (who writes, who reads, which instance
  roles, what it carries, how big), and `Channel`, one end of a ring that speaks its messages
- ring_sizes: the bounds ring sizes come from (`Sizes`, `answer_bytes_bound`, `capacity`)
- process: `stage_process` (every stage's process entry), `ReadyFn`, exit codes, the stop
  signal, `log`
- lifecycle: starting, watching and stopping stage processes (`spawn_stage`, `wait_ready`,
  `stop_stages`), for every owner of stages: the gateway, a TP node, `llm_tp`

Stage packages import this, never the gateway.
"""
