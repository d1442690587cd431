"""Nodes out and back through the Kubernetes API, as `scontrol` drains and resumes on Slurm
(`[scheduler] backend = "kubernetes"`, supervisor/scheduler.py).

Out: the taint `rankguard.io/unhealthy` (effect `NoSchedule` by default: no new pod lands
there; the job controller decides about the running ones) and the node condition
`RankguardHealthy=False` with the reason, which other tools read; with `cordon`, the node
is also marked unschedulable, and an annotation remembers that rankguard did it. Back:
the taint removed, the condition `True`, the cordon lifted only when rankguard set it.

Only rankguard's own taint, condition and annotation are ever written: taints and
conditions of other tools (NVIDIA's NVSentinel, node-problem-detector) are read and kept
as they are. A change of the node's taints is a merge patch that carries the
resourceVersion it was computed from, so a concurrent writer makes the API answer 409 and
the change is computed again on the new node (at most `attempts` times); the condition is
a strategic-merge patch on the `status` subresource, merged by its type.

The official client (`pip install 'rankguard[kubernetes]'`) is imported here only, on the
supervisor; its credentials are the pod's service account, else the kubeconfig.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from typing import Any

log = logging.getLogger("rankguard.supervisor.kube_nodes")

TAINT_KEY = "rankguard.io/unhealthy"
CONDITION = "RankguardHealthy"
CORDONED = "rankguard.io/cordoned"  # annotation: rankguard cordoned the node, so it uncordons
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


class KubeError(Exception):
    """An answer of the API that is not what the change needs (one line); `status`: the
    API's HTTP status, when it answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def client_api():
    """CoreV1Api from the pod's service account, else the kubeconfig (raises KubeError)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubeError("[scheduler] backend = kubernetes needs the Kubernetes client: "
                        "pip install 'rankguard[kubernetes]'") from None  # fmt: skip
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            # $KUBECONFIG as it is now (the client reads it once, at its import)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        except (config.ConfigException, OSError) as exc:
            raise KubeError(f"no in-cluster service account and no kubeconfig: {exc}") from None
    return client.CoreV1Api()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_taint(taints: list[dict], effect: str) -> list[dict] | None:
    """Pure: the node's taints with rankguard's (None: already there as wanted)."""
    ours = {"key": TAINT_KEY, "effect": effect}
    if any(t.get("key") == TAINT_KEY and t.get("effect") == effect for t in taints):
        return None
    return [t for t in taints if t.get("key") != TAINT_KEY] + [ours]


def without_taint(taints: list[dict]) -> list[dict] | None:
    """Pure: the node's taints without rankguard's (None: it has none)."""
    kept = [t for t in taints if t.get("key") != TAINT_KEY]
    return None if len(kept) == len(taints) else kept


class KubeNodes:
    def __init__(self, api=None, effect: str = "NoSchedule", cordon: bool = False,
                 attempts: int = 5) -> None:  # fmt: skip
        if effect not in EFFECTS:
            raise KubeError(f"taint effect must be one of {', '.join(EFFECTS)}, got {effect!r}")
        self.api = api if api is not None else client_api()
        self.effect, self.cordon, self.attempts = effect, cordon, attempts

    # -- the two changes --------------------------------------------------------------------
    def drain(self, node: str, reason: str) -> dict:
        def change(n: dict) -> dict | None:
            patch: dict[str, Any] = {}
            taints = with_taint(n.get("spec", {}).get("taints") or [], self.effect)
            if taints is not None:
                patch["spec"] = {"taints": taints}
            if self.cordon and not n.get("spec", {}).get("unschedulable"):
                patch.setdefault("spec", {})["unschedulable"] = True
                patch["metadata"] = {"annotations": {CORDONED: "true"}}
            return patch or None

        return self._outcome(node, "drain", change, ("False", "RankguardExcluded", reason))

    def resume(self, node: str) -> dict:
        def change(n: dict) -> dict | None:
            patch: dict[str, Any] = {}
            taints = without_taint(n.get("spec", {}).get("taints") or [])
            if taints is not None:
                patch["spec"] = {"taints": taints}
            if (n.get("metadata", {}).get("annotations") or {}).get(CORDONED):
                patch.setdefault("spec", {})["unschedulable"] = False
                patch["metadata"] = {"annotations": {CORDONED: None}}
            return patch or None

        why = "its agent's health check passed"
        return self._outcome(node, "resume", change, ("True", "RankguardHealthy", why))

    # -- I/O ----------------------------------------------------------------------------------
    def _outcome(self, node: str, what: str, change, condition: tuple[str, str, str]) -> dict:
        out: dict[str, Any] = {"backend": "kubernetes", "node": node, "action": what}
        try:
            out["patched"] = self._patch_node(node, change)
            self._set_condition(node, *condition)
        except KubeError as exc:
            log.error("node %s: %s failed: %s", node, what, exc)
            return {**out, "ok": False, "error": str(exc)}
        return {**out, "ok": True}

    def _call(self, method: str, *args: Any, **kw: Any) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = getattr(self.api, method)(*args, _preload_content=False, **kw)
            return json.loads(resp.data or b"{}")
        except ApiException as exc:
            raise KubeError(f"{method}: {exc.status} {exc.reason}".strip(), exc.status) from None
        except (OSError, ValueError) as exc:
            raise KubeError(f"{method}: {exc}") from None

    def _patch_node(self, node: str, change) -> bool:
        """Read the node, compute the change, patch it under its resourceVersion; again on
        a conflict. False when there was nothing to change."""
        for _ in range(self.attempts):
            current = self._call("read_node", node)
            patch = change(current)
            if patch is None:
                return False
            version = current.get("metadata", {}).get("resourceVersion")
            patch.setdefault("metadata", {})["resourceVersion"] = version
            try:
                self._call("patch_node", node, patch, _content_type=MERGE)
                return True
            except KubeError as exc:
                if exc.status != 409:
                    raise
                log.info("node %s changed meanwhile (409): computing the change again", node)
        raise KubeError(f"the node kept changing: {self.attempts} conflicts in a row")

    def _set_condition(self, node: str, status: str, reason: str, message: str) -> None:
        now = _now()
        condition = {"type": CONDITION, "status": status, "reason": reason,
                     "message": message[:1024], "lastHeartbeatTime": now,
                     "lastTransitionTime": now}  # fmt: skip
        self._call("patch_node_status", node, {"status": {"conditions": [condition]}},
                   _content_type=STRATEGIC)  # fmt: skip
