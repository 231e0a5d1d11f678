"""The OpenAI HTTP front end (`pipeline serve --http`): a FastAPI app on uvicorn in its own
process that is a client of the daemon (``pipeline.client.AsyncClient`` over a private ipc
socket), like `pipeline router` is; its request models and the conversions it shares with
pipe mode's OpenAI batch files; and the daemon's side that starts it.

- app: routes, authentication, error shapes
- stream: server-sent events
- limit: the body-size middleware (413)
- process: the entry (``python -m pipeline.http.process``)
- openai_api, openai_convert, openai_response: the OpenAI API's request models, the
  conversion of bodies to the wire protocol (``frontend.protocol``) and of answers back to
  bodies, shared with pipe mode's batch files (``gateway.batch``)
- launcher: the daemon's side of ``--http``: the port, the private ipc endpoint, the
  front-end process (imported by ``gateway.serve``; the app itself never is)
"""
