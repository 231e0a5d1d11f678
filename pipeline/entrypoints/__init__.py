"""Entry points: the CLI (run, serve, bench, make-model), the gateway, the client."""
