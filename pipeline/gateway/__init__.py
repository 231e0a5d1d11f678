"""The gateway: the main process. Starts and supervises the stage processes, owns the rings
and the in-flight table, and is the front of every way in.

- gateway: `Gateway` (in-flight table, supervision, drain); stages: its base, the instance's
  rings and stage processes brought up and torn down (``runtime.lifecycle``'s tools)
- worker_node: `serve --node-rank R`, a host lending its worker ranks to node 0
- serve: `pipeline serve`, the ZMQ daemon (systemd Type=notify); sessions, metrics, systemd,
  curve are its parts
- pipe: `pipeline run`, pipe mode (JSON lines or plain prompts on stdin); pipe_input: its
  lines parsed into requests; pipe_output: its answer lines
- protocol: the wire protocol (ZMQ frames) and the request parser pipe mode shares
- openai_api, openai_convert: the OpenAI API's request models and the conversions to and from
  the wire protocol, shared by the HTTP front end (``pipeline.http``) and pipe mode's OpenAI
  batch files (batch)
- http_front: `serve --http`: the port, the private ipc endpoint, the front-end process
"""
