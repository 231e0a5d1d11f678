"""The gateway: the main process. Starts and supervises the stage processes, owns the rings
and the in-flight table, and is the front of every way in.

- gateway: `Gateway` (in-flight table, supervision, drain); stages: its base, the instance's
  rings and stage processes brought up and torn down (``runtime.lifecycle``'s tools)
- worker_node: `serve --node-rank R`, a host lending its worker ranks to node 0
- serve: `pipeline serve`, the ZMQ daemon (systemd Type=notify): its start-up, loop and drain;
  serve_front: its front on ``frontend.zmq_server`` (generates to the gateway, answers back);
  serve_args its flags (``ServeArgs``); metrics and systemd are its parts
- pipe: `pipeline run`, pipe mode (JSON lines or plain prompts on stdin); pipe_input: its
  lines parsed into requests; pipe_output: its answer lines
- batch: pipe mode's OpenAI batch files
"""
