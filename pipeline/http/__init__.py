"""The OpenAI HTTP front end's process (`pipeline serve --http`): a FastAPI app on uvicorn that
is a client of the daemon (``pipeline.client.AsyncClient`` over a private ipc socket), like
`pipeline router` is. The daemon starts, supervises and stops it (``gateway.http_front``);
the OpenAI request models and the conversions it shares with pipe mode's batch files are the
gateway's (``gateway.openai_api``, ``gateway.openai_convert``), as the ZMQ wire protocol is.

- app: routes, authentication, error shapes
- stream: server-sent events
- limit: the body-size middleware (413)
- process: the entry (``python -m pipeline.http.process``)
"""
