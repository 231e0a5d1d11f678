"""`pipeline router`: one address in front of several `pipeline serve` instances.

It speaks the daemon's wire protocol (``frontend.protocol``) on both sides, so clients use it
as they would a daemon. Over mixed replicas (``--instance``) or disaggregated pools
(``--prefill``/``--decode``). Modules: ``args`` (the flags), ``server`` (the front ROUTER
socket and its one loop, the request table, start-up and drain), ``upstream`` (one DEALER
per instance, its health and load), ``policy`` (which instance runs a request), ``pd`` (a
request split over a decode and a prefill instance), ``stats`` (the instances' stats merged).
It imports no stage package: only ``messages``, ``config`` and the gateway's protocol and
systemd modules. See docs/router.md.
"""
