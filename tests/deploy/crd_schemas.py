"""JSON schemas for the two custom resources deploy/k8s uses, written here from their CRDs'
documented fields (kubernetes-validate has the built-in kinds only). They are deliberately
narrow: the top-level spec keys are closed (a misspelt key fails), the fields this project sets
are typed, and the redis-streams trigger's own rules are spelt out. They are not the full CRDs.
"""

from __future__ import annotations

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name"],
         "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                        "namespace": {"type": "string"}, "labels": _STR_MAP,
                        "annotations": _STR_MAP}}
_COUNT = {"type": "string", "pattern": "^[0-9]+$"}

# KEDA keda.sh/v1alpha1 ScaledObject (KEDA 2.12+), with the redis-streams trigger's metadata:
# a stream, an address (address, host or their *FromEnv forms), and one of pendingEntriesCount,
# streamLength, lagCount (lagCount with activationLagCount, as KEDA's docs require).
REDIS_STREAMS_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["stream"],
    "properties": {key: {"type": "string", "minLength": 1} for key in (
        "address", "addressFromEnv", "host", "hostFromEnv", "port", "portFromEnv",
        "usernameFromEnv", "passwordFromEnv", "stream", "consumerGroup", "databaseIndex",
        "enableTLS", "unsafeSsl")} | {key: _COUNT for key in (
        "pendingEntriesCount", "streamLength", "lagCount", "activationLagCount")},
    "anyOf": [{"required": ["address"]}, {"required": ["addressFromEnv"]},
              {"required": ["host"]}, {"required": ["hostFromEnv"]}],
    "oneOf": [{"required": ["pendingEntriesCount"]}, {"required": ["streamLength"]},
              {"required": ["lagCount"]}],
    "dependentRequired": {"lagCount": ["activationLagCount", "consumerGroup"],
                          "pendingEntriesCount": ["consumerGroup"]},
}

SCALED_OBJECT = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string"},
                                   "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {"type": "object"},
                "fallback": {"type": "object"},
                "triggers": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"}, "name": {"type": "string"},
                            "metadata": _STR_MAP, "metricType": {"enum": [
                                "AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object", "required": ["name"]}},
                        "if": {"properties": {"type": {"const": "redis-streams"}}},
                        "then": {"properties": {"metadata": REDIS_STREAMS_METADATA}},
                    },
                },
            },
        },
    },
}

# Prometheus Operator monitoring.coreos.com/v1 ServiceMonitor.
SERVICE_MONITOR = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "minProperties": 1, "properties": {
                    "matchLabels": _STR_MAP, "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array"}, "podTargetLabels": {"type": "array"},
                "sampleLimit": {"type": "integer"},
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False,
                        "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                            "tlsConfig": {"type": "object"},
                            "bearerTokenSecret": {"type": "object"},
                            "authorization": {"type": "object"},
                            "params": {"type": "object"}},
                    },
                },
            },
        },
    },
}

CUSTOM = {("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
          ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR}
