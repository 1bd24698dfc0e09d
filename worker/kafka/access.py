"""Whether the cluster lets the worker in: the ACLs the worker needs, and a start-up probe that finds a wrong
password or a missing ACL in seconds, with the worker's own credentials (worker.kafka.client).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import KafkaException, TopicCollection
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)

from worker.config import Settings
from worker.kafka.client import principal_of
from worker.kafka.errors import AUTHORIZATION, UNKNOWN_TOPIC, BrokerAccessError, Identity, access_error, cause_of
from worker.kafka.roles import admin_client

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 20.0


# -- ACLs ------------------------------------------------------------------------------------------------------
def worker_acls(settings: Settings, principal: str | None = None, host: str = "*") -> list[AclBinding]:
    """The ACLs a worker needs, as docs/security.md lists them: READ on the input topics and the group, WRITE on
    the results and dead-letter topics and the routes that are on, READ and WRITE on the control topic, and for
    exactly-once WRITE on its transactional ids (by prefix).
    READ and WRITE imply DESCRIBE; WRITE on a topic implies IDEMPOTENT_WRITE (Kafka >= 3.0)."""
    who = principal or principal_of(settings.kafka)
    allow = AclPermissionType.ALLOW

    def acl(rtype: ResourceType, name: str, op: AclOperation,
            pattern: ResourcePatternType = ResourcePatternType.LITERAL) -> AclBinding:
        return AclBinding(rtype, name, pattern, who, host, op, allow)

    t = settings.topics
    out = [acl(ResourceType.TOPIC, name, AclOperation.READ) for name in (t.realtime, t.standard, t.bulk)]
    out.append(acl(ResourceType.GROUP, settings.kafka.group_id, AclOperation.READ))
    out += [acl(ResourceType.TOPIC, name, AclOperation.WRITE) for name in (t.results, t.dead_letter, *t.routes())]
    # The control topic: read (the group's policy) and write (this worker's report under its own key).
    out += [acl(ResourceType.TOPIC, t.control, op) for op in (AclOperation.READ, AclOperation.WRITE)]
    if settings.delivery.mode == "exactly_once":
        out.append(acl(ResourceType.TRANSACTIONAL_ID, f"{settings.delivery.transactional_id_prefix}-",
                       AclOperation.WRITE, ResourcePatternType.PREFIXED))
    return out


# -- the start-up probe --------------------------------------------------------------------------------------------
def probe_reachable(settings: Settings, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Connect and log in with the [kafka] settings: BrokerAccessError on a refusal, False when no broker
    answered within the timeout, True otherwise. For the command-line tools and the worker's start-up."""
    return _reach(_probe_admin(settings), settings, time.monotonic() + timeout_s)


def _probe_admin(settings: Settings) -> Any:
    identity = Identity.of(settings)
    refusals: list[Any] = []
    admin: Any = admin_client(settings.kafka, logger=log,
                              error_cb=lambda err: refusals.append(access_error(err, identity)))
    admin.refusals = refusals
    return admin


def _reach(admin: Any, settings: Settings, deadline: float) -> bool:
    identity = Identity.of(settings)
    # librdkafka reports a refused login through the error callback only, served by poll().
    while True:
        try:
            admin.list_topics(timeout=1.0)
            return True
        except KafkaException as exc:
            found = access_error(exc, identity)
            if found is not None:
                raise found from None
        admin.poll(0)
        refused = [r for r in admin.refusals if r is not None and r.cause != UNKNOWN_TOPIC]
        if refused:
            raise refused[0]
        if time.monotonic() >= deadline:
            log.warning("no broker of %s answered within the start-up probe; carrying on (the clients retry)",
                        settings.kafka.bootstrap_servers)
            return False


def probe_access(settings: Settings, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Check, with the worker's own credentials, that the cluster lets it in and that it may read its input
    topics and group and write its output topics. Raises BrokerAccessError on a refusal; an unreachable
    cluster only logs (the worker's clients keep retrying, and /healthz reports it). Returns whether the cluster
    answered."""
    identity = Identity.of(settings)
    admin = _probe_admin(settings)
    deadline = time.monotonic() + timeout_s
    if not _reach(admin, settings, deadline):
        return False
    # 2. The topics and the group, with the operations the worker needs on each.
    t = settings.topics
    wanted = {name: AclOperation.READ for name in (t.realtime, t.standard, t.bulk)}
    wanted.update({t.results: AclOperation.WRITE, t.dead_letter: AclOperation.WRITE})
    missing: dict[str, BrokerAccessError] = {}
    while True:
        missing.clear()
        futures = admin.describe_topics(TopicCollection(list(wanted)), include_authorized_operations=True,
                                        request_timeout=max(1.0, deadline - time.monotonic()))
        for name, fut in futures.items():
            op = wanted[name].name
            try:
                ops = fut.result()
            except KafkaException as exc:
                err = access_error(exc, identity, topic=name, operation=op)
                if err is None:
                    log.warning("start-up probe: could not describe topic %s (%s)", name, exc.args[0].str())
                    continue
                if err.cause == UNKNOWN_TOPIC:
                    missing[name] = err
                    continue
                raise err from None
            allowed = ops.authorized_operations
            if allowed is not None and wanted[name] not in allowed and AclOperation.ALL not in allowed:
                acl = f"ACL: {op} on topic {name} for principal {identity.principal}"
                raise BrokerAccessError(f"Kafka would deny the worker {op} on topic {name!r}; grant {acl}",
                                        AUTHORIZATION, acl)
        # A topic being created alongside the worker (a compose topics job) gets until the deadline.
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if missing:
        raise next(iter(missing.values()))
    futures = admin.describe_consumer_groups([settings.kafka.group_id], include_authorized_operations=True,
                                             request_timeout=max(1.0, deadline - time.monotonic()))
    for fut in futures.values():
        try:
            group = fut.result()
        except KafkaException as exc:
            err = access_error(exc, identity)
            if err is not None and cause_of(exc) == AUTHORIZATION:
                raise err from None
            log.warning("start-up probe: could not describe group %s (%s)", settings.kafka.group_id, exc)
            continue
        allowed = group.authorized_operations
        if allowed is not None and AclOperation.READ not in allowed and AclOperation.ALL not in allowed:
            acl = f"ACL: READ on group {settings.kafka.group_id} for principal {identity.principal}"
            raise BrokerAccessError(f"Kafka would deny the worker its consumer group; grant {acl}",
                                    AUTHORIZATION, acl)
    return True

