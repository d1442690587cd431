"""rankguard.service: what both daemons (agent and supervisor) run on: the routed JSON
HTTP server, systemd's sd_notify, and the package version."""
