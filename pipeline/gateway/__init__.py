"""The gateway: the main process. Starts and supervises the stage processes, owns the rings
and the in-flight table, and is the front of every way in.

- gateway: `Gateway` (rings, stages, in-flight table, supervision, drain)
- supervisor: spawning stage processes, waiting for their ready reports, their last words
- serve: `pipeline serve`, the ZMQ daemon (systemd Type=notify), on ``frontend.zmq_server``;
  serve_args its flags (``ServeArgs``); metrics and systemd are its parts
- pipe: `pipeline run`, pipe mode (JSON lines or plain prompts on stdin)
- batch: pipe mode's OpenAI batch files
"""
