"""What every ZMQ front end of the daemon's protocol shares: `pipeline serve` (``gateway.serve``)
and `pipeline router` (``router.server``) serve it, ``pipeline.client`` and the HTTP front end
speak it.

- protocol: the wire protocol (ZMQ frames: the messages, their decoding, the errors)
- request_parser: a ``Generate`` or a pipe mode JSON line -> the tokenizer stage's input
- sessions: which client owns which request in flight
- zmq_server: the one ZMQ server base (the front ROUTER socket, frames in, answers out,
  clients gone), which the daemon and the router build on
- args: the front flags (``FrontArgs``), their checks, the open-port test, start-up failure
"""
