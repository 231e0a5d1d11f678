"""`pipeline router`: one address in front of several `pipeline serve` instances.

It speaks the daemon's wire protocol (``frontend.protocol``) on both sides, so clients use it
as they would a daemon. Over mixed replicas (``--instance``) or disaggregated pools
(``--prefill``/``--decode``). Modules: ``args`` (the flags, ``RouterArgs``), ``server`` (the
client side on ``frontend.zmq_server``, the one loop, start-up and drain), ``table`` (the
request table, dispatch to instances, an instance lost, stats ops), ``answers`` (the
instances' answers), ``upstream`` (one DEALER per instance, its health and load), ``policy``
(which instance runs a request), ``pd`` (a request split over a decode and a prefill
instance), ``stats`` (the instances' stats merged). It imports no stage package: only
``messages``, ``config``, ``frontend`` and the gateway's systemd notifier. See docs/router.md.
"""
