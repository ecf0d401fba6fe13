"""The API server, through the official `kubernetes` client: how we connect, and every
call retried with backoff when the server is busy or briefly gone.

429 (throttled, honouring Retry-After), 500/502/503/504 and connection failures are
retried with exponential backoff and jitter (an update also on 409 Conflict:
`call_retrying_conflicts`); anything else is the caller's to handle
(404, a 409 on create, a 422 for an object the server refuses). A create that got a 409
after a retry is how a lost answer looks: the object exists, and the caller checks it is
ours (`create_or_adopt`), so a retry never duplicates a pod.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from services.backends.kubernetes.api import (
    ApiUnreachable,
    KubernetesBackendError,
    KubeSettings,
    ObjectClash,
    describe_api_error,
)
from services.backends.kubernetes.spec import LABEL_JOB

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
# Connection refused/reset, timeouts: the server restarting or a network blip.
_TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def api_client(settings: KubeSettings) -> k8s.ApiClient:
    """An ApiClient for the settings: a plain URL, a kubeconfig context, in-cluster."""
    if settings.server:
        cfg = k8s.Configuration()
        cfg.host = settings.server.rstrip("/")
        return k8s.ApiClient(cfg)
    try:
        if not settings.context:
            try:
                k8s_config.load_incluster_config()
                return k8s.ApiClient()
            except ConfigException:
                pass
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(context=settings.context or None, client_configuration=cfg)
        return k8s.ApiClient(cfg)
    except (ConfigException, OSError, ValueError) as exc:
        where = f"context {settings.context!r}" if settings.context else "the current context"
        raise KubernetesBackendError(
            f"cannot load the Kubernetes credentials for {where} ({exc}); set KUBECONFIG and "
            "RHIZOME_K8S_CONTEXT, run the daemon in the cluster, or set RHIZOME_K8S_SERVER"
        ) from exc


def retry_after(exc: ApiException) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class Calls:
    """Every API call of the backend goes through `call`: retried, then a clear error."""

    def __init__(self, settings: KubeSettings, sleep: Callable[[float], None] = time.sleep):
        self.settings = settings
        self.sleep = sleep
        self.retries = 0  # how many calls were retried (tests and the benchmark read it)

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        delay = self.settings.backoff_s
        last = ""
        for attempt in range(self.settings.attempts):
            try:
                return fn(*args, **kwargs)
            except ApiException as exc:
                if exc.status not in RETRIED_STATUSES:
                    raise
                last = describe_api_error(exc)
                wait = retry_after(exc) if exc.status == 429 else None
            except _TRANSPORT_ERRORS as exc:
                last = f"{type(exc).__name__}: {exc}"
                wait = None
            if attempt + 1 == self.settings.attempts:
                break
            self.retries += 1
            pause = wait if wait is not None else delay * (1 + random.random())
            log.info("%s: %s; retrying in %.2f s", what, last, pause)
            self.sleep(min(pause, 5.0))
            delay = min(delay * 2, 2.0)
        where = self.settings.server or self.settings.context or "the cluster"
        raise ApiUnreachable(
            f"{what}: the Kubernetes API server ({where}) failed {self.settings.attempts} "
            f"times, last: {last}; check that it runs and that RHIZOME_K8S_CONTEXT or "
            "RHIZOME_K8S_SERVER points at it"
        )

    def call_retrying_conflicts(
        self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """`call`, also retrying a 409 Conflict (an update that raced another writer of
        the object) with the same backoff; after the last attempt the 409 is raised."""
        delay = self.settings.backoff_s
        for attempt in range(self.settings.attempts):
            try:
                return self.call(what, fn, *args, **kwargs)
            except ApiException as exc:
                if exc.status != 409 or attempt + 1 == self.settings.attempts:
                    raise
                self.retries += 1
                log.info("%s: %s; retrying", what, describe_api_error(exc))
                self.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def create_or_adopt(
        self,
        what: str,
        create: Callable[..., Any],
        read: Callable[..., Any],
        namespace: str,
        body: Mapping[str, Any],
        job_id: str,
    ) -> dict[str, Any]:
        """Create `body`; when it exists already, keep it if it is this job's (an earlier
        attempt whose answer was lost), else fail naming whose it is."""
        name = str(body["metadata"]["name"])
        try:
            created = self.call(what, create, namespace, body, _preload_content=False)
            return _json(created)
        except ApiException as exc:
            if exc.status != 409:
                raise KubernetesBackendError(f"{what}: refused: {describe_api_error(exc)}") from exc
        existing = _json(self.call(what, read, name, namespace, _preload_content=False))
        owner = ((existing.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB)
        if owner != job_id:
            kind = body.get("kind", "object")
            raise ObjectClash(
                f"{what}: a {kind} named {name} already exists in namespace {namespace} and is "
                f"not this job's (its {LABEL_JOB} label is {owner!r}); delete or rename it"
            )
        return existing

    def delete(
        self, what: str, fn: Callable[..., Any], name: str, namespace: str, **kw: Any
    ) -> bool:
        """Delete; gone already is fine (rollback is idempotent). True if it was there."""
        try:
            self.call(what, fn, name, namespace, _preload_content=False, **kw)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise KubernetesBackendError(f"{what}: refused: {describe_api_error(exc)}") from exc


def _json(response: Any) -> dict[str, Any]:
    """The JSON body of an unparsed (`_preload_content=False`) response."""
    import json

    data = response.data if hasattr(response, "data") else response
    if isinstance(data, bytes | str):
        parsed = json.loads(data or b"{}")
        return parsed if isinstance(parsed, dict) else {}
    return dict(data) if isinstance(data, Mapping) else {}


def json_body(response: Any) -> dict[str, Any]:
    return _json(response)
