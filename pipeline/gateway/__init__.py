"""The gateway: the main process. Starts and supervises the stage processes, owns the rings
and the in-flight table, and is the front of every way in.

- gateway: `Gateway` (rings, stages, in-flight table, supervision, drain)
- serve: `pipeline serve`, the ZMQ daemon (systemd Type=notify); sessions, metrics, systemd,
  curve are its parts
- pipe: `pipeline run`, pipe mode (JSON lines or plain prompts on stdin)
- protocol: the wire protocol (ZMQ frames) and the request parser pipe mode shares
- openai_api, openai_convert: the OpenAI API's request models and the conversions to and from
  the wire protocol, shared by the HTTP front end (``pipeline.http``) and pipe mode's OpenAI
  batch files (batch)
- http_front: `serve --http`: the port, the private ipc endpoint, the front-end process
"""
