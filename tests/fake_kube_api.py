"""A stand-in for the Kubernetes API server's node endpoints, for the kubernetes scheduler
backend's tests (no API server can be run on the test machine). It enforces the request
shapes a real one does for what rankguard sends:

- `GET /api/v1/nodes/{name}`: the node, with a resourceVersion that every write bumps;
- `PATCH /api/v1/nodes/{name}`: a JSON merge patch (`application/merge-patch+json`: null
  deletes a key, lists are replaced whole) or a strategic-merge patch; a patch carrying a
  `metadata.resourceVersion` other than the node's is refused with 409 Conflict;
- `PATCH /api/v1/nodes/{name}/status`: a strategic-merge patch of `status`, whose
  `conditions` merge by their `type` (their patch merge key);
- any other content type: 415; an unknown node: 404; anything else: 405.

`conflicts` makes the next N node patches meet a concurrent writer (the node changes
first, so the 409 is real); every request is recorded as (method, path, content type,
body) for the tests to read."""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NODE = re.compile(r"^/api/v1/nodes/([a-z0-9.-]+)(/status)?$")
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def merge(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


class FakeKubeApi(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, nodes: dict[str, dict]):
        self.nodes = {name: {"apiVersion": "v1", "kind": "Node",
                             "metadata": {"name": name, "resourceVersion": "1"}, **node}
                      for name, node in nodes.items()}  # fmt: skip
        self.requests: list[tuple[str, str, str, object]] = []
        self.conflicts = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def bump(self, name: str) -> None:
        meta = self.nodes[name]["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def kubeconfig(self, path) -> None:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))  # fmt: skip

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._answer(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": reason, "message": message, "code": code})  # fmt: skip

    def do_GET(self) -> None:
        api: FakeKubeApi = self.server  # type: ignore[assignment]
        m = NODE.match(self.path.split("?")[0])
        with api.lock:
            api.requests.append(("GET", self.path, "", None))
            if not m or m.group(2) or m.group(1) not in api.nodes:
                return self._status(404, "NotFound", f"{self.path} not found")
            return self._answer(200, api.nodes[m.group(1)])

    def do_PATCH(self) -> None:
        api: FakeKubeApi = self.server  # type: ignore[assignment]
        path = self.path.split("?")[0]
        kind = self.headers.get("Content-Type", "").split(";")[0].strip()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        m = NODE.match(path)
        with api.lock:
            api.requests.append(("PATCH", path, kind, body))
            if not m or m.group(1) not in api.nodes:
                return self._status(404, "NotFound", f"{path} not found")
            name, status = m.group(1), bool(m.group(2))
            node = api.nodes[name]
            if kind not in (MERGE, STRATEGIC) or not isinstance(body, dict):
                return self._status(415, "UnsupportedMediaType", f"{kind} is not supported here")
            if status:
                if kind != STRATEGIC or set(body) != {"status"}:
                    return self._status(422, "Invalid", "status: a strategic merge of status only")
                conditions = {c["type"]: c for c in node.get("status", {}).get("conditions", [])}
                for c in body["status"].get("conditions", []):
                    conditions[c["type"]] = {**conditions.get(c["type"], {}), **c}
                node.setdefault("status", {})["conditions"] = list(conditions.values())
            else:
                if api.conflicts:  # a concurrent writer got there first
                    api.conflicts -= 1
                    api.bump(name)
                wanted = (body.get("metadata") or {}).get("resourceVersion")
                if wanted is not None and wanted != node["metadata"]["resourceVersion"]:
                    return self._status(409, "Conflict", "the object has been modified; please "
                                        "apply your changes to the latest version and try again")  # fmt: skip
                patch = copy.deepcopy(body)
                patch.get("metadata", {}).pop("resourceVersion", None)
                api.nodes[name] = merge(node, patch)
            api.bump(name)
            return self._answer(200, api.nodes[name])
